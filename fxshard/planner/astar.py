"""A* over packed states: the min-cost redistribution plan between two placements.

The heuristic is consistent (``Problem``'s bounds), so the first time the goal is popped its cost
is minimal.  Two constructive plans (``direct_plan``: reduce, gather, push; ``placing_plan``: place
the target's levels as early as they go) give an incumbent: nothing as dear is pushed, and it is
returned as soon as the frontier cannot beat it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ..core.spec import levels_divide
from .moves import Packing, expander
from .problem import A2A, AG, AR, MAKE_PARTIAL, RS, SHARD, Move, Problem


def solve(P: Problem):
    """(cost, [(Move, cost), ...], [state, ...]) of a min-cost path from ``P``'s source to its
    target; states are ``(stacks, pa, pb)``."""
    start_t = (P.src_levels, P.start_pa, P.start_pb)
    goal_t = (P.dst_levels, 0, P.dst_pmask)
    if start_t == goal_t:
        return 0.0, [], [start_t]
    k = P.k
    pk = Packing(P)
    start = pk.pack(*start_t)
    goal = pk.pack(*goal_t)
    start_shards, start_mask = 1, 0
    for st in P.src_levels:
        for m, _ in st:
            start_shards *= k[m]
            start_mask |= 1 << m
    h0 = P.heuristic(*start_t)
    best = {start: 0.0}
    parent = {}  # state -> (previous state, move, its cost), written when the state is expanded
    # neighbours no cheaper than their best known cost are dropped before any tuple is built (the
    # push loop checks again)
    expand = expander(P, pk, best.get, {goal & pk.stack_bits})
    # With fusion the per-dim bounds leave the base latency out and add it once while anything is
    # left to do; "anything" is h above rounding (h is kept up by adding differences)
    bshare = P.base_share
    h_eps = 1e-9 * (1.0 + h0)
    inc_cost, inc_moves = incumbent(P)
    # a frontier f this high: the incumbent is optimal (to rounding), so nothing that high is pushed
    # either
    ub = stop = inc_cost * (1 - 1e-12)
    if inc_cost < math.inf:
        h_eps += 1e-9 * inc_cost
    # (f, -depth, g, state, shards, sharded mesh dims, h, previous state, move, move cost): ties on
    # f go deepest first; two entries never tie on (f, depth, g, state) (a state is pushed again
    # only for a strictly lower g)
    heap = [
        (
            h0 + (bshare if h0 > h_eps else 0.0),
            0,
            0.0,
            start,
            start_shards,
            start_mask,
            h0,
            None,
            None,
            0.0,
        )
    ]
    push_heap, pop_heap, inf = heapq.heappush, heapq.heappop, math.inf
    while heap:
        f, depth, gcost, state, shards, sharded, h, prev, pmove, pcost = pop_heap(heap)
        if gcost > best[state]:
            continue
        if f >= stop:  # nothing left beats the incumbent (a goal this dear included)
            break
        parent[state] = (prev, pmove, pcost)
        if state == goal:
            return _unwind(parent, state, gcost, pk.unpack)
        depth -= 1
        for new_state, step_cost, new_shards, new_mask, dh, move in expand(
            state, gcost, h, shards, sharded, ub
        ):
            ng = gcost + step_cost
            nh = h + dh
            if new_state == goal:
                nh = 0.0
                if ng < ub:
                    ub = ng
            if ng < best.get(new_state, inf) - 1e-9:
                best[new_state] = ng
                push_heap(
                    heap,
                    (
                        ng + nh + (bshare if nh > h_eps else 0.0),
                        depth,
                        ng,
                        new_state,
                        new_shards,
                        new_mask,
                        nh,
                        state,
                        move,
                        step_cost,
                    ),
                )
    if inc_cost < inf:  # everything else was dearer: the incumbent it is
        return inc_cost, [(Move._make(mv), c) for mv, c in inc_moves], replay(P, inc_moves)
    raise ValueError("no redistribution path exists")  # unreachable for valid specs


def incumbent(P: Problem) -> tuple[float, list]:
    """The cheaper simple plan: (cost, moves); cost inf where neither applies."""
    # The placing plan is the better one but where reducing first pays (measured: direct won only
    # with partial dims to reduce, 5 of 197 cases on 3-5-D meshes); it pays off where searches are
    # large (3+ mesh dims).
    inc_cost, inc_moves = math.inf, []
    if P.M >= 3:
        inc_cost, inc_moves = placing_plan(P)
    if P.M < 3 or P.start_pa or inc_cost == math.inf:
        c, mv = direct_plan(P)
        if c < inc_cost:
            inc_cost, inc_moves = c, mv
    if P.even_only and not all(
        levels_divide(P.shape[d], st, P.k)
        for lv in (P.src_levels, P.dst_levels)
        for d, st in enumerate(lv)
    ):
        # the simple plans pass only prefixes of these stacks: even only if both ends are
        inc_cost = math.inf
    return inc_cost, inc_moves


def _unwind(parent, state, total, unpack):
    moves, costs, states = [], [], [unpack(state)]
    while parent[state][0] is not None:
        prev, move, c = parent[state]
        moves.append(Move._make(move))
        costs.append(c)
        states.append(unpack(prev))
        state = prev
    moves.reverse()
    costs.reverse()
    states.reverse()
    return total, list(zip(moves, costs)), states


def direct_plan(P: Problem) -> tuple[float, list]:
    """A simple valid plan, as an upper bound and incumbent: reduce what must be reduced
    (reduce-scatter where that extends the target's stack, else all-reduce), gather every level
    above the common prefix with the target, then shard (free) into the target's order and make dims
    partial.  Returns (cost, [(move tuple, cost), ...]); ``replay`` gives its states."""
    k = P.k
    stacks = [list(st) for st in P.src_levels]
    tgt = P.dst_levels
    shards = 1
    for st in stacks:
        for m, _ in st:
            shards *= k[m]
    cost = 0.0
    g, tab = P.g, P.tab
    pa, pb = P.start_pa, P.start_pb
    moves = []
    for m in range(P.M):
        bit = 1 << m
        if not (pa | pb) & bit or (pb & bit and P.dst_pmask & bit):
            continue
        n = g / shards
        where = P.dst_where.get(m)
        if where is not None:
            d, sf = where
            if tuple(stacks[d]) + ((m, sf),) == tgt[d][: len(stacks[d]) + 1]:
                c = tab.rs_l[m] + tab.rs_f[m] * n
                moves.append(((RS, m, None, d, sf), c))
                cost += c
                stacks[d].append((m, sf))
                shards *= k[m]
                continue
        c = tab.ar_l[m] + tab.ar_f[m] * n
        moves.append(((AR, m, None, None, 1), c))
        cost += c
    for d, st in enumerate(stacks):
        keep = 0
        while keep < len(st) and keep < len(tgt[d]) and st[keep] == tgt[d][keep]:
            keep += 1
        while len(st) > keep:
            m, _ = st.pop()
            c = tab.ag_l[m] + tab.ag_f[m] * g / shards
            moves.append(((AG, m, d, None, 1), c))
            cost += c
            shards //= k[m]
    _finish(P, stacks, pb, moves)
    return cost, moves


def _finish(P: Problem, stacks, pb, moves):
    """Free moves that end a simple plan: push the target's missing levels in its order, then make
    the target's partial dims partial (what ``solve`` allows only once the stacks are in place)."""
    for d, (st, t) in enumerate(zip(stacks, P.dst_levels)):
        for m, sf in t[len(st) :]:
            moves.append(((SHARD, m, None, d, sf), 0.0))
    for m in range(P.M):
        if P.dst_pmask >> m & 1 and not pb >> m & 1:
            moves.append(((MAKE_PARTIAL, m, None, None, 1), 0.0))


def replay(P: Problem, moves: Sequence) -> list:
    """The states ``(stacks, pa, pb)`` a simple plan passes, from the source to the target."""
    stacks = [tuple(st) for st in P.src_levels]
    pa, pb = P.start_pa, P.start_pb
    out = [(tuple(stacks), pa, pb)]
    for (kind, m, d, d2, sf), _c in moves:
        bit = 1 << m
        if d is not None:  # AG, A2A: the level leaves its stack
            stacks[d] = stacks[d][:-1]
        if kind in (AR, RS):
            pa, pb = pa & ~bit, pb & ~bit
        elif kind == MAKE_PARTIAL:
            pb |= bit
        if d2 is not None:  # A2A, SHARD, RS: it joins another
            stacks[d2] = stacks[d2] + ((m, sf),)
        out.append((tuple(stacks), pa, pb))
    return out


def placing_plan(P: Problem) -> tuple[float, list]:
    """Another simple valid plan, often far cheaper than ``direct_plan``: place target levels
    as early as they can go (free pushes, then reduce-scatters onto the target's stacks), and move a
    level that must leave its stack straight to its target place with one all-to-all when that place
    is next in line, gathering it otherwise.  Every state it passes is a prefix of the source's or
    the target's stacks, so it is valid under ``even_only`` too; a tighter upper bound prunes more.
    (cost, moves) as ``direct_plan``; cost inf where it gets stuck."""
    k, tgt, T = P.k, P.dst_levels, P.T
    stacks = [list(st) for st in P.src_levels]
    keep = []  # per tensor dim: length of the common prefix with the target
    for st, t in zip(stacks, tgt):
        n = 0
        while n < len(st) and n < len(t) and st[n] == t[n]:
            n += 1
        keep.append(n)
    places = [(lev[0], d, p, lev[1]) for d, t in enumerate(tgt) for p, lev in enumerate(t)]
    where = {m: (d, p, sf) for m, d, p, sf in places}
    shards, sharded = 1, 0
    for st in stacks:
        for m, _ in st:
            shards *= k[m]
            sharded |= 1 << m
    g, tab = P.g, P.tab
    pa, pb, keep_p = P.start_pa, P.start_pb, P.dst_pmask
    cost = 0.0
    moves = []
    while True:
        # free pushes and reduce-scatters that extend a target prefix (in target order, so one pass
        # places a whole run)
        for m, d, p, sf in places:
            if keep[d] != p or len(stacks[d]) != p:
                continue
            bit = 1 << m
            if (pa | pb) & bit and not (pb & keep_p & bit):
                c = tab.rs_l[m] + tab.rs_f[m] * g / shards
                moves.append(((RS, m, None, d, sf), c))
                cost += c
                pa, pb = pa & ~bit, pb & ~bit
            elif (pa | pb | sharded) & bit:
                continue
            else:
                moves.append(((SHARD, m, None, d, sf), 0.0))
            stacks[d].append((m, sf))
            keep[d] = p + 1
            shards *= k[m]
            sharded |= bit
        # one level above a common prefix leaves: all-to-all to its place when that is next in
        # line, else gather
        for d in range(T):
            st = stacks[d]
            if len(st) > keep[d]:
                m, _ = st.pop()
                w = where.get(m)
                if w is not None and w[0] != d and keep[w[0]] == w[1] == len(stacks[w[0]]):
                    d2, p2, sf2 = w
                    c = tab.a2_l[m] + tab.a2_f[m] * g / shards
                    moves.append(((A2A, m, d, d2, sf2), c))
                    stacks[d2].append((m, sf2))
                    keep[d2] = p2 + 1
                else:
                    c = tab.ag_l[m] + tab.ag_f[m] * g / shards
                    moves.append(((AG, m, d, None, 1), c))
                    shards //= k[m]
                    sharded &= ~(1 << m)
                cost += c
                break
        else:
            break
    if any(len(st) != len(t) or n != len(t) for st, t, n in zip(stacks, tgt, keep)):
        return (
            math.inf,
            moves,
        )  # stuck (a level whose place never frees up): no bound from this plan
    for m in range(P.M):  # partial dims the target does not keep: all-reduce
        if (pa | pb) >> m & 1 and not (pb & keep_p) >> m & 1:
            c = tab.ar_l[m] + tab.ar_f[m] * g / shards
            moves.append(((AR, m, None, None, 1), c))
            cost += c
            pb &= ~(1 << m)
    _finish(P, stacks, pb, moves)
    return cost, moves
