"""The search space of a redistribution: states, moves, costs and the heuristic's bounds.

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
empty one is ever pushed onto, which removes symmetric duplicates without losing any cost (under
even_only, the first of each extent: evenness tells dims of different extents apart).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..core.cost import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    REDUCE_SCATTER,
    CostModelLike,
    planner_tables,
)
from ..core.spec import Levels

# Move kinds (also the executor's step kinds).
AG, A2A, SHARD, MAKE_PARTIAL, AR, RS = (
    "all_gather",
    "all_to_all",
    "shard",
    "partial",
    "all_reduce",
    "reduce_scatter",
)
LINEAR_OPS = ("sum", "avg")


class Move(NamedTuple):
    kind: str
    # a tuple for a fused move: the levels' mesh dims, innermost last
    mesh_dim: int | tuple[int, ...]
    src_dim: int | None  # tensor dim the level leaves (AG, A2A)
    dst_dim: int | None  # tensor dim the level joins (A2A, SHARD, RS)
    sf: int = 1  # split factor of the level that joins

    @property
    def fused(self) -> bool:
        return isinstance(self.mesh_dim, tuple)

    @property
    def mesh_dims(self) -> tuple[int, ...]:
        return self.mesh_dim if self.fused else (self.mesh_dim,)


def _is_cost_model(cm) -> bool:
    """A CostModel whose cost formulas are CostModel's own (a subclass may change only figures)."""
    from ..core.cost import CostModel

    t = type(cm)
    return isinstance(cm, CostModel) and all(
        getattr(t, f) is getattr(CostModel, f)
        for f in ("collective", "group", "latency", "byte_factor")
    )


class _Tables:
    """Per (cost model, fuse) figures every plan on that mesh reads: built once, not per plan."""

    def __init__(self, cost_model, fuse):
        self.lat, self.fac = planner_tables(cost_model)
        M = cost_model.mesh.ndim
        self.base_share = 0.0
        # The fused bounds rest on CostModel's formulas (a flattened group pays the base latency
        # once, at least its dims' hops added up, at its worst link).  Another cost model says
        # nothing about its fused costs, so fused plans on it are searched without a bound (plain
        # Dijkstra).
        self.bounded = not fuse or _is_cost_model(cost_model)
        if fuse and self.bounded:
            self.base_share = min(
                cost_model.base_latency_us,
                min((v for v in self.lat.values() if v > 0), default=0.0),
            )
            self.lat_lb = {key: max(0.0, v - self.base_share) for key, v in self.lat.items()}
        else:
            self.lat_lb = self.lat
        lat, fac = self.lat, self.fac
        self.K = math.prod(cost_model.mesh.shape)
        self.ag_l = [lat[ALL_GATHER, m] for m in range(M)]
        self.ag_f = [fac[ALL_GATHER, m] for m in range(M)]
        self.a2_l = [lat[ALL_TO_ALL, m] for m in range(M)]
        self.a2_f = [fac[ALL_TO_ALL, m] for m in range(M)]
        self.ar_l = [lat[ALL_REDUCE, m] for m in range(M)]
        self.ar_f = [fac[ALL_REDUCE, m] for m in range(M)]
        self.rs_l = [lat[REDUCE_SCATTER, m] for m in range(M)]
        self.rs_f = [fac[REDUCE_SCATTER, m] for m in range(M)]
        # latencies in the heuristic's bounds (fused: less the shared base latency)
        lb = self.lat_lb
        self.ag_lb = [lb[ALL_GATHER, m] for m in range(M)]
        self.a2_lb = [lb[ALL_TO_ALL, m] for m in range(M)]
        self.ar_lb = [lb[ALL_REDUCE, m] for m in range(M)]
        self.rs_lb = [lb[REDUCE_SCATTER, m] for m in range(M)]


_TABLES: dict = {}


