"""Exhaustive src -> dst sweep, executed on simulated ranks against the full tensor."""

import functools
import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard.core.spec import ShardingSpec
from fxshard.planner.execute import execute_plan, group_names, mesh_coordinate
from fxshard.runtime.simulate import SimulatedMesh

MESHES = [(2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (2, 4), (2, 2, 2)]
SHAPES = [(8, 8), (5, 3), (7, 6, 4), (1, 5)]


def placement_options(ndim):
    return [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial("sum"), Partial("avg")]


def all_placements(mesh_ndim, ndim, mixed=False):
    out = []
    for pl in itertools.product(placement_options(ndim), repeat=mesh_ndim):
        ops = {p.reduce_op for p in pl if isinstance(p, Partial)}
        if len(ops) <= 1 or mixed:  # sum and avg may mix (both linear)
            out.append(pl)
    return out


def nondefault_order(pl):
    """A reversed shard order for every tensor dim sharded by 2+ mesh dims (None if there is
    none)."""
    by_dim = {}
    for m, p in enumerate(pl):
        if isinstance(p, Shard):
            by_dim.setdefault(p.dim, []).append(m)
    if not any(len(v) > 1 for v in by_dim.values()):
        return None
    return {d: tuple(reversed(v)) for d, v in by_dim.items()}


def check_pairs(sim, full, pairs, fuse=False):
    groups = group_names(sim.device_mesh)
    coord = mesh_coordinate(sim.device_mesh)
    fused = 0
    for i, (src, dst, order) in enumerate(pairs):
        plan = fxshard.plan_redistribute(
            sim.spec, src, dst, full.shape, src_order=order, multi_dim_collectives=fuse
        )
        fused += any(len(s.mesh_dims) > 1 for s in plan.steps)
        x = sim.distribute(full, plan.src, partial_seed=i)
        y = execute_plan(plan, x, groups, coord)
        got = sim.assemble(y, plan.dst)
        reduces = any(isinstance(p, Partial) for p in (*src, *dst))
        if reduces:
            # bf16 addends round: the tolerance is bf16's
            tol = (
                dict(rtol=1e-6, atol=1e-5)
                if full.dtype == torch.float32
                else dict(rtol=5e-2, atol=0.15)
            )
            torch.testing.assert_close(got, full, **tol, msg=lambda m, plan=plan: f"{plan}: {m}")
        else:
            assert torch.equal(got, full), f"{plan}: data movement is not bit-exact"
    return fused


def sweep_cases(mesh, shape, sample=None, seed=0, mixed=False):
    pls = all_placements(len(mesh), len(shape), mixed)
    pairs = [(s, d, None) for s in pls for d in pls]
    pairs += [(s, d, nondefault_order(s)) for s in pls if nondefault_order(s) for d in pls]
    if sample is not None and len(pairs) > sample:
        pairs = random.Random(seed).sample(pairs, sample)
    return pairs


# Every pair on the small meshes; on the 8-rank cube the pairs number ~45k per shape, so a fixed
# random sample of 700 per shape is executed there (2800 pairs over the four shapes; the planner's
# choices on the cube are also cross-checked exhaustively, without execution, in test_planner.py).
CASES = [(m, s) for m in MESHES for s in SHAPES]


@pytest.mark.parametrize("mesh,shape", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_sweep(mesh, shape):
    full = torch.randn(shape)
    sample = 700 if len(mesh) == 3 else None
    with SimulatedMesh(mesh) as sim:
        check_pairs(sim, full, sweep_cases(mesh, shape, sample=sample))


def test_pytorch_194457_strided_flattened_case():
    """(5,3), [S(0),S(0)] -> [R,R] on 2x2: torch corrupts this when a flattened mesh exists."""
    full = torch.randn(5, 3)
    with SimulatedMesh((2, 2)) as sim:
        check_pairs(
            sim,
            full,
            [
                ((Shard(0), Shard(0)), (Replicate(), Replicate()), None),
                ((Shard(0), Shard(0)), (Replicate(), Replicate()), {0: (1, 0)}),
            ],
        )


def test_spec_matches_dtensor_chunking():
    """Our local shapes / indices equal DTensor's distribute_tensor for every default-order
    placement."""
    from torch.distributed.tensor import distribute_tensor

    from fxshard._torch import local_tensor_values

    for mesh, shape in [((2, 2), (5, 3)), ((2, 3), (7, 6, 4)), ((4,), (5, 3))]:
        full = torch.randn(shape)
        with SimulatedMesh(mesh) as sim:
            for pl in all_placements(len(mesh), len(shape)):
                if any(isinstance(p, Partial) for p in pl):
                    continue
                dt = distribute_tensor(full, sim.device_mesh, pl)
                vals = local_tensor_values(dt.to_local(), sim.world)
                spec = ShardingSpec.make(sim.spec, pl, shape)
                for r, c in sim.coords.items():
                    assert torch.equal(vals[r], spec.shard_full(full, c)), (pl, r)


def _strided_options(ndim):
    from fxshard._torch import StridedShard

    return (
        [Replicate(), Partial("sum")]
        + [Shard(d) for d in range(ndim)]
        + [StridedShard(d, split_factor=sf) for d in range(ndim) for sf in (2, 3)]
    )


@pytest.mark.parametrize(
    "mesh,shape", [((4,), (12, 6)), ((4,), (7, 5)), ((2, 2), (12, 6)), ((2, 3), (12, 5))]
)
def test_strided_sweep(mesh, shape):
    """_StridedShard <-> Shard, Partial -> _StridedShard, R <-> _StridedShard ... executed
    exactly."""
    opts = _strided_options(len(shape))
    pls = [
        pl
        for pl in itertools.product(opts, repeat=len(mesh))
        if sum(isinstance(p, Partial) for p in pl) <= 2
    ]
    rng = random.Random(1)
    pairs = [(s, d, None) for s in pls for d in pls]
    if len(pairs) > 400:
        pairs = rng.sample(pairs, 400)
    with SimulatedMesh(mesh) as sim:
        check_pairs(sim, torch.randn(shape), pairs)


def test_strided_spec_matches_torch_split():
    """Our _StridedShard layout is torch's own _StridedShard._split_tensor, uneven sizes
    included."""
    from fxshard._torch import StridedShard

    for shape in [(16, 12), (13, 7)]:
        full = torch.randn(shape)
        for pl in [StridedShard(0, split_factor=2), StridedShard(1, split_factor=3)]:
            chunks, _ = pl._split_tensor(full, 4, with_padding=False)
            spec = ShardingSpec.make(fxshard.MeshSpec((4,)), (pl,), full.shape)
            for r in range(4):
                assert torch.equal(chunks[r], spec.shard_full(full, (r,)))


def _run_plan(plan, groups, t, c):
    return execute_plan(plan, t, groups, c)


@pytest.mark.parametrize("mesh,shape", [((2, 4), (8, 8, 4)), ((2, 2, 2), (4, 8, 6))])
def test_traced_plan_is_rank_agnostic(mesh, shape):
    """One make_fx graph (coordinate as an input tensor) serves every rank."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxshard._torch import coordinate_tensor
    from fxshard.core.spec import is_even

    full = torch.randn(shape)
    rng = random.Random(0)
    pls = all_placements(len(mesh), len(shape))
    with SimulatedMesh(mesh) as sim:
        groups = group_names(sim.device_mesh)
        coord = coordinate_tensor(sim.device_mesh)
        done = 0
        while done < 40:
            src, dst = rng.choice(pls), rng.choice(pls)
            order = nondefault_order(src) if rng.random() < 0.5 else None
            if not (
                is_even(ShardingSpec.make(sim.spec, src, shape, shard_order=order))
                and is_even(ShardingSpec.make(sim.spec, dst, shape))
            ):
                continue
            done += 1
            plan = fxshard.plan_redistribute(
                sim.spec, src, dst, shape, src_order=order, even_only=True
            )
            x = sim.distribute(full, plan.src, partial_seed=1)
            with sim._mode.disable():
                gm = make_fx(functools.partial(_run_plan, plan, groups))(
                    torch.empty(plan.src.local_shape((0,) * len(mesh))),
                    torch.zeros(len(mesh), dtype=torch.long),
                )
            text = gm.code
            assert "rank" not in text
            got = sim.assemble(gm(x, coord), plan.dst)
            torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-5)


def test_tracing_uneven_is_a_clear_error():
    from fxshard.planner.execute import execute_plan

    plan = fxshard.plan_redistribute(fxshard.MeshSpec((2,)), (Replicate(),), (Shard(0),), (5,))
    with pytest.raises(ValueError, match="uneven"):
        execute_plan(plan, torch.randn(5), ["0"], torch.zeros(1, dtype=torch.long))


FUSED = [
    ((2, 2), (8, 8), torch.float32),
    ((2, 2), (5, 3), torch.bfloat16),
    ((2, 4), (8, 8, 4), torch.float32),
    ((2, 4), (7, 6, 4), torch.bfloat16),
    ((2, 2, 2), (8, 4, 6), torch.float32),
    ((2, 2, 2), (7, 6, 4), torch.float32),
]


@pytest.mark.parametrize(
    "mesh,shape,dtype", FUSED, ids=[f"{m}-{s}-{str(d)[6:]}" for m, s, d in FUSED]
)
def test_fused_sweep(mesh, shape, dtype):
    """Plans with collectives over flattened mesh dims (all-gather, reduce-scatter, all-reduce,
    all-to-all) compute exactly what the unfused ones do."""
    full = torch.randn(shape).to(dtype)
    pairs = sweep_cases(mesh, shape, sample=250, seed=3, mixed=True)
    with SimulatedMesh(mesh) as sim:
        fused = check_pairs(sim, full, pairs, fuse=True)
    assert fused > 10  # the sample really exercises fused steps
    assert any(len({p.reduce_op for p in s if isinstance(p, Partial)}) > 1 for s, _, _ in pairs)
