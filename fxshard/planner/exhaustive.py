"""Exhaustive search over the planner's moves: the cost from one placement to every other.

``plan="auto"`` asks for nearly every pair among a value's candidate placements; one Dijkstra run
from each source (``costs_from``), or the recorded state graph closed under min-plus
(``pairwise_costs``), replaces one A* per pair.  The moves are A*'s own (``moves.expander``), so
the costs are exactly the plans' costs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence

import torch

from ..core.cost import CostModel, CostModelLike
from ..core.spec import Levels, ShardingSpec
from .moves import Packing, expander, state_key
from .plan import _partials, _plan
from .problem import LINEAR_OPS, Problem

_LINEAR = frozenset(LINEAR_OPS)


def distances(
    cost_model: CostModelLike,
    mesh_shape: tuple[int, ...],
    src_levels: Levels,
    src_partial: dict,
    target_stacks: Iterable[Levels],
    target_pmask: int,
    ops: dict,
    global_bytes: float,
    shape: tuple[int, ...],
    even_only: bool = False,
    fuse: bool = False,
    graph: dict | None = None,
) -> dict:
    """Min cost from one source to every reachable state, over exactly the moves ``solve`` uses:
    ``{(shard stacks, partial mask): cost}``.  One run replaces a plan per target: the automatic
    planner asks for every pair among a value's candidate placements.  ``ops``: the reduce op of
    each mesh dim the targets hold partial (``target_pmask``); a source partial dim with that op may
    stay, any other must be reduced (as ``solve`` treats them).  ``target_stacks`` are the stacks at
    which a replicated dim may be made partial (the targets holding partial dims).  Plain Dijkstra:
    no heuristic, no scratch-dim pruning (every target is a goal)."""
    T = len(src_levels)
    P = Problem(
        cost_model,
        mesh_shape,
        src_levels,
        tuple(() for _ in range(T)),
        src_partial,
        dict(ops),
        global_bytes,
        shape,
        even_only,
        fuse,
    )
    P.dst_pmask = target_pmask
    keep = sum(1 << m for m, o in src_partial.items() if ops.get(m) == o)
    P.start_pa, P.start_pb = sum(1 << m for m in src_partial) & ~keep, keep
    P.drop_bounds()  # a zero heuristic: Dijkstra
    P.scratch, P.scratch_groups, P.scratch_set = [], [], set()
    return dijkstra(P, target_stacks, graph)


def dijkstra(P: Problem, target_stacks: Iterable[Levels], graph: dict | None = None) -> dict:
    """``{(stacks, kept partial mask): min cost}`` of every state with nothing left to reduce that
    is reachable from ``P``'s source.  ``graph``: filled with every expanded state's moves,
    ``{state: [(state, cost), ...]}`` in the packed form ``state_key`` gives; states already in it
    (from an earlier run over the same moves, which recorded everything reachable from them too)
    are not expanded again, so the costs returned are complete only for a fresh graph."""
    pk = Packing(P)
    if graph is not None and pk.B != P.M + 1:
        raise ValueError("dijkstra(graph=...) takes plain shards only (no strided levels)")
    k = P.k
    start = pk.pack(P.src_levels, P.start_pa, P.start_pb)
    shards, mask = 1, 0
    for st in P.src_levels:
        for m, _ in st:
            shards *= k[m]
            mask |= 1 << m
    best = {start: 0.0}
    # the recording run keeps every move (nothing pruned by the costs known so far)
    expand = expander(
        P, pk, best.get if graph is None else {}.get, {pk.pack(st, 0, 0) for st in target_stacks}
    )
    heap = [(0.0, start, shards, mask)]
    inf = math.inf
    while heap:
        gcost, state, shards, sharded = heapq.heappop(heap)
        if gcost > best[state]:
            continue
        if graph is not None and state in graph:
            continue  # recorded by an earlier run, with everything reachable from it
        nbrs = expand(state, gcost, 0.0, shards, sharded, inf)
        # packed states: plain levels pack alike in every search (see state_key)
        if graph is not None:
            graph[state] = [(x[0], x[1]) for x in nbrs]
        for new_state, step_cost, new_shards, new_mask, _dh, _move in nbrs:
            ng = gcost + step_cost
            if ng < best.get(new_state, inf) - 1e-9:
                best[new_state] = ng
                heapq.heappush(heap, (ng, new_state, new_shards, new_mask))
    out = {}
    for st, c in best.items():  # states with nothing left to reduce
        stacks, pa, pb = pk.unpack(st)
        if not pa:
            out[stacks, pb] = c
    return out


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


def _share_graphs(runs: list[tuple[dict, list[int]]]) -> list[list[tuple[dict, list[int]]]]:
    """The runs (one per set of target reduce ops) that can share one state graph: those whose
    target ops are all linear (sum, avg).  The moves look at reduce ops only to keep a fused
    reduction to one op, and sum and avg mix (sum, then scale), so from any state they are the same
    moves at the same costs in each of those runs; a run differs only in where its sources start
    (which partial dims they keep) and which targets it holds.  The union of the runs' targets'
    partial dims and stacks (where a dim may be made partial) lowers no cost: making a dim partial
    is free, and a dim made partial early only stops the moves that shard along it.  On a 3-D mesh
    a value with sum and avg placements has 8 such runs; one graph and one closure replace 8
    (a torchtitan 8B on 4x4x4: 380 closures of ~430 states -> ~100)."""
    linear, other = [], []
    for r in runs:
        (linear if set(r[0].values()) <= _LINEAR else other).append(r)
    return ([linear] if linear else []) + [[r] for r in other]


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
            raise ValueError(
                f"cannot redistribute between {src.mesh}/{src.shape} and {d.mesh}/{d.shape}"
            )


def _fill_by_plan(out, src, dsts, cm, even_only, fuse):
    for i, (c, d) in enumerate(zip(out, dsts)):
        if c is None:
            try:
                out[i] = _plan(src, d, cm, even_only, fuse).cost
            except ValueError:  # no path (even_only: every route passes an uneven state)
                out[i] = math.inf
    return out


def costs_from(
    src: ShardingSpec,
    dsts: Sequence[ShardingSpec],
    cost_model: CostModel | None = None,
    even_only: bool = False,
    fuse: bool = False,
) -> list[float]:
    """``[plan_between(src, d).cost for d in dsts]``, from one search over every state reachable
    from
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
            dist = distances(
                cm,
                src.mesh.shape,
                src.levels,
                _partials(src),
                stacks,
                union,
                ops,
                src.nbytes,
                src.shape,
                even_only,
                fuse,
            )
            for i, x in pmask.items():
                out[i] = dist.get((dsts[i].levels, x))
    return _fill_by_plan(out, src, dsts, cm, even_only, fuse)