def _tables(cost_model, fuse) -> _Tables:
    key = (id(cost_model), fuse)
    hit = _TABLES.get(key)
    if hit is None or hit[0] is not cost_model:  # keyed by identity; the model object is kept alive
        if len(_TABLES) > 64:
            _TABLES.clear()
        hit = _TABLES[key] = (cost_model, _Tables(cost_model, fuse))
    return hit[1]


def _gather_table(M, k, fac, lat, base, cand) -> list[float]:
    """The gather bound for every mask of sharded mesh dims (bits outside ``cand`` are ignored):
    the cheapest order to gather the cand dims sharded now, plus any extra cand dims pushed first if
    that lowers it; a gather of x_i runs at >= ``base`` / (prod k of the cand dims gathered after
    it)."""
    size = 1 << M
    total = [0.0] * size
    prod = [1] * size
    y = 0
    while True:  # the subsets of cand, each after its own subsets
        y = (y - cand) & cand
        if not y:
            break
        low = y & -y
        prod[y] = prod[y ^ low] * k[low.bit_length() - 1]
        n = base / prod[y]
        best = math.inf
        x = y
        while x:
            b = x & -x
            i = b.bit_length() - 1
            t = fac[i] * n + lat[i] + total[y ^ b]
            if t < best:
                best = t
            x ^= b
        total[y] = best
    x = cand
    while x:  # min over supersets: optional extra gathers may lower the bound
        b = x & -x
        x ^= b
        y = 0
        while True:
            y = (y - cand) & cand
            if not y & b and total[y | b] < total[y]:
                total[y] = total[y | b]
            if not y:
                break
    if cand == size - 1:
        return total
    return [total[m & cand] for m in range(size)]


