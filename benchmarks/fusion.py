"""Collective counts and modelled cost with and without fusion, and against torch.

For the Llama-style model (2 and 8 layers) on meshes (2,4), (4,4), (2,2,4): a dp x tp plan (Megatron
on the last dim, batch on the others) and a dp x cp-like plan (batch on the first dim, sequence on
the rest; no TP).  Columns: collectives and modelled µs unfused / fused (+ bucketed in the per-rank
graph).  Then, against torch: every redistribution of the fused programs is replayed with DTensor's
``redistribute`` under ``CommDebugMode`` on a fake process group with no user-flattened mesh (torch
then cannot merge steps), and the collectives are counted.

    python benchmarks/fusion.py [--layers 2 8]
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch.distributed.tensor import Partial, Shard

import fxshard
from fxshard import zoo
from fxshard.ir import info
from fxshard.passes.lower import collective_nodes

MESHES = [((2, 4), ("dp", "tp")), ((4, 4), ("dp", "tp")), ((2, 2, 4), ("dp", "cp", "tp"))]


def programs(n_layers, shape, names):
    model = zoo.init_weights(zoo.Llama(zoo.LlamaConfig(n_layers=n_layers)))
    x = zoo.example_input(model, batch=4, seq=16)
    mesh = fxshard.MeshSpec(shape, names=names)
    dp_tp = dict(plan=zoo.megatron_tp_plan())
    seq = [Shard(0)] * (len(shape) - 2) + [
        Shard(1)
    ] * 2  # sequence on the last two dims, batch on the rest
    dp_cp = dict(plan=None, input_placements=[tuple(seq)])
    for label, kw in (("dp x tp", dp_tp), ("dp x cp", dp_cp)):
        plain = fxshard.shard(
            model,
            mesh,
            kw["plan"],
            example_inputs=x,
            multi_dim_collectives=False,
            input_placements=kw.get("input_placements"),
        )
        fused = fxshard.shard(
            model,
            mesh,
            kw["plan"],
            example_inputs=x,
            multi_dim_collectives=True,
            input_placements=kw.get("input_placements"),
        )
        yield label, mesh, plain, fused


def torch_counts(prog) -> tuple[int, int]:
    """(collectives DTensor issues for the program's redistributions, fxshard's for the same
    ones)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = math.prod(prog.mesh.shape)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dm = init_device_mesh("cpu", prog.mesh.shape, mesh_dim_names=prog.mesh.names)
        theirs = ours = 0
        for n in prog.redistribute_nodes():
            plan = info(n).plan
            if any(isinstance(p, Partial) for p in plan.dst.placements):
                continue  # DTensor does not redistribute *to* Partial
            local = torch.empty(plan.src.local_shape((0,) * prog.mesh.ndim), dtype=plan.src.dtype)
            dt = DTensor.from_local(
                local,
                dm,
                plan.src.placements,
                run_check=False,
                shape=torch.Size(plan.src.shape),
                stride=torch.empty(plan.src.shape, device="meta").stride(),
            )
            with CommDebugMode() as comm:
                dt.redistribute(dm, plan.dst.placements)
            theirs += comm.get_total_counts()
            ours += len(plan.collectives)
        return theirs, ours
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    args = ap.parse_args(argv)
    print(
        "| layers | mesh | plan | collectives unfused | fused | in per-rank graph (bucketed) | "
        "modelled us unfused "
        "| fused | torch DTensor collectives (same redistributions) | fxshard |"
    )
    print("|" + "---|" * 10)
    worse = 0
    for n_layers in args.layers:
        for shape, names in MESHES:
            for label, _mesh, plain, fused in programs(n_layers, shape, names):
                cu, cf = len(plain.collectives()), len(fused.collectives())
                us_u = sum(c.cost for c in plain.collectives())
                us_f = sum(c.cost for c in fused.collectives())
                in_graph = len(collective_nodes(fused.local_graph))
                theirs, ours = torch_counts(fused)
                worse += ours > theirs
                print(
                    f"| {n_layers} | {shape} | {label} | {cu} | {cf} | {in_graph} | {us_u:.1f} | "
                    f"{us_f:.1f} | "
                    f"{theirs} | {ours} |",
                    flush=True,
                )
    print(
        "\ncases where fxshard issues more collectives than torch for the same redistributions: "
        f"{worse}"
    )
    return 0 if worse == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