def pairwise_costs(
    specs: Sequence[ShardingSpec],
    cost_model: CostModel | None = None,
    even_only: bool = False,
    fuse: bool = False,
) -> torch.Tensor:
    """``[i, j] = plan_between(specs[i], specs[j]).cost`` for specs of one value (same mesh, shape,
    dtype), all at once: the planner's state graph (the moves ``solve`` uses, recorded while
    exploring from the sources until every state reachable from any of them is expanded) is closed
    under min-plus (Floyd-Warshall, vectorised), once per set of target reduce ops (one for all
    the sets of linear ops: ``_share_graphs``).  Strided shards
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
    runs = [
        (ops, [plain[j] for j in members]) for ops, members in _op_runs([parts[i] for i in plain])
    ]
    for group in _share_graphs(runs):
        members = [j for _, ms in group for j in ms]
        pmask, union, stacks = _run_setup(specs, parts, members)
        graph: dict = {}
        starts = {}
        for r, (ops, _) in enumerate(group):
            for i in plain:
                keep = sum(1 << m for m, o in parts[i].items() if ops.get(m) == o)
                start = state_key(specs[i].levels, sum(1 << m for m in parts[i]) & ~keep, keep, M)
                starts[r, i] = start
                if start not in graph:  # else: everything reachable from it is expanded already
                    distances(
                        cm,
                        s0.mesh.shape,
                        specs[i].levels,
                        parts[i],
                        stacks,
                        union,
                        ops,
                        s0.nbytes,
                        s0.shape,
                        even_only,
                        fuse,
                        graph=graph,
                    )
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
        via = torch.empty_like(D)
        for m in range(N):  # Floyd-Warshall, in place (row and column m do not change in step m)
            torch.add(D[:, m : m + 1], D[m : m + 1, :], out=via)
            torch.minimum(D, via, out=D)
        for r, (_, ms) in enumerate(group):
            goals = [(j, idx.get(state_key(specs[j].levels, 0, pmask[j], M))) for j in ms]
            goals = [(j, g) for j, g in goals if g is not None]
            if goals:
                rows = torch.tensor([idx[starts[r, i]] for i in plain])
                sub = D[rows][:, torch.tensor([g for _, g in goals])]
                out[torch.tensor(plain)[:, None], torch.tensor([j for j, _ in goals])[None, :]] = (
                    sub
                )
    rest = [i for i in range(n) if i not in set(plain)]
    for i in range(n) if rest else ():  # strided shards: pair by pair
        cols = list(range(n)) if i in rest else rest
        out[i, cols] = torch.tensor(
            _fill_by_plan(
                [None] * len(cols), specs[i], [specs[j] for j in cols], cm, even_only, fuse
            ),
            dtype=torch.float64,
        )
    return out
