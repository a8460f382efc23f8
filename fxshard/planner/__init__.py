"""Min-cost redistribution planning: ``plan_redistribute(mesh, src, dst, shape)``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..adapter import Partial, Replicate, Shard, StridedShard, placement_kind
from ..cost import CostModel
from ..mesh import MeshSpec
from ..spec import Levels, ShardingSpec, levels_to_placements, placement_str, placements_str
from .search import A2A, AG, AR, MAKE_PARTIAL, RS, SHARD, Move, Problem, distances, solve, state_key

__all__ = ["Step", "RedistributePlan", "plan_redistribute", "plan_between", "costs_from", "pairwise_costs",
           "clear_plan_cache"]

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
    ``len(step.mesh_dims) > 1``.  ``cache=False`` plans afresh (no memoised plan or spec is used).
    """
    mesh = MeshSpec.from_device_mesh(mesh)
    shape = tuple(int(s) for s in shape)
    s = ShardingSpec.make(mesh, src, shape, dtype, src_order, what="plan_redistribute src", cache=cache)
    d = ShardingSpec.make(mesh, dst, shape, dtype, dst_order, what="plan_redistribute dst", cache=cache)
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


def _op_runs(parts: list[dict]) -> list[tuple[dict, list[int]]]:
    """Targets grouped into searches: a search fixes one reduce op per partial mesh dim, and holds
    every target whose partial dims agree with it (targets without partial dims join the first)."""
    runs: list[tuple[dict, list[int]]] = []
    for i, p in enumerate(parts):
        for ops, members in runs:
            if all(ops.get(m, o) == o for m, o in p.items()):
                ops.update(p)
                members.append(i)
                break
        else:
            runs.append((dict(p), [i]))
    return runs


def _run_setup(dsts, parts, members):
    pmask = {i: sum(1 << m for m in parts[i]) for i in members}
    union = 0
    for x in pmask.values():
        union |= x
    return pmask, union, frozenset(dsts[i].levels for i, x in pmask.items() if x)


def _plain(spec: ShardingSpec) -> bool:
    return all(sf == 1 for st in spec.levels for _, sf in st)


def _check_group(src, dsts):
    for d in dsts:
        if d.mesh.shape != src.mesh.shape or d.shape != src.shape:
            raise ValueError(f"cannot redistribute between {src.mesh}/{src.shape} and {d.mesh}/{d.shape}")


def _fill_by_plan(out, src, dsts, cm, even_only, fuse):
    for i, (c, d) in enumerate(zip(out, dsts)):
        if c is None:
            try:
                out[i] = _plan(src, d, cm, even_only, fuse).cost
            except ValueError:  # no path (even_only: every route passes an uneven state)
                out[i] = math.inf
    return out


def costs_from(src: ShardingSpec, dsts: Sequence[ShardingSpec], cost_model: CostModel | None = None,
               even_only: bool = False, fuse: bool = False) -> list[float]:
    """``[plan_between(src, d).cost for d in dsts]``, from one search over every state reachable from
    ``src`` (Dijkstra on the planner's own moves) per set of target reduce ops, rather than one
    search per target.  Same costs as ``plan_between``; strided shards are planned one by one, and
    targets no plan reaches (``even_only`` with no evenly sharded route) cost ``math.inf``."""
    cm = cost_model or CostModel(src.mesh)
    _check_group(src, dsts)
    parts = [_partials(d) for d in dsts]
    out: list = [None] * len(dsts)
    if _plain(src):
        idx = [i for i, d in enumerate(dsts) if _plain(d)]
        for ops, members in _op_runs([parts[i] for i in idx]):
            members = [idx[j] for j in members]
            pmask, union, stacks = _run_setup(dsts, parts, members)
            dist = distances(cm, src.mesh.shape, src.levels, _partials(src), stacks, union, ops, src.nbytes,
                             src.shape, even_only, fuse)
            for i, x in pmask.items():
                out[i] = dist.get((dsts[i].levels, x))
    return _fill_by_plan(out, src, dsts, cm, even_only, fuse)


