"""Min-cost redistribution: A* over (shard stacks, partial dims) states.

A state says, for every tensor dim, which mesh dims shard it and in which order (a stack of
``(mesh_dim, split_factor)`` levels, innermost last), and which mesh dims hold partial values.
One move changes one mesh dim:

  pop the innermost level of a tensor dim   S -> R          all_gather
  move it onto another (or the same) dim    S -> S'         all_to_all
  push a level on a replicated mesh dim     R -> S          free (local slice)
  make a replicated dim partial             R -> P          free (only towards a partial target)
  reduce a partial dim                      P -> R          all_reduce
  reduce-scatter a partial dim              P -> S          reduce_scatter

Only the innermost level of a tensor dim can move (anything else is not a contiguous collective);
that is what makes shard order matter.  Costs are the cost model's, evaluated at the local size the
tensor has when the step runs, so the planned cost of a path is by construction the sum of its
executed steps, and min-cost paths satisfy the triangle inequality.

The heuristic is, per mesh dim, the cheapest collective that dim cannot avoid (its latency plus the
bandwidth at the smallest local size the tensor can ever have).  Each move changes one mesh dim's
term by at most the move's own cost, so the heuristic is consistent and A* returns a min-cost path.
Tensor dims that neither source nor target shard are interchangeable scratch space: only the first
empty one is ever pushed onto, which removes symmetric duplicates without losing any cost.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER

# Move kinds (also the executor's step kinds).
AG, A2A, SHARD, MAKE_PARTIAL, AR, RS = "all_gather", "all_to_all", "shard", "partial", "all_reduce", "reduce_scatter"
LINEAR_OPS = ("sum", "avg")


@dataclass(frozen=True)
class Move:
    kind: str
    mesh_dim: int
    src_dim: int | None  # tensor dim the level leaves (AG, A2A)
    dst_dim: int | None  # tensor dim the level joins (A2A, SHARD, RS)
    sf: int = 1  # split factor of the level that joins


class Problem:
    """Everything the search needs, precomputed once per plan."""

    def __init__(self, cost_model, mesh_shape, src_levels, dst_levels, src_partial, dst_partial,
                 src_op, dst_op, global_bytes):
        self.k = mesh_shape
        self.M = len(mesh_shape)
        self.T = len(src_levels)
        self.src_levels = src_levels
        self.dst_levels = dst_levels
        self.g = float(global_bytes)
        self.src_op, self.dst_op = src_op, dst_op
        same_op = src_op is None or dst_op is None or src_op == dst_op
        self.op_b = dst_op if dst_op is not None else src_op
        # Partial dims of the target's reduce op live in mask b; of another op (to be cleared) in a.
        smask = sum(1 << m for m in src_partial)
        self.dst_pmask = sum(1 << m for m in dst_partial)
        self.start_pa, self.start_pb = (0, smask) if same_op else (smask, 0)
        both_linear = src_op in LINEAR_OPS + (None,) and dst_op in LINEAR_OPS + (None,)
        self.mix_ok = same_op or both_linear
        cm = cost_model
        self.lat = {}
        self.fac = {}
        for kind in (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ALL_TO_ALL):
            for m in range(self.M):
                k, lat, bw = cm.group((m,))
                self.lat[kind, m] = cm.latency(kind, k, lat) if k > 1 else 0.0
                self.fac[kind, m] = cm.byte_factor(kind, k, bw) if k > 1 else 0.0
        # dst location of each mesh dim
        self.dst_where = {}
        for d, lv in enumerate(dst_levels):
            for m, sf in lv:
                self.dst_where[m] = (d, sf)
        involved = {d for d, lv in enumerate(src_levels) if lv} | {d for d, lv in enumerate(dst_levels) if lv}
        self.scratch = [d for d in range(self.T) if d not in involved]
        self.scratch_set = set(self.scratch)
        # Push targets per mesh dim: (tensor dim, split factor); plain shards anywhere, the target's
        # strided level where the target has it.
        self.targets = []
        for m in range(self.M):
            t = [(d, 1) for d in range(self.T)]
            if m in self.dst_where and self.dst_where[m][1] != 1:
                t.append(self.dst_where[m])
            self.targets.append(t)
        self._build_heuristic()

    # ---- heuristic -------------------------------------------------------------------------
    def _build_heuristic(self):
        K = math.prod(self.k)
        g = self.g
        self.lb = []
        for m in range(self.M):
            n_sh = g / K  # smallest local size while m itself is sharded
            n_un = g * self.k[m] / K  # ... while m is not sharded
            ag = self.lat[ALL_GATHER, m] + self.fac[ALL_GATHER, m] * n_sh
            a2a = self.lat[ALL_TO_ALL, m] + self.fac[ALL_TO_ALL, m] * n_sh
            ar = self.lat[ALL_REDUCE, m] + self.fac[ALL_REDUCE, m] * n_un
            rs = self.lat[REDUCE_SCATTER, m] + self.fac[REDUCE_SCATTER, m] * n_un
            dst = self.dst_where.get(m)
            dst_p = bool(self.dst_pmask >> m & 1)
            to_r = min(ar, rs + ag)
            lb_pb = 0.0 if dst_p else (min(rs, ar) if dst is not None else to_r)
            lb_pa = min(rs, ar) if dst is not None else to_r
            self.lb.append({"R": 0.0, "Pa": lb_pa, "Pb": lb_pb, "S": (dst, min(a2a, ag), ag)})

    def lb_shard(self, m, d, sf):
        dst, move, ag = self.lb[m]["S"]
        if dst is None:
            return ag
        return 0.0 if dst == (d, sf) else move

    def heuristic(self, stacks, pa, pb):
        h = 0.0
        for d, st in enumerate(stacks):
            for m, sf in st:
                h += self.lb_shard(m, d, sf)
        for m in range(self.M):
            if pa >> m & 1:
                h += self.lb[m]["Pa"]
            elif pb >> m & 1:
                h += self.lb[m]["Pb"]
        return h


def solve(problem: Problem):
    """Return (cost, [Move, ...], [state, ...]) of a min-cost path; raises if none exists."""
    P = problem
    k = P.k
    start = (P.src_levels, P.start_pa, P.start_pb)
    goal = (P.dst_levels, 0, P.dst_pmask)
    if start == goal:
        return 0.0, [], [start]
    lat, fac = P.lat, P.fac
    scratch, scratch_set = P.scratch, P.scratch_set
    g_bytes = P.g
    start_shards = 1
    for st in P.src_levels:
        for m, _ in st:
            start_shards *= k[m]
    h0 = P.heuristic(*start)
    best = {start: 0.0}
    parent = {start: None}
    counter = 0
    heap = [(h0, 0, counter, 0.0, start, start_shards, h0)]
    M, T = P.M, P.T
    dst_pmask, mix_ok = P.dst_pmask, P.mix_ok
    lb, lb_shard, targets = P.lb, P.lb_shard, P.targets
    while heap:
        f, neg_depth, _, gcost, state, shards, h = heapq.heappop(heap)
        if gcost > best[state]:
            continue
        if state == goal:
            return _unwind(parent, state, gcost)
        stacks, pa, pb = state
        n = g_bytes / shards
        used = 0  # mesh dims that are sharded or partial
        for st in stacks:
            for m, _ in st:
                used |= 1 << m
        used |= pa | pb
        first_empty_scratch = next((d for d in scratch if not stacks[d]), None)

        def push(new_state, step_cost, new_shards, dh, move):
            nonlocal counter
            ng = gcost + step_cost
            if ng < best.get(new_state, math.inf) - 1e-12:
                best[new_state] = ng
                parent[new_state] = (state, move, step_cost)
                counter += 1
                nh = h + dh
                heapq.heappush(heap, (ng + nh, neg_depth - 1, counter, ng, new_state, new_shards, nh))

        for d in range(T):
            st = stacks[d]
            if not st:
                continue
            m, sf = st[-1]
            popped = stacks[:d] + (st[:-1],) + stacks[d + 1:]
            old_lb = lb_shard(m, d, sf)
            # S -> R: all-gather
            push((popped, pa, pb), lat[ALL_GATHER, m] + fac[ALL_GATHER, m] * n, shards // k[m],
                 -old_lb, Move(AG, m, d, None))
            # S -> S': all-to-all onto another tensor dim (or the same dim with another split factor)
            for d2, sf2 in targets[m]:
                if (d2, sf2) == (d, sf):
                    continue
                if d2 in scratch_set and d2 != first_empty_scratch and not stacks[d2]:
                    continue
                st2 = popped[d2] + ((m, sf2),)
                ns = popped[:d2] + (st2,) + popped[d2 + 1:]
                push((ns, pa, pb), lat[ALL_TO_ALL, m] + fac[ALL_TO_ALL, m] * n, shards,
                     lb_shard(m, d2, sf2) - old_lb, Move(A2A, m, d, d2, sf2))
        for m in range(M):
            bit = 1 << m
            if used & bit:
                if (pa | pb) & bit:
                    is_a = bool(pa & bit)
                    old_lb = lb[m]["Pa" if is_a else "Pb"]
                    npa, npb = (pa & ~bit, pb) if is_a else (pa, pb & ~bit)
                    # P -> R: all-reduce
                    push((stacks, npa, npb), lat[ALL_REDUCE, m] + fac[ALL_REDUCE, m] * n, shards,
                         -old_lb, Move(AR, m, None, None))
                    # P -> S: reduce-scatter
                    rs_cost = lat[REDUCE_SCATTER, m] + fac[REDUCE_SCATTER, m] * n
                    for d2, sf2 in targets[m]:
                        if d2 in scratch_set and d2 != first_empty_scratch and not stacks[d2]:
                            continue
                        ns = stacks[:d2] + (stacks[d2] + ((m, sf2),),) + stacks[d2 + 1:]
                        push((ns, npa, npb), rs_cost, shards * k[m], lb_shard(m, d2, sf2) - old_lb,
                             Move(RS, m, None, d2, sf2))
                continue
            # R -> S: free local slice
            for d2, sf2 in targets[m]:
                if d2 in scratch_set and d2 != first_empty_scratch and not stacks[d2]:
                    continue
                ns = stacks[:d2] + (stacks[d2] + ((m, sf2),),) + stacks[d2 + 1:]
                push((ns, pa, pb), 0.0, shards * k[m], lb_shard(m, d2, sf2), Move(SHARD, m, None, d2, sf2))
            # R -> P: free, only where the target is partial
            if dst_pmask & bit and (mix_ok or not pa):
                push((stacks, pa, pb | bit), 0.0, shards, lb[m]["Pb"], Move(MAKE_PARTIAL, m, None, None))
    raise ValueError("no redistribution path exists")  # unreachable for valid specs


def _unwind(parent, state, total):
    moves, costs, states = [], [], [state]
    while parent[state] is not None:
        prev, move, c = parent[state]
        moves.append(move)
        costs.append(c)
        states.append(prev)
        state = prev
    moves.reverse()
    costs.reverse()
    states.reverse()
    return total, list(zip(moves, costs)), states
