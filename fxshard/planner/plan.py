"""Redistribution plans: ``plan_redistribute(mesh, src, dst, shape)`` and what it returns.

A ``RedistributePlan`` is the sequence of ``Step``s (one collective or local move each, on one mesh
dim or, fused, several) from one placement of a value to another, with the states in between and
the modelled cost; ``astar.solve`` finds the cheapest.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._torch import Partial, Replicate, Shard, StridedShard, placement_kind
from ..core.cost import CostModel, CostModelLike
from ..core.mesh import MeshSpec
from ..core.spec import (
    Levels,
    ShardingSpec,
    is_even,
    levels_divide,
    levels_to_placements,
    placement_str,
    placements_str,
)
from .astar import solve
from .problem import A2A, AG, AR, MAKE_PARTIAL, RS, SHARD, Move, Problem

_COLLECTIVE = {
    AG: "all_gather",
    A2A: "all_to_all",
    AR: "all_reduce",
    RS: "reduce_scatter",
    SHARD: None,
    MAKE_PARTIAL: None,
}


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
        src, dst = placement_str(self.src), placement_str(self.dst)
        return f"[{dims}] {src} -> {dst} ({what}, {self.cost:.2f} us)"


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
            raise ValueError(
                f"cannot chain {self} with {other}: it starts at {other.src}, not {self.dst}"
            )
        return RedistributePlan(
            self.src,
            other.dst,
            self.steps + other.steps,
            self.levels + other.levels[1:],
            self.partials + other.partials[1:],
            self.cost + other.cost,
        )

    def __str__(self) -> str:
        path = " -> ".join(
            placements_str(levels_to_placements(lv, part, self.src.mesh.ndim), lv)
            for lv, part in zip(self.levels, self.partials)
        )
        return f"{path}  ({self.cost:.2f} us)"


def clear_plan_cache() -> None:
    """Forget every memoised plan, spec and layout (for honest uncached timings)."""
    from ..core.spec import _make_cached, level_positions

    _plan_cached.cache_clear()
    _make_cached.cache_clear()
    level_positions.cache_clear()


def plan_redistribute(
    mesh: MeshSpec | DeviceMesh,
    src: Sequence,
    dst: Sequence,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    src_order: dict | None = None,
    dst_order: dict | None = None,
    cost_model: CostModelLike | None = None,
    cache: bool = True,
    even_only: bool = False,
    multi_dim_collectives: bool = False,
    fuse: bool | None = None,
) -> RedistributePlan:
    """The cheapest sequence of collectives taking a tensor from ``src`` to ``dst`` placements.

    ``mesh`` is a ``MeshSpec`` or ``DeviceMesh``; ``src_order`` / ``dst_order`` give non-default
    shard orders as ``{tensor_dim: (mesh_dim, ...)}`` or ``ShardOrderEntry`` tuples.
    ``even_only=True`` keeps every intermediate state evenly sharded (needed to trace the plan into
    one rank-agnostic graph); src and dst must then be even too.  ``multi_dim_collectives=True``
    (``fuse``: its old name) also considers one collective over several mesh dims (a flattened group
    paying one base latency); such steps have ``len(step.mesh_dims) > 1``.  ``cache=False`` plans
    afresh (no memoised plan or spec is used).
    """
    if fuse is not None:
        warnings.warn(
            "plan_redistribute(fuse=) is deprecated: it is called multi_dim_collectives=",
            DeprecationWarning,
            stacklevel=2,
        )
        multi_dim_collectives = bool(fuse)
    mesh = MeshSpec.from_device_mesh(mesh)
    if cost_model is not None and not callable(getattr(cost_model, "collective", None)):
        raise TypeError(
            "plan_redistribute: cost_model must be a fxshard.CostModel (or any object with "
            f"collective(kind, mesh_dims, nbytes) -> us), got {type(cost_model).__name__}"
        )
    shape = tuple(int(s) for s in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"plan_redistribute: shape {shape} has a negative size")
    for what, pls in (("src", src), ("dst", dst)):
        if dtype == torch.bool and any(
            isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for p in pls
        ):
            raise ValueError(
                f"plan_redistribute {what}: Partial(sum/avg) of a bool tensor has no value of "
                f"its dtype; use Partial('max') (logical or) or Partial('min') (logical and)"
            )
        integer = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        if integer and any(isinstance(p, Partial) and p.reduce_op == "avg" for p in pls):
            raise ValueError(
                f"plan_redistribute {what}: Partial('avg') of a {dtype} tensor: the mean of "
                "integers is not an integer in general, and no integer result would be the value; "
                "use Partial('sum') and divide in a floating dtype"
            )
    s = ShardingSpec.make(
        mesh, src, shape, dtype, src_order, what="plan_redistribute src", cache=cache
    )
    d = ShardingSpec.make(
        mesh, dst, shape, dtype, dst_order, what="plan_redistribute dst", cache=cache
    )
    cm = cost_model or CostModel(mesh)
    if cm.mesh.shape != mesh.shape:
        raise ValueError(f"cost model is for mesh {cm.mesh.shape}, plan is on mesh {mesh.shape}")
    return (_plan_cached if cache else _plan)(s, d, cm, even_only, multi_dim_collectives)


def plan_between(
    src: ShardingSpec,
    dst: ShardingSpec,
    cost_model: CostModel | None = None,
    cache: bool = True,
    even_only: bool = False,
    fuse: bool = False,
) -> RedistributePlan:
    """Plan between two ``ShardingSpec``s of the same value."""
    if src.mesh.shape != dst.mesh.shape or src.shape != dst.shape:
        raise ValueError(
            f"cannot redistribute between {src.mesh}/{src.shape} and {dst.mesh}/{dst.shape}"
        )
    cm = cost_model or CostModel(src.mesh)
    return (_plan_cached if cache else _plan)(src, dst, cm, even_only, fuse)


def plan_in_program(
    src: ShardingSpec, dst: ShardingSpec, cost_model: CostModel | None = None, fuse: bool = False
) -> RedistributePlan:
    """The plan a sharded program runs between two specs.  Between evenly sharded ends every
    intermediate state stays even too (the program then traces into one rank-agnostic graph); an
    uneven end (or no even route) lets the plan pass through uneven states, and the program is
    lowered per rank, with local shapes that differ by rank."""
    if is_even(src) and is_even(dst):
        try:
            return plan_between(src, dst, cost_model, even_only=True, fuse=fuse)
        except ValueError:
            pass
    return plan_between(src, dst, cost_model, even_only=False, fuse=fuse)


def plan_is_even(plan: RedistributePlan) -> bool:
    """Every state the plan passes through shards its tensor evenly."""
    mesh_shape = plan.src.mesh.shape
    return all(
        levels_divide(n, lv, mesh_shape)
        for levels in plan.levels
        for n, lv in zip(plan.src.shape, levels)
    )


@lru_cache(maxsize=16384)
def _plan_cached(
    src: ShardingSpec, dst: ShardingSpec, cm: CostModel, even_only: bool, fuse: bool = False
) -> RedistributePlan:
    return _plan(src, dst, cm, even_only, fuse)


def _partials(spec: ShardingSpec) -> dict[int, str]:
    return {m: p.reduce_op for m, p in enumerate(spec.placements) if placement_kind(p) == "P"}


_REPLICATE = Replicate()
_SHARDS: dict = {}
_PARTIALS: dict = {}


def _shard_placement(d, sf):
    if sf != 1:
        return StridedShard(d, split_factor=sf)
    p = _SHARDS.get(d)
    if p is None:
        p = _SHARDS[d] = Shard(d)
    return p


def _partial_placement(op):
    p = _PARTIALS.get(op)
    if p is None:
        p = _PARTIALS[op] = Partial(op)
    return p


def _moved_placement(levels, part, m):
    """Placement of mesh dim ``m`` in a state (without building the whole placements tuple).
    Placements are immutable values, so plain ones are made once and shared."""
    op = part.get(m)
    if op is not None:
        return _partial_placement(op)
    for d, st in enumerate(levels):
        for mm, sf in st:
            if mm == m:
                return _shard_placement(d, sf)
    return _REPLICATE


_new = object.__new__


def _step(dims, before, after, collective, cost, move) -> Step:
    """``Step(...)`` without the frozen dataclass's per-field ``object.__setattr__`` (a plan makes
    several per call; this is a third of their cost)."""
    st = _new(Step)
    st.__dict__.update(
        mesh_dims=dims, src=before, dst=after, collective=collective, cost=cost, move=move
    )
    return st


def _plan(
    src: ShardingSpec, dst: ShardingSpec, cm: CostModel, even_only: bool = False, fuse: bool = False
) -> RedistributePlan:
    mesh = src.mesh
    sp, dp = _partials(src), _partials(dst)
    if src.levels == dst.levels and sp == dp:
        return RedistributePlan(src, dst, (), (src.levels,), (sp,), 0.0)
    problem = Problem(
        cm, mesh.shape, src.levels, dst.levels, sp, dp, src.nbytes, src.shape, even_only, fuse
    )
    total, moves, states = solve(problem)
    steps, levels, partials = [], [src.levels], [sp]
    part = sp
    for (move, c), (stacks, _pa, _pb), prev in zip(moves, states[1:], states[:-1]):
        kind, m = move.kind, move.mesh_dim
        if type(m) is tuple:  # fused: several mesh dims
            before = tuple(_moved_placement(prev[0], part, x) for x in m)
            if kind in (AR, RS, MAKE_PARTIAL):
                part = dict(part)
                for x in m:
                    if kind == MAKE_PARTIAL:
                        part[x] = dp[x]
                    else:
                        del part[x]
            after = tuple(_moved_placement(stacks, part, x) for x in m)
            m = tuple(sorted(m))
        else:
            if kind == AG or kind == A2A:
                before = _shard_placement(move.src_dim, prev[0][move.src_dim][-1][1])
            elif kind == SHARD or kind == MAKE_PARTIAL:
                before = _REPLICATE
            else:  # AR, RS
                before = _partial_placement(part[m])
            if kind == AG or kind == AR:
                after = _REPLICATE
            elif kind == MAKE_PARTIAL:
                after = _partial_placement(dp[m])
            else:  # A2A, SHARD, RS
                after = _shard_placement(move.dst_dim, move.sf)
            if kind == AR or kind == RS or kind == MAKE_PARTIAL:
                part = dict(part)
                if kind == MAKE_PARTIAL:
                    part[m] = dp[m]
                else:
                    del part[m]
            m = (m,)
        steps.append(_step(m, before, after, _COLLECTIVE[kind], c, move))
        levels.append(stacks)
        partials.append(part)
    plan = _new(RedistributePlan)  # as _step: no per-field object.__setattr__
    plan.__dict__.update(
        src=src,
        dst=dst,
        steps=tuple(steps),
        levels=tuple(levels),
        partials=tuple(partials),
        cost=total,
    )
    return plan