def pairwise_costs(specs: Sequence[ShardingSpec], cost_model: CostModel | None = None, even_only: bool = False,
                   fuse: bool = False) -> torch.Tensor:
    """``[i, j] = plan_between(specs[i], specs[j]).cost`` for specs of one value (same mesh, shape,
    dtype), all at once: the planner's state graph (the moves ``solve`` uses, recorded while
    exploring from the sources until every state reachable from any of them is expanded) is closed
    under min-plus (Floyd-Warshall, vectorised), once per set of target reduce ops.  Strided shards
    are planned pair by pair; unreachable is inf."""
    n = len(specs)
    out = torch.full((n, n), math.inf, dtype=torch.float64)
    if not n:
        return out
    s0 = specs[0]
    cm = cost_model or CostModel(s0.mesh)
    _check_group(s0, specs)
    parts = [_partials(s) for s in specs]
    plain = [i for i, s in enumerate(specs) if _plain(s)]
    M = s0.mesh.ndim
    for ops, members in _op_runs([parts[i] for i in plain]):
        members = [plain[j] for j in members]
        pmask, union, stacks = _run_setup(specs, parts, members)
        graph: dict = {}
        starts = {}
        for i in plain:
            keep = sum(1 << m for m, o in parts[i].items() if ops.get(m) == o)
            start = state_key(specs[i].levels, sum(1 << m for m in parts[i]) & ~keep, keep, M)
            starts[i] = start
            if start not in graph:  # else: everything reachable from it is expanded already
                distances(cm, s0.mesh.shape, specs[i].levels, parts[i], stacks, union, ops, s0.nbytes, s0.shape,
                          even_only, fuse, graph=graph)
        idx = {st: a for a, st in enumerate(graph)}
        N = len(idx)
        D = torch.full((N, N), math.inf, dtype=torch.float64)
        src_i, dst_i, w = [], [], []
        for st, nbrs in graph.items():
            a = idx[st]
            for t, c in nbrs:
                b = idx.get(t)
                if b is not None:
                    src_i.append(a)
                    dst_i.append(b)
                    w.append(c)
        if w:  # parallel moves between two states: the cheaper one
            flat = torch.tensor(src_i) * N + torch.tensor(dst_i)
            D.view(-1).scatter_reduce_(0, flat, torch.tensor(w, dtype=torch.float64), "amin")
        D.fill_diagonal_(0.0)
        for m in range(N):  # Floyd-Warshall
            D = torch.minimum(D, D[:, m:m + 1] + D[m:m + 1, :])
        goals = [(j, idx.get(state_key(specs[j].levels, 0, pmask[j], M))) for j in members]
        goals = [(j, g) for j, g in goals if g is not None]
        if goals:
            rows = torch.tensor([idx[starts[i]] for i in plain])
            sub = D[rows][:, torch.tensor([g for _, g in goals])]
            out[torch.tensor(plain)[:, None], torch.tensor([j for j, _ in goals])[None, :]] = sub
    rest = [i for i in range(n) if i not in set(plain)]
    for i in range(n) if rest else ():  # strided shards: pair by pair
        cols = list(range(n)) if i in rest else rest
        out[i, cols] = torch.tensor(_fill_by_plan([None] * len(cols), specs[i], [specs[j] for j in cols], cm,
                                                  even_only, fuse), dtype=torch.float64)
    return out


@lru_cache(maxsize=16384)
def _plan_cached(src: ShardingSpec, dst: ShardingSpec, cm: CostModel, even_only: bool,
                 fuse: bool = False) -> RedistributePlan:
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
    st.__dict__.update(mesh_dims=dims, src=before, dst=after, collective=collective, cost=cost, move=move)
    return st


def _plan(src: ShardingSpec, dst: ShardingSpec, cm: CostModel, even_only: bool = False,
          fuse: bool = False) -> RedistributePlan:
    mesh = src.mesh
    sp, dp = _partials(src), _partials(dst)
    if src.levels == dst.levels and sp == dp:
        return RedistributePlan(src, dst, (), (src.levels,), (sp,), 0.0)
    problem = Problem(cm, mesh.shape, src.levels, dst.levels, sp, dp, src.nbytes, src.shape, even_only, fuse)
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
    plan.__dict__.update(src=src, dst=dst, steps=tuple(steps), levels=tuple(levels), partials=tuple(partials),
                         cost=total)
    return plan