class Problem:
    """Everything the search needs, precomputed once per plan."""

    def __init__(
        self,
        cost_model: CostModelLike,
        mesh_shape: tuple[int, ...],
        src_levels: Levels,
        dst_levels: Levels,
        src_partial: dict,
        dst_partial: dict,
        global_bytes: float,
        shape: tuple[int, ...] | None = None,
        even_only: bool = False,
        fuse: bool = False,
    ):
        self.k = mesh_shape
        self.M = len(mesh_shape)
        self.T = len(src_levels)
        # even_only: never pass through a state whose shards are uneven (traced, rank-agnostic
        # programs need every rank to have the same local shape at every step)
        self.shape = shape
        self.even_only = even_only
        # fuse: also consider one collective over several mesh dims (a flattened group, one base
        # latency).  The per-dim bounds then leave the base latency out and it is added once.
        self.fuse = fuse
        self.cost_model = cost_model
        self.src_levels = src_levels
        self.dst_levels = dst_levels
        self.g = float(global_bytes)
        # Partial mesh dims, each with its own reduce op.  Mask b: partial as the target wants it
        # (same dim, same op); mask a: partial in a way that must be reduced away.
        self.src_ops, self.dst_ops = dict(src_partial), dict(dst_partial)
        self.dst_pmask = sum(1 << m for m in dst_partial)
        self.start_pa = sum(1 << m for m, op in src_partial.items() if dst_partial.get(m) != op)
        self.start_pb = sum(1 << m for m, op in src_partial.items() if dst_partial.get(m) == op)
        tab = _tables(cost_model, fuse)
        self.tab = tab
        self.base_share = tab.base_share
        strided = self._targets()
        self._partial_bounds()
        self._level_bounds(strided)
        self._gather_bound()
        if not tab.bounded:
            self.drop_bounds()

    def _targets(self) -> bool:
        """Where the target puts each mesh dim, and the scratch dims; whether any level is
        strided."""
        T, shape, dst_levels, src_levels = self.T, self.shape, self.dst_levels, self.src_levels
        # dst location of each mesh dim
        self.dst_where = dst_where = {}
        self.tpos = tpos = {}  # mesh dim -> (tensor dim, place) in the target
        involved = set()
        strided = False
        for d, lv in enumerate(dst_levels):
            if lv:
                involved.add(d)
                for p, (m, sf) in enumerate(lv):
                    dst_where[m] = (d, sf)
                    tpos[m] = (d, p)
                    strided = strided or sf != 1
        for d, lv in enumerate(src_levels):
            if lv:
                involved.add(d)
                for _m, sf in lv:
                    strided = strided or sf != 1
        # Tensor dims neither end shards are interchangeable scratch space: only the first empty one
        # is pushed onto.  Under even_only only dims of one extent are alike (evenness differs).
        self.scratch = [d for d in range(T) if d not in involved]
        self.scratch_set = set(self.scratch)
        groups: dict = {}
        for d in self.scratch:
            groups.setdefault(shape[d] if self.even_only else None, []).append(d)
        self.scratch_groups = list(groups.values())
        return strided

    def _partial_bounds(self) -> None:
        """Bounds for partial dims: one to reduce away (lb_pa) or kept partial (lb_pb) each, and the
        cheapest order to reduce a set of them (red)."""
        tab, M, k, g = self.tab, self.M, self.k, self.g
        # per mesh dim: bound for a level that must move (lvl_lb, 0 for levels the target does not
        # shard: their gathers are in the gather bound), for a partial dim that must be reduced away
        # (lb_pa) and for one the target keeps partial in the same way (lb_pb)
        self.lvl_lb, self.lb_pa, self.lb_pb = [0.0] * M, [0.0] * M, [0.0] * M
        lb_pa, lb_pb = self.lb_pa, self.lb_pb
        dst_pmask = self.dst_pmask
        n_sh = g / tab.K  # smallest local size while m itself is sharded
        ar_lb, ar_f, rs_lb, rs_f = tab.ar_lb, tab.ar_f, tab.rs_lb, tab.rs_f
        for m in range(M):
            n_un = n_sh * k[m]  # ... while m is not sharded
            # A reduce-scatter towards a replicated target leaves a level that must be gathered;
            # that gather is counted by the gather bound, so here only min(ar, rs) (consistency).
            ar = ar_lb[m] + ar_f[m] * n_un
            rs = rs_lb[m] + rs_f[m] * n_un
            lb_pa[m] = to_r = ar if ar < rs else rs
            if not dst_pmask >> m & 1:
                lb_pb[m] = to_r
        # red[y]: bound on reducing away the partial dims in mask y (reduce-away dims only get
        # fewer).  A partial dim shards nothing, so when the first of them is reduced all of y is
        # unsharded: min over orders, each reduce at size >= g * prod(k of the dims still partial) /
        # K. Consistent: a reduce of x from y costs at least the ordering's term for x put first.  A
        # fused reduce of several dims costs no less than reducing them one after the other in this
        # model (its hops are at least their hops added up, its bandwidth the same at the same
        # sizes, at the worst link), and the latencies here leave out the base latency under fusion.
        self.red = red = [0.0] * (1 << M)
        pa0 = self.start_pa
        y = 0
        while True:  # the subsets of pa0, each after its own subsets
            y = (y - pa0) & pa0
            if not y:
                break
            n = n_sh
            x = y
            while x:
                b = x & -x
                n *= k[b.bit_length() - 1]
                x ^= b
            best = math.inf
            x = y
            while x:
                b = x & -x
                i = b.bit_length() - 1
                ar = ar_lb[i] + ar_f[i] * n
                rs = rs_lb[i] + rs_f[i] * n
                t = (ar if ar < rs else rs) + red[y ^ b]
                if t < best:
                    best = t
                x ^= b
            red[y] = best

    def _level_bounds(self, strided: bool) -> None:
        """Per mesh dim: the bound of a level that must move once, or twice (and where it must)."""
        tab, M, T, dst_levels, dst_where = self.tab, self.M, self.T, self.dst_levels, self.dst_where
        fuse = self.fuse
        lvl_lb, n_sh = self.lvl_lb, self.g / tab.K
        ag_lb, ag_f, a2_lb, a2_f = tab.ag_lb, tab.ag_f, tab.a2_lb, tab.a2_f
        # Levels that must move at least twice (see level_lb): gathered (then pushed back for free)
        # or moved away and back by two all-to-alls, so min(ag, 2 a2a).  Plain shards only: a
        # strided level can change place on its own dim in one step.  With fusion, only a level on
        # its own target dim (it must leave and come back whatever carries it; the base latency is
        # counted once anyway): a fused all-to-all can carry a block of levels, in order, into place
        # at once.
        self.own_lb = own_lb = not strided and bool(dst_where)
        self.order_lb = order_lb = own_lb and not fuse
        self.two = two = [0.0] * M
        self.blk = blk = [0] * M  # mesh dims that, under m on another dim, make m move twice
        for lv in dst_levels:
            below = 0
            for m, _sf in lv:
                # with fusion one all-to-all can move several levels for less than their separate
                # bandwidth bounds add up to, so the bound keeps only its latency
                ag = ag_lb[m] + ag_f[m] * n_sh
                a2a = a2_lb[m] + (0.0 if fuse else a2_f[m] * n_sh)
                lvl_lb[m] = a2a if a2a < ag else ag
                two[m] = ag if ag < 2 * a2a else 2 * a2a
                if order_lb:
                    blk[m] = below
                    below |= 1 << m
        # per tensor dim: on its own target dim, a level takes two moves
        if own_lb:
            self.lb_at = lb_at = [lvl_lb] * T
            for d, lv in enumerate(dst_levels):
                if lv:
                    lb_at[d] = row = list(lvl_lb)
                    for m, _sf in lv:
                        row[m] = two[m]
        else:
            self.lb_at = [lvl_lb] * T
            self.two = lvl_lb

    def _gather_bound(self) -> None:
        """The gather bound of every set of sharded mesh dims the target does not shard."""
        M, k, g, dst_where, tab = self.M, self.k, self.g, self.dst_where, self.tab
        ag_lb, ag_f = tab.ag_lb, tab.ag_f
        # Gather bound.  Mesh dims not sharded by the target ("cand") must be gathered after their
        # last push; when the last gather of x_i runs, only dims the target shards and cand dims
        # gathered later can still shard the tensor, so its input is >= g / (K_S * prod k_{x_j>=i}).
        # Minimised over orderings and over optional extra cand dims, per set of cand dims that are
        # sharded now.  Consistent: a gather of m costs at least the bound's term for m put first.
        K_S = 1
        cand = (1 << M) - 1
        for m in dst_where:
            K_S *= k[m]
            cand -= 1 << m
        self.cand_mask = cand
        self.glb = _gather_table(M, k, ag_f, ag_lb, g / K_S, cand) if cand else [0.0] * (1 << M)

    def drop_bounds(self):
        """A zero heuristic (the search is then Dijkstra)."""
        M, T = self.M, self.T
        self.lvl_lb, self.lb_pa, self.lb_pb, self.red = (
            [0.0] * M,
            [0.0] * M,
            [0.0] * M,
            [0.0] * (1 << M),
        )
        self.two = self.lvl_lb
        self.order_lb = self.own_lb = False
        self.lb_at, self.blk = [self.lvl_lb] * T, [0] * M
        self.cand_mask, self.glb = 0, [0.0] * (1 << M)
        self.base_share = 0.0

    def level_lb(self, d: int, below: tuple, m: int) -> float:
        """Bound for level ``m`` on tensor dim ``d`` with ``below`` under it, when the stack up to m
        is not a prefix of the target's (0 for levels the target does not shard: the gather bound
        has them).  It must move at least twice when
          * d is its own target dim: it has to leave and come back;
          * a level below it has the same target dim and a lower place there: that level must be in
            place before m arrives, and cannot leave before m has left, so m's first move is not its
            last (not under fusion: a fused all-to-all carries both, in order, at once).
        Consistent: the condition holds until m itself moves (the levels below it cannot move before
        it); leaving by all-to-all trades min(ag, 2 a2a) for a term >= 0 that is at least
        min(ag, a2a) where it lands, at a cost >= a2a; leaving by gather costs >= ag; arriving
        (push, all-to-all or reduce-scatter) only raises the term."""
        if not self.own_lb:
            return self.lvl_lb[m]
        w = self.tpos.get(m)
        if w is None:
            return 0.0
        td, tp = w
        if td == d:
            return self.two[m]
        if not self.order_lb:
            return self.lvl_lb[m]
        tpos = self.tpos
        for x, _ in below:
            wx = tpos.get(x)
            if wx is not None and wx[0] == td and wx[1] < tp:
                return self.two[m]
        return self.lvl_lb[m]

    def stack_lb(self, d: int, st: tuple) -> float:
        """Sum of level bounds of one stack: levels above the common prefix with the target all
        have to move."""
        tgt = self.dst_levels[d]
        h = 0.0
        ok = True
        for p, (m, sf) in enumerate(st):
            ok = ok and p < len(tgt) and tgt[p] == (m, sf)
            if not ok:
                h += self.level_lb(d, st[:p], m)
        return h

    def heuristic(self, stacks: Levels, pa: int, pb: int) -> float:
        h = self.glb[sum(1 << m for st in stacks for m, _ in st)]
        for d, st in enumerate(stacks):
            h += self.stack_lb(d, st)
        h += self.red[pa]
        for m in range(self.M):
            if pb >> m & 1 and not pa >> m & 1:
                h += self.lb_pb[m]
        return h


