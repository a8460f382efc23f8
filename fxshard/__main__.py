"""``python -m fxshard demo``: the main job, as ``make demo`` runs it."""

from __future__ import annotations

import argparse
import sys


def demo_planner() -> None:
    """Plan a handful of redistributions on a 3-D mesh, next to torch's own plans and costs."""
    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    import fxshard
    from fxshard import adapter

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
        tsrc, steps = adapter.torch_plan(dm, src, dst, shape, torch.float32, src_order=order, graph=True)
        t_cost = adapter.torch_score(tsrc, steps)
        greedy = None
        if order is None:
            _, gsteps = adapter.torch_plan(dm, src, dst, shape, torch.float32, graph=False)
            greedy = adapter.torch_score(tsrc, gsteps)
        print(f"{fxshard.spec.placements_str(src)} -> {fxshard.spec.placements_str(dst)}  shape {shape}"
              + (f", source shard order {order}" if order else ""))
        print(f"  fxshard     {plan.cost:9.2f} us  {plan}")
        for s in plan.steps:
            print(f"                 {s}")
        print(f"  torch graph {t_cost:9.2f} us  " + " -> ".join(
            f"[{m}] {fxshard.spec.placement_str(a)}->{fxshard.spec.placement_str(b)}" for m, a, b in steps))
        if greedy is not None:
            print(f"  torch greedy{greedy:9.2f} us")
        print()


def demo_llama() -> None:
    """A 2-layer Llama-style model on a simulated 2x4 dp x tp mesh with torchtitan's sequence-parallel
    plan: the plan, the collectives, and the simulated result against single device."""
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
    print(f"Llama-style model (2 layers, dim 64) on mesh {mesh.shape} {mesh.names}, sequence-parallel plan "
          f"(sharded in {t1 - t0:.1f} s)\n")
    print(prog.explain())
    print("\ncollectives (per rank):")
    for c in prog.collectives():
        print(f"  {c.kind:15s} mesh dims {c.mesh_dims}  {c.bytes:7d} B  {c.cost:6.2f} us  {c.transition:12s} "
              f"{c.provenance}")
    with torch.no_grad():
        ref = model(*tokens)
    t2 = time.perf_counter()
    out = prog.simulate(*tokens)
    t3 = time.perf_counter()
    err = (out - ref).abs().max().item()
    ok = torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    print(f"\nsimulated 8 ranks in {t3 - t2:.2f} s: max |sharded - single device| = {err:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    if not ok:
        raise SystemExit(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fxshard")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="the main demo")
    sub.add_parser("plan-demo", help="redistribution plans next to torch's")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        demo_llama()
    elif args.cmd == "plan-demo":
        demo_planner()
    return 0


if __name__ == "__main__":
    sys.exit(main())
