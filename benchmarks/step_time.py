"""Forward step time on real process groups: fxshard (Inductor) vs DTensor eager vs DTensor +
torch.compile.

Llama-style model (4 layers, hidden 256), tensor-parallel (Megatron) plan, 4 gloo ranks on this
machine (CPU, loopback), all three in the same run on the same weights and tokens.  Per rank:
compile time (first call, including dynamo, fxshard's passes and Inductor), median forward time
over timed steps (a barrier before each, the three variants round-robin), and collectives per step
(in Inductor's post-grad graphs for the compiled variants, ``CommDebugMode`` for DTensor eager).
Inductor's FX graph cache is off, so both compiled variants compile cold.  Ratios are against
DTensor + torch.compile.  On 2 cores the 4 ranks share the CPUs, so absolute times are noisy:
quote medians and ratios.

    python benchmarks/step_time.py [--ranks 4] [--steps 20] [--batch 8] [--seq 64]
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


def worker(rank, world, cfg_kw, batch, seq, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fxshard import zoo

    torch.manual_seed(0)
    cfg = zoo.LlamaConfig(**cfg_kw)
    base = zoo.init_weights(zoo.Llama(cfg), seed=0)
    tokens = torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)
    )
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.no_grad():
        ref = base(tokens)
    made, counts = {}, {}

    def build(label, make):  # compile (first call) one at a time, every rank together
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        counter = CollectiveCounter()
        dist.barrier()
        t = time.perf_counter()
        fn = make()
        with (
            torch.no_grad(),
            inductor_config.patch(post_grad_custom_post_pass=counter, fx_graph_cache=False),
        ):
            out = fn(tokens)
        compile_s = time.perf_counter() - t
        counts[label] = (
            counter.n if counter.n or "eager" not in label else _eager_collectives(fn, tokens)
        )
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        made[label] = (fn, compile_s, float((out - ref).abs().max() / ref.abs().max()))

    def dtensor_model():
        return parallelize_module(copy.deepcopy(base), dm, zoo.megatron_tp_plan())

    build("DTensor eager", dtensor_model)
    build("DTensor + torch.compile", lambda: torch.compile(dtensor_model()))
    build(
        "fxshard (backend, Inductor)",
        lambda: torch.compile(
            copy.deepcopy(base),
            backend="fxshard",
            options={"mesh": dm, "plan": zoo.megatron_tp_plan()},
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
            rel_err=e,
        )
        for label, (_, c, e) in made.items()
    }
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    from fxshard.runtime.launch import spawn

    cfg = dict(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=8,
        ffn_hidden=4 * args.dim,
        vocab_size=1024,
        max_seq_len=max(args.seq, 32),
    )
    per_rank = spawn(args.ranks, worker, cfg, args.batch, args.seq, args.steps)
    labels = list(per_rank[0])
    anchor = "DTensor + torch.compile"

    def med(label, key):
        return statistics.median(r[label][key] for r in per_rank)

    print(
        f"Llama-style forward, {args.layers} layers, hidden {args.dim}, batch {args.batch} x seq "
        f"{args.seq}, "
        f"{args.ranks} gloo ranks (CPU), Megatron TP plan; medians over ranks of per-rank medians "
        f"({args.steps} steps)"
    )
    print(
        f"{'':30} {'step ms':>9} {'vs compile':>10} {'compile s':>10} {'vs compile':>10} "
        f"{'collectives':>11} "
        f"{'max rel err':>11}"
    )
    for label in labels:
        print(
            f"{label:30} {med(label, 'step_ms'):9.2f} "
            f"{med(label, 'step_ms') / med(anchor, 'step_ms'):10.2f} "
            f"{med(label, 'compile_s'):10.2f} "
            f"{med(label, 'compile_s') / med(anchor, 'compile_s'):10.2f} "
            f"{per_rank[0][label]['collectives']:11d} "
            f"{max(r[label]['rel_err'] for r in per_rank):11.1e}"
        )


if __name__ == "__main__":
    main()
