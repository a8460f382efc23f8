"""Min-cost redistribution planning: ``plan_redistribute(mesh, src, dst, shape)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..adapter import Partial, Replicate, Shard, StridedShard, placement_kind
from ..cost import CostModel
from ..mesh import MeshSpec
from ..spec import Levels, ShardingSpec, levels_to_placements, placement_str, placements_str
from .search import A2A, AG, AR, MAKE_PARTIAL, RS, SHARD, Move, Problem, distances, solve

__all__ = ["Step", "RedistributePlan", "plan_redistribute", "plan_between", "costs_from", "clear_plan_cache"]

_COLLECTIVE = {AG: "all_gather", A2A: "all_to_all", AR: "all_reduce", RS: "reduce_scatter",
               SHARD: None, MAKE_PARTIAL: None}


@dataclass(frozen=True)
class Step:
    """One redistribution step on ``mesh_dims`` (one dim unless fused)."""

    mesh_dims: tuple[int, ...]
    src: object  # placement before, on those mesh dims
    dst: object  # placement after
    collective: str | None  # None for local moves (slicing, making partial)
    cost: float  # modelled µs
    move: Move = field(repr=False, compare=False)

    def __str__(self) -> str:
        dims = ",".join(map(str, self.mesh_dims))
        what = self.collective or "local"
        return f"[{dims}] {placement_str(self.src)} -> {placement_str(self.dst)} ({what}, {self.cost:.2f} us)"


@dataclass(frozen=True)
class RedistributePlan:
    src: ShardingSpec
    dst: ShardingSpec
    steps: tuple[Step, ...]
    levels: tuple[Levels, ...]  # shard stacks at each step boundary (len(steps) + 1)
    partials: tuple[dict, ...]  # {mesh_dim: reduce op} at each step boundary
    cost: float

    @property
    def states(self) -> list[tuple[tuple, tuple]]:
        """``(placements, shard_order)`` from src to dst, one entry per step boundary."""
        out = []
        for lv, part in zip(self.levels, self.partials):
            pl = levels_to_placements(lv, part, self.src.mesh.ndim)
            order = tuple((d, tuple(m for m, _ in st)) for d, st in enumerate(lv) if st)
            out.append((pl, order))
        return out

    @property
    def collectives(self) -> list[Step]:
        return [s for s in self.steps if s.collective]

    def collective_bytes(self) -> list[tuple[Step, int]]:
        """Every collective step with its local input bytes per rank (even-shard count)."""
        shape = self.src.mesh.shape
        out = []
        for step, lv in zip(self.steps, self.levels):
            if step.collective:
                shards = 1
                for st in lv:
                    for m, _ in st:
                        shards *= shape[m]
                out.append((step, self.src.nbytes // shards))
        return out

    def then(self, other: RedistributePlan) -> RedistributePlan:
        """This plan followed by ``other`` (which must start where this one ends)."""
        if other.src.levels != self.dst.levels or other.partials[0] != self.partials[-1]:
            raise ValueError(f"cannot chain {self} with {other}: it starts at {other.src}, not {self.dst}")
        return RedistributePlan(self.src, other.dst, self.steps + other.steps, self.levels + other.levels[1:],
                                self.partials + other.partials[1:], self.cost + other.cost)

    def __str__(self) -> str:
        path = " -> ".join(placements_str(levels_to_placements(lv, part, self.src.mesh.ndim), lv)
                           for lv, part in zip(self.levels, self.partials))
        return f"{path}  ({self.cost:.2f} us)"


def clear_plan_cache() -> None:
    """Forget every memoised plan, spec and layout (for honest uncached timings)."""
    from ..spec import _make_cached, level_positions

    _plan_cached.cache_clear()
    _make_cached.cache_clear()
    level_positions.cache_clear()


def plan_redistribute(
    mesh,
    src: Sequence,
    dst: Sequence,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    src_order=None,
    dst_order=None,
    cost_model: CostModel | None = None,
    cache: bool = True,
    even_only: bool = False,
    fuse: bool = False,
) -> RedistributePlan:
    """The cheapest sequence of collectives taking a tensor from ``src`` to ``dst`` placements.

    ``mesh`` is a ``MeshSpec`` or ``DeviceMesh``; ``src_order`` / ``dst_order`` give non-default
    shard orders as ``{tensor_dim: (mesh_dim, ...)}`` or ``ShardOrderEntry`` tuples.
    ``even_only=True`` keeps every intermediate state evenly sharded (needed to trace the plan into
    one rank-agnostic graph); src and dst must then be even too.  ``fuse=True`` also considers one
    collective over several mesh dims (a flattened group paying one base latency); such steps have
    ``len(step.mesh_dims) > 1``.
    """
    mesh = MeshSpec.from_device_mesh(mesh)
    shape = tuple(int(s) for s in shape)
    s = ShardingSpec.make(mesh, src, shape, dtype, src_order, what="plan_redistribute src")
    d = ShardingSpec.make(mesh, dst, shape, dtype, dst_order, what="plan_redistribute dst")
    cm = cost_model or CostModel(mesh)
    if cm.mesh.shape != mesh.shape:
        raise ValueError(f"cost model is for mesh {cm.mesh.shape}, plan is on mesh {mesh.shape}")
    return (_plan_cached if cache else _plan)(s, d, cm, even_only, fuse)


def plan_between(src: ShardingSpec, dst: ShardingSpec, cost_model: CostModel | None = None,
                 cache: bool = True, even_only: bool = False, fuse: bool = False) -> RedistributePlan:
    """Plan between two ``ShardingSpec``s of the same value."""
    if src.mesh.shape != dst.mesh.shape or src.shape != dst.shape:
        raise ValueError(f"cannot redistribute between {src.mesh}/{src.shape} and {dst.mesh}/{dst.shape}")
    cm = cost_model or CostModel(src.mesh)
    return (_plan_cached if cache else _plan)(src, dst, cm, even_only, fuse)


def costs_from(src: ShardingSpec, dsts: Sequence[ShardingSpec], cost_model: CostModel | None = None,
               even_only: bool = False, fuse: bool = False) -> list[float]:
    """``[plan_between(src, d).cost for d in dsts]``, from one search over every state reachable from
    ``src`` (Dijkstra on the planner's own moves) rather than one search per target: what a global
    placement solver needs, every pair among a value's candidate placements.  Same costs as
    ``plan_between``; targets it cannot reach that way (mixed reduce ops) are planned one by one."""
    cm = cost_model or CostModel(src.mesh)
    for d in dsts:
        if d.mesh.shape != src.mesh.shape or d.shape != src.shape:
            raise ValueError(f"cannot redistribute between {src.mesh}/{src.shape} and {d.mesh}/{d.shape}")
    sp = _partials(src)
    parts = [_partials(d) for d in dsts]
    op_of = [set(p.values()) for p in parts]
    # one search per target reduce op (a state holds partial dims of at most two ops: the source's,
    # still to reduce, and the target's); sources mixing ops are planned pair by pair
    runs = sorted(set().union(*op_of)) or ["sum"]
    if len(set(sp.values())) > 1:
        runs = []
    out: list = [None] * len(dsts)
    for k, op in enumerate(runs):
        want = [i for i, o in enumerate(op_of) if o == {op} or (not o and k == 0)]
        pmask = {i: sum(1 << m for m in parts[i]) for i in want}
        union = 0
        for x in pmask.values():
            union |= x
        stacks = frozenset(dsts[i].levels for i, x in pmask.items() if x)
        dist = distances(cm, src.mesh.shape, src.levels, sp, stacks, union, op, src.nbytes, src.shape,
                         even_only, fuse)
        for i, x in pmask.items():
            out[i] = dist.get((dsts[i].levels, x))
    return [c if c is not None else _plan(src, d, cm, even_only, fuse).cost for c, d in zip(out, dsts)]


@lru_cache(maxsize=16384)
def _plan_cached(src: ShardingSpec, dst: ShardingSpec, cm: CostModel, even_only: bool,
                 fuse: bool = False) -> RedistributePlan:
    return _plan(src, dst, cm, even_only, fuse)


def _partials(spec: ShardingSpec) -> dict[int, str]:
    return {m: p.reduce_op for m, p in enumerate(spec.placements) if placement_kind(p) == "P"}


def _moved_placement(levels, part, m):
    """Placement of mesh dim ``m`` in a state (without building the whole placements tuple)."""
    if m in part:
        return Partial(part[m])
    for d, st in enumerate(levels):
        for mm, sf in st:
            if mm == m:
                return StridedShard(d, split_factor=sf) if sf != 1 else Shard(d)
    return Replicate()


def _plan(src: ShardingSpec, dst: ShardingSpec, cm: CostModel, even_only: bool = False,
          fuse: bool = False) -> RedistributePlan:
    mesh = src.mesh
    sp, dp = _partials(src), _partials(dst)
    if src.levels == dst.levels and sp == dp:
        return RedistributePlan(src, dst, (), (src.levels,), (sp,), 0.0)
    problem = Problem(cm, mesh.shape, src.levels, dst.levels, sp, dp, src.nbytes, src.shape, even_only, fuse)
    total, moves, states = solve(problem)
    steps, levels, partials = [], [src.levels], [dict(sp)]
    part = dict(sp)
    for (move, c), (stacks, _pa, _pb), prev in zip(moves, states[1:], states[:-1]):
        dims = move.mesh_dims
        before = tuple(_moved_placement(prev[0], part, m) for m in dims)
        part = dict(part)
        for m in dims:
            if move.kind in (AR, RS):
                part.pop(m)
            elif move.kind == MAKE_PARTIAL:
                part[m] = dp[m]
        after = tuple(_moved_placement(stacks, part, m) for m in dims)
        if not move.fused:
            before, after = before[0], after[0]
        steps.append(Step(tuple(sorted(dims)), before, after, _COLLECTIVE[move.kind], c, move))
        levels.append(stacks)
        partials.append(part)
    return RedistributePlan(src, dst, tuple(steps), tuple(levels), tuple(partials), total)
