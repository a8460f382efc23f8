"""Forward step time on real process groups: fxshard (Inductor) vs DTensor eager vs DTensor +
torch.compile.

Llama-style model (4 layers, hidden 256), tensor-parallel (Megatron) plan, 4 gloo ranks on this
machine (CPU, loopback), all three in the same run on the same weights and tokens.  Per rank:
compile time (first call, including dynamo, fxshard's passes and Inductor), median forward time
over timed steps (a barrier before each, the three variants round-robin), and collectives per step
(in Inductor's post-grad graphs for the compiled variants, ``CommDebugMode`` for DTensor eager)
with the bytes each rank hands them (fxshard: its per-rank program, padding of uneven chunks
included; DTensor: its eager step's collective inputs).  Inductor's FX graph cache is off, so both
compiled variants compile cold.  Ratios are against DTensor + torch.compile.  On 2 cores the 4
ranks share the CPUs, so absolute times are noisy: quote medians and ratios.

``--model uneven``: ``zoo.uneven_config()`` (vocabulary 1001: 251 x 3 + 248 rows on 4 ranks,
hidden 96 in 6 heads, ffn 250) with the vocab-parallel plan, the same plan for all; ``--heads``
and ``--ffn`` change it.  torch's styles hand the model local tensors, so DTensor runs only what
divides but the vocabulary: a ``view(b, s, -1, head_dim)`` needs whole heads per rank (6 heads
are 1.5 per rank), and ``RowwiseParallel`` reads a 63-wide local ffn shard as a quarter of 252;
its rows then say why it fails.  ``--heads 8 --ffn 256`` is the model all three run.

    python benchmarks/step_time.py [--ranks 4] [--steps 20] [--batch 8] [--seq 64]
    python benchmarks/step_time.py --model uneven [--heads 8 --ffn 256] [--layers 2]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch


class CollectiveCounter:
    """Counts the collectives in the graphs Inductor compiles (its post-grad graph): a dispatch mode
    cannot count compiled code (dynamo falls back to eager under one).  Installed as Inductor's
    post-grad custom pass for the compiled variants; the uuid makes the FX graph cache key on it."""

    def __init__(self):
        self.n = 0

    def __call__(self, graph):
        for node in graph.nodes:
            ns = getattr(node.target, "namespace", None)
            if (
                node.op == "call_function"
                and ns in ("_c10d_functional", "c10d_functional")
                and "wait" not in str(node.target)
            ):
                self.n += 1

    def uuid(self):
        return "fxshard-benchmark-collective-counter"


def _eager_collectives(fn, x) -> int:
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn(x)
    return mode.get_total_counts()


def _time(fn, x, steps) -> list[float]:
    import torch.distributed as dist

    out = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fn(x)
        out.append(time.perf_counter() - t)
    return out


def _fxshard_bytes(progs) -> int:
    return sum(c.bytes + c.padding for p in progs for c in p.collectives())


def worker(rank, world, cfg_kw, batch, seq, steps, plan_name="megatron_tp_plan"):
    import torch.distributed as dist
    from decode import CollectiveBytes
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fxshard import zoo
    from fxshard.backend import compiled_programs, programs_built

    plan = getattr(zoo, plan_name)
    outputs = "dtensor" if plan_name == "vocab_parallel_plan" else "global"
    torch.manual_seed(0)
    cfg = zoo.LlamaConfig(**cfg_kw)
    base = zoo.init_weights(zoo.Llama(cfg), seed=0)
    tokens = torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)
    )
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.no_grad():
        ref = base(tokens)
    made, counts, nbytes, failed = {}, {}, {}, {}

    def build(label, make):  # compile (first call) one at a time, every rank together
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        counter = CollectiveCounter()
        n0 = programs_built()
        dist.barrier()
        t = time.perf_counter()
        try:
            fn = make()
            with (
                torch.no_grad(),
                inductor_config.patch(post_grad_custom_post_pass=counter, fx_graph_cache=False),
            ):
                out = fn(tokens)
        except RuntimeError as e:  # every rank fails alike (the same program on the same shapes)
            failed[label] = str(e).splitlines()[0][:90]
            return
        compile_s = time.perf_counter() - t
        counts[label] = (
            counter.n if counter.n or "eager" not in label else _eager_collectives(fn, tokens)
        )
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        made[label] = (fn, compile_s, float((out - ref).abs().max() / ref.abs().max()))
        if label.startswith("fxshard"):
            nbytes[label] = _fxshard_bytes(compiled_programs(n0))
        else:  # DTensor: its eager step's collectives (the compiled step runs the same)
            seen = CollectiveBytes()
            with torch.no_grad(), seen:
                eager_model(tokens)
            nbytes[label] = seen.bytes

    def dtensor_model():
        return parallelize_module(copy.deepcopy(base), dm, plan())

    eager_model = dtensor_model()

    build("DTensor eager", dtensor_model)
    build("DTensor + torch.compile", lambda: torch.compile(dtensor_model()))
    build(
        "fxshard (backend, Inductor)",
        lambda: torch.compile(
            copy.deepcopy(base),
            backend="fxshard",
            # the vocab-parallel plan's lm_head keeps its output sharded (use_local_output=False):
            # fxshard hands it back as a DTensor too
            options={"mesh": dm, "plan": plan(), "outputs": outputs},
        ),
    )
    # timed round-robin, so that the machine's noise hits all three alike
    times = {label: [] for label in made}
    with torch.no_grad():
        for fn, _, _ in made.values():
            fn(tokens)  # warm
        for _ in range(steps):
            for label, (fn, _, _) in made.items():
                times[label] += _time(fn, tokens, 1)
    results = {
        label: dict(
            compile_s=c,
            step_ms=1e3 * statistics.median(times[label]),
            collectives=counts[label],
            bytes=nbytes[label],
            rel_err=e,
        )
        for label, (_, c, e) in made.items()
    }
    return {**{label: dict(failed=why) for label, why in failed.items()}, **results}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--model", choices=("llama", "uneven"), default="llama")
    ap.add_argument("--heads", type=int, default=6, help="--model uneven: attention heads")
    ap.add_argument("--ffn", type=int, default=250, help="--model uneven: ffn hidden size")
    args = ap.parse_args()
    import dataclasses

    from fxshard import zoo
    from fxshard.runtime.launch import spawn

    if args.model == "uneven":
        base = dataclasses.asdict(zoo.uneven_config())
        cfg = {**base, "n_layers": args.layers, "max_seq_len": max(args.seq, 32)}
        cfg.update(n_heads=args.heads, n_kv_heads=args.heads // 2, ffn_hidden=args.ffn)
        plan_name = "vocab_parallel_plan"
        what = "vocab-parallel TP plan, uneven: vocab 1001, "
        what += f"hidden 96 in {args.heads} heads, ffn {args.ffn}"
    else:
        cfg = dict(
            dim=args.dim,
            n_layers=args.layers,
            n_heads=8,
            n_kv_heads=8,
            ffn_hidden=4 * args.dim,
            vocab_size=1024,
            max_seq_len=max(args.seq, 32),
        )
        plan_name, what = "megatron_tp_plan", f"hidden {args.dim}, Megatron TP plan"
    per_rank = spawn(args.ranks, worker, cfg, args.batch, args.seq, args.steps, plan_name)
    order = ("DTensor eager", "DTensor + torch.compile", "fxshard (backend, Inductor)")
    labels = [label for label in order if label in per_rank[0]]
    anchor = "DTensor + torch.compile"

    def med(label, key):
        return statistics.median(r[label][key] for r in per_rank)

    print(
        f"Llama-style forward, {args.layers} layers, {what}, batch {args.batch} x seq {args.seq}, "
        f"{args.ranks} gloo ranks (CPU); medians over ranks of per-rank medians ({args.steps} "
        "steps)"
    )
    print(
        f"{'':30} {'step ms':>9} {'vs compile':>10} {'compile s':>10} {'vs compile':>10} "
        f"{'collectives':>11} {'bytes/rank':>10} "
        f"{'max rel err':>11}"
    )
    ok = "failed" not in per_rank[0][anchor]

    def vs(label, key):
        return f"{med(label, key) / med(anchor, key):10.2f}" if ok else f"{'-':>10}"

    for label in labels:
        if "failed" in per_rank[0][label]:
            print(f"{label:30} fails: {per_rank[0][label]['failed']}")
            continue
        print(
            f"{label:30} {med(label, 'step_ms'):9.2f} {vs(label, 'step_ms')} "
            f"{med(label, 'compile_s'):10.2f} {vs(label, 'compile_s')} "
            f"{per_rank[0][label]['collectives']:11d} "
            f"{max(r[label]['bytes'] for r in per_rank):10d} "
            f"{max(r[label]['rel_err'] for r in per_rank):11.1e}"
        )


if __name__ == "__main__":
    main()
