"""Training step (fwd + bwd + AdamW) on real process groups: fxshard vs DTensor eager vs DTensor +
torch.compile.

Llama-style model (4 layers, hidden 256) with its loss inside the module, 4 gloo ranks on this
machine (CPU, loopback), tensor-parallel (Megatron) and sequence-parallel (torchtitan) plans, all
variants in the same run on the same weights and tokens:

* fxshard: ``fxshard.parallelize`` (parameters are local shards; the joint graph is sharded, split
  by the min-cut partitioner and compiled by Inductor) + ``torch.optim.AdamW`` on the local shards;
* DTensor eager: ``parallelize_module`` + AdamW on the DTensor parameters;
* DTensor + torch.compile: the same, model compiled with Inductor.

Per rank: compile time (the first step), median step time (a barrier before each, variants
round-robin), collectives and bytes per step (the compiled variants: counted in the graphs Inductor
compiles, forward and backward; DTensor eager: every functional collective dispatched during a step,
optimizer included).  Ratios are against DTensor + torch.compile.

    python benchmarks/train_step.py [--steps 10] [--plans tp sp]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn as nn


def count_graph(graph, counter) -> None:
    for node in graph.nodes:
        ns = getattr(node.target, "namespace", None)
        if (
            node.op == "call_function"
            and ns in ("_c10d_functional", "c10d_functional")
            and "wait" not in str(node.target)
        ):
            counter.n += 1
            v = (
                node.args[0].meta.get("val")
                if node.args and hasattr(node.args[0], "meta")
                else None
            )
            if isinstance(v, torch.Tensor):
                counter.bytes += v.numel() * v.element_size()


class CollectiveCounter:
    """Inductor post-grad custom pass: counts collectives and their input bytes in compiled
    graphs."""

    def __init__(self):
        self.n = 0
        self.bytes = 0

    def __call__(self, graph):
        count_graph(graph, self)

    def uuid(self):
        return "fxshard-benchmark-collective-counter"


def _eager_counts(fn):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # the native ops only (the Python-level c10d_functional wrappers dispatch to these)
            if (
                func.namespace == "_c10d_functional"
                and "wait" not in func.__name__
                and "wrap" not in func.__name__
            ):  # not _wrap_tensor_autograd (bookkeeping, no traffic)
                Count.n += 1
                if args and isinstance(args[0], torch.Tensor):
                    Count.bytes += args[0].numel() * args[0].element_size()
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n, Count.bytes


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return self.model(tokens).float().pow(2).mean()


def worker(rank, world, cfg_kw, batch, seq, steps, plan_name):
    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import fxshard
    from fxshard import zoo

    cfg = zoo.LlamaConfig(**cfg_kw)
    base = WithLoss(zoo.init_weights(zoo.Llama(cfg), seed=0))
    tokens = torch.randint(
        0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)
    )
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {
        "model." + k: v
        for k, v in (
            zoo.megatron_tp_plan() if plan_name == "tp" else zoo.sequence_parallel_plan()
        ).items()
    }

    def make_dtensor(compiled):
        m = parallelize_module(copy.deepcopy(base), dm, plan)
        return (torch.compile(m) if compiled else m), m

    variants = {
        "DTensor eager": lambda: make_dtensor(False),
        "DTensor + torch.compile": lambda: make_dtensor(True),
        "fxshard (parallelize)": lambda: (lambda m: (m, m))(
            fxshard.parallelize(copy.deepcopy(base), dm, plan)
        ),
    }
    made = {}
    for label, make in variants.items():
        torch._dynamo.reset()
        counter = CollectiveCounter()
        dist.barrier()
        t = time.perf_counter()
        fn, module = make()
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)

        def step(fn=fn, opt=opt):
            opt.zero_grad()
            loss = fn(tokens)
            loss.backward()
            opt.step()
            return loss

        with inductor_config.patch(post_grad_custom_post_pass=counter, fx_graph_cache=False):
            loss = step()
        compile_s = time.perf_counter() - t
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        # the forward and backward graphs it compiled, one step's worth
        if label.startswith("fxshard"):
            counter = CollectiveCounter()
            for _prog, runner in module._programs.values():
                count_graph(runner.forward_graph.graph, counter)
                count_graph(runner.backward_graph.graph, counter)
        n, nbytes = (counter.n, counter.bytes) if counter.n else _eager_counts(step)
        made[label] = dict(
            step=step, compile_s=compile_s, collectives=n, bytes=nbytes, loss=float(loss.detach())
        )
    times = {label: [] for label in made}
    for _ in range(steps):
        for label, m in made.items():
            dist.barrier()
            t = time.perf_counter()
            m["step"]()
            times[label].append(time.perf_counter() - t)
    return {
        label: dict(
            compile_s=m["compile_s"],
            step_ms=1e3 * statistics.median(times[label]),
            collectives=m["collectives"],
            bytes=m["bytes"],
            loss=m["loss"],
        )
        for label, m in made.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--plans", nargs="+", default=["tp", "sp"])
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
    anchor = "DTensor + torch.compile"
    print(
        f"Llama-style training step (fwd + bwd + AdamW), {args.layers} layers, hidden {args.dim}, "
        "batch "
        f"{args.batch} x seq {args.seq}, {args.ranks} gloo ranks (CPU); medians over ranks of "
        "per-rank medians "
        f"({args.steps} steps)"
    )
    for plan in args.plans:
        per_rank = spawn(args.ranks, worker, cfg, args.batch, args.seq, args.steps, plan)

        def med(label, key, per_rank=per_rank):
            return statistics.median(r[label][key] for r in per_rank)

        print(f"\nplan: {plan}")
        print(
            f"{'':26} {'step ms':>9} {'vs compile':>10} {'compile s':>10} {'vs compile':>10} "
            f"{'collectives':>11} "
            f"{'MB/step':>8} {'loss':>10}"
        )
        for label in per_rank[0]:
            r0 = per_rank[0][label]
            print(
                f"{label:26} {med(label, 'step_ms'):9.1f} "
                f"{med(label, 'step_ms') / med(anchor, 'step_ms'):10.2f} "
                f"{med(label, 'compile_s'):10.2f} "
                f"{med(label, 'compile_s') / med(anchor, 'compile_s'):10.2f} "
                f"{r0['collectives']:11d} {r0['bytes'] / 2**20:8.2f} {r0['loss']:10.6f}"
            )


if __name__ == "__main__":
    main()