_PLAIN_CODES: dict = {}


def _codes(P: Problem):
    """(code of each level, level of each code, push targets per mesh dim as (tensor dim, split
    factor, code)).  Plain shards code as mesh dim + 1; strided levels of the source or target get
    the next codes.  The plain tables depend only on (mesh ndim, tensor ndim) and are shared."""
    M, T = P.M, P.T
    strided = [lev for lv in (*P.src_levels, *P.dst_levels) for lev in lv if lev[1] != 1]
    if not strided:
        hit = _PLAIN_CODES.get((M, T))
        if hit is None:
            levels = [(m, 1) for m in range(M)]
            code = {lev: i + 1 for i, lev in enumerate(levels)}
            tcodes = [[(d, 1, m + 1) for d in range(T)] for m in range(M)]
            hit = _PLAIN_CODES[M, T] = (code, [None] + levels, tcodes)
        return hit
    levels = [(m, 1) for m in range(M)]
    for lev in strided:
        if lev not in levels:
            levels.append(lev)
    code = {lev: i + 1 for i, lev in enumerate(levels)}
    # push targets: plain shards anywhere, the target's strided level where the target has it
    tcodes = []
    for m in range(M):
        t = [(d, 1, m + 1) for d in range(T)]
        where = P.dst_where.get(m)
        if where is not None and where[1] != 1:
            t.append((*where, code[(m, where[1])]))
        tcodes.append(t)
    return code, [None] + levels, tcodes


_SMASKS: dict = {}


def _stack_masks(M: int) -> list[int]:
    """Mask of the mesh dims in every plain stack value (digits base M + 1, see ``solve``), shared
    per mesh ndim."""
    hit = _SMASKS.get(M)
    if hit is None:
        B = M + 1
        hit = [0] * B**M
        for v in range(1, B**M):
            c = v % B
            hit[v] = hit[v // B] | (1 << c - 1) if c else 0
        _SMASKS[M] = hit
    return hit


def _layout(B: int, M: int, T: int) -> tuple[int, int, int]:
    """Bit layout of a packed state: (bits per stack field, shift of the reduce-away mask, shift of
    the keep-partial mask).  A stack holds at most M levels, so its digits base B fit in the
    field."""
    W = max(1, (B**M - 1).bit_length())
    return W, W * T, W * T + M
