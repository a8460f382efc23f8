"""``python -m fxshard demo``: the main job, as ``make demo`` runs it."""

from __future__ import annotations

import argparse
import sys


def demo_planner() -> None:
    """Plan a handful of redistributions on a 3-D mesh, next to torch's own plans and costs."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    import fxshard
    from fxshard import _torch as adapter

    R, P = Replicate(), Partial()
    mesh_shape = (2, 2, 4)
    dm = adapter.torch_planning_mesh(mesh_shape)
    bw, lat = adapter.torch_topology(dm)
    mesh = fxshard.MeshSpec(mesh_shape, names=("pp", "dp", "tp"), bandwidth=bw, latency=lat)
    cm = fxshard.torch_compatible(mesh)
    cases = [
        ((Shard(0), Shard(0), R), (R, R, R), None, (5, 3)),
        ((Shard(0), Shard(0), Shard(1)), (R, Shard(1), P), None, (64, 48, 32)),
        ((P, P, R), (R, R, R), None, (1024, 1024)),
        ((Shard(0), Shard(1), P), (Shard(1), Shard(0), R), None, (4096, 4096)),
        ((Shard(0), Shard(0), Shard(0)), (Shard(0), Shard(0), Shard(0)), {0: (2, 1, 0)}, (256, 64)),
        ((Shard(1), R, Shard(0)), (Shard(0), Shard(1), R), None, (2048, 512)),
    ]
    print(f"mesh {mesh_shape} (torch's cost figures: bandwidth {bw} GB/s, latency {lat} us)\n")
    for src, dst, order, shape in cases:
        plan = fxshard.plan_redistribute(mesh, src, dst, shape, src_order=order, cost_model=cm)
        tsrc, steps = adapter.torch_plan(
            dm, src, dst, shape, torch.float32, src_order=order, graph=True
        )
        t_cost = adapter.torch_score(tsrc, steps)
        greedy = None
        if order is None:
            _, gsteps = adapter.torch_plan(dm, src, dst, shape, torch.float32, graph=False)
            greedy = adapter.torch_score(tsrc, gsteps)
        print(
            f"{fxshard.spec.placements_str(src)} -> {fxshard.spec.placements_str(dst)}  shape "
            f"{shape}" + (f", source shard order {order}" if order else "")
        )
        print(f"  fxshard     {plan.cost:9.2f} us  {plan}")
        for s in plan.steps:
            print(f"                 {s}")
        print(
            f"  torch graph {t_cost:9.2f} us  "
            + " -> ".join(
                f"[{m}] {fxshard.spec.placement_str(a)}->{fxshard.spec.placement_str(b)}"
                for m, a, b in steps
            )
        )
        if greedy is not None:
            print(f"  torch greedy{greedy:9.2f} us")
        print()


def demo_llama() -> None:
    """A 2-layer Llama-style model on a simulated 2x4 dp x tp mesh with torchtitan's
    sequence-parallel plan: the plan, the collectives, and the simulated result against single
    device."""
    import time

    import torch

    import fxshard
    from fxshard import zoo

    torch.manual_seed(0)
    model = zoo.init_weights(zoo.Llama(zoo.LlamaConfig()))
    tokens = zoo.example_input(model, batch=4, seq=16)
    mesh = fxshard.MeshSpec((2, 4), names=("dp", "tp"))
    t0 = time.perf_counter()
    prog = fxshard.shard(model, mesh, zoo.sequence_parallel_plan(), example_inputs=tokens)
    t1 = time.perf_counter()
    print(
        f"Llama-style model (2 layers, dim 64) on mesh {mesh.shape} {mesh.names}, "
        "sequence-parallel plan "
        f"(sharded in {t1 - t0:.1f} s)\n"
    )
    print(prog.explain())
    print("\ncollectives (per rank):")
    for c in prog.collectives():
        print(
            f"  {c.kind:15s} mesh dims {c.mesh_dims}  {c.bytes:7d} B  {c.cost:6.2f} us  "
            f"{c.transition:12s} "
            f"{c.provenance}"
        )
    with torch.no_grad():
        ref = model(*tokens)
    t2 = time.perf_counter()
    out = prog.simulate(*tokens)
    t3 = time.perf_counter()
    err = (out - ref).abs().max().item()
    ok = torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    print(
        f"\nsimulated 8 ranks in {t3 - t2:.2f} s: max |sharded - single device| = {err:.2e} "
        f"-> {'OK' if ok else 'MISMATCH'}"
    )
    if not ok:
        raise SystemExit(1)


BUILTIN_PLANS = {
    "tp": "megatron_tp_plan",
    "megatron": "megatron_tp_plan",
    "sp": "sequence_parallel_plan",
    "vocab": "vocab_parallel_plan",
    "mlp": "mlp_plan",
    "none": None,
    "dp": None,
}


def load_object(ref: str):
    """``path/to/file.py:Name`` or ``package.module:Name``."""
    import importlib
    import importlib.util
    import os

    if ":" not in ref:
        raise SystemExit(f"expected FILE.py:NAME or MODULE:NAME, got {ref!r}")
    where, name = ref.rsplit(":", 1)
    if where.endswith(".py") or os.path.sep in where:
        spec = importlib.util.spec_from_file_location(
            os.path.splitext(os.path.basename(where))[0], where
        )
        if spec is None or spec.loader is None:
            raise SystemExit(f"cannot load {where}")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(where)
    if not hasattr(mod, name):
        raise SystemExit(f"{where} has no {name!r}")
    return getattr(mod, name)


def parse_mesh(text: str):
    import fxshard

    shape = tuple(int(x) for x in text.lower().split("x"))
    names = {1: ("tp",), 2: ("dp", "tp")}.get(
        len(shape), tuple(f"dp{i}" for i in range(len(shape) - 1)) + ("tp",)
    )
    return fxshard.MeshSpec(shape, names=names)


def load_plan(ref: str):
    from fxshard import zoo

    if ref in BUILTIN_PLANS:
        fn = BUILTIN_PLANS[ref]
        return getattr(zoo, fn)() if fn else None
    plan = load_object(ref)
    return plan() if callable(plan) else plan


def build_program(factory_ref: str, mesh_text: str, plan_ref: str):
    import fxshard
    from fxshard import zoo

    made = load_object(factory_ref)()
    model, inputs = made if isinstance(made, tuple) else (made, None)
    if inputs is None:
        inputs = zoo.example_input(model)
    return fxshard.shard(model, parse_mesh(mesh_text), load_plan(plan_ref), example_inputs=inputs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fxshard",
        description="fxshard from the shell: the demos, and a model's sharding plan printed or "
        "compared without writing code (simulated ranks, no process group).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, hlp, what in (
        (
            "demo",
            "the main demo: a Llama-style model on a simulated 2x4 mesh",
            "Prints the plan of a 2-layer Llama-style model with torchtitan's sequence-parallel "
            "plan on a simulated 2x4 (dp, tp) mesh, its collectives per rank, and the output of "
            "the 8 simulated ranks checked against single device (exit 1 on a mismatch).",
        ),
        (
            "plan-demo",
            "redistribution plans next to torch's",
            "Prints, for a handful of redistributions on a 3-D mesh, fxshard's plan (each step's "
            "collective and modelled cost) next to torch's own redistribute planner's.",
        ),
        (
            "explain",
            "print a sharded program's plan",
            "Prints the plan of a model (from a factory) on a mesh: every parameter's and op's "
            "placement, why, where in the source, each collective with its bytes and modelled "
            "cost, and the totals per step (text, JSON or HTML).",
        ),
        (
            "diff",
            "compare two plans or meshes",
            "Prints what changes between two plans or two meshes of one model: the placements "
            "that differ and the collectives each adds or drops, with the cost of each side. "
            "Give --plan twice or --mesh twice.",
        ),
    ):
        p = sub.add_parser(name, help=hlp, description=what)
        if name in ("demo", "plan-demo"):
            continue
        p.add_argument(
            "factory", help="FILE.py:FACTORY or MODULE:FACTORY returning a model or (model, inputs)"
        )
        p.add_argument(
            "--mesh", action="append", default=None, help="mesh shape such as 2x4 (last dim: tp)"
        )
        p.add_argument(
            "--plan",
            action="append",
            default=None,
            help=f"built-in plan ({', '.join(BUILTIN_PLANS)}) or FILE.py:NAME",
        )
        p.add_argument("--format", choices=("text", "json", "html"), default="text")
        p.add_argument(
            "--verbose", action="store_true", help="every node, not only the ones that matter"
        )
        p.add_argument("-o", "--output", help="write to this file instead of stdout")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        demo_llama()
        return 0
    if args.cmd == "plan-demo":
        demo_planner()
        return 0
    import fxshard

    meshes = args.mesh or ["2"]
    plans = args.plan or ["tp"]
    if args.cmd == "explain":
        prog = build_program(args.factory, meshes[0], plans[0])
        text = prog.explain(verbose=args.verbose, format=args.format)
    else:
        if len(meshes) * len(plans) != 2:
            raise SystemExit("diff needs two programs: --plan A --plan B, or --mesh A --mesh B")
        pairs = [(m, p) for m in meshes for p in plans]
        a, b = (build_program(args.factory, m, p) for m, p in pairs)
        text = fxshard.diff(a, b, names=tuple(f"{p} on {m}" for m, p in pairs))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
