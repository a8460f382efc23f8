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
empty one is ever pushed onto, which removes symmetric duplicates without losing any cost (under
even_only, the first of each extent: evenness tells dims of different extents apart).
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import NamedTuple

from ..cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER, planner_tables

# Move kinds (also the executor's step kinds).
AG, A2A, SHARD, MAKE_PARTIAL, AR, RS = "all_gather", "all_to_all", "shard", "partial", "all_reduce", "reduce_scatter"
LINEAR_OPS = ("sum", "avg")


class Move(NamedTuple):
    kind: str
    mesh_dim: int | tuple[int, ...]  # a tuple for a fused move: the levels' mesh dims, innermost last
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
    from ..cost import CostModel

    t = type(cm)
    return isinstance(cm, CostModel) and all(getattr(t, f) is getattr(CostModel, f)
                                             for f in ("collective", "group", "latency", "byte_factor"))


class _Tables:
    """Per (cost model, fuse) figures every plan on that mesh reads: built once, not per plan."""

    def __init__(self, cost_model, fuse):
        self.lat, self.fac = planner_tables(cost_model)
        M = cost_model.mesh.ndim
        self.base_share = 0.0
        # The fused bounds rest on CostModel's formulas (a flattened group pays the base latency once,
        # at least its dims' hops added up, at its worst link).  Another cost model says nothing about
        # its fused costs, so fused plans on it are searched without a bound (plain Dijkstra).
        self.bounded = not fuse or _is_cost_model(cost_model)
        if fuse and self.bounded:
            self.base_share = min(cost_model.base_latency_us,
                                  min((v for v in self.lat.values() if v > 0), default=0.0))
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
        lb = self.lat_lb  # latencies in the heuristic's bounds (fused: less the shared base latency)
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
    that lowers it; a gather of x_i runs at >= ``base`` / (prod k of the cand dims gathered after it)."""
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

    def __init__(self, cost_model, mesh_shape, src_levels, dst_levels, src_partial: dict, dst_partial: dict,
                 global_bytes, shape=None, even_only=False, fuse=False):
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
        T = self.T
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
            groups.setdefault(shape[d] if even_only else None, []).append(d)
        self.scratch_groups = list(groups.values())

        # ---- heuristic ----
        M, k = self.M, mesh_shape
        g = self.g
        # per mesh dim: bound for a level that must move (lvl_lb, 0 for levels the target does not
        # shard: their gathers are in the gather bound), for a partial dim that must be reduced away
        # (lb_pa) and for one the target keeps partial in the same way (lb_pb)
        self.lvl_lb, self.lb_pa, self.lb_pb = lvl_lb, lb_pa, lb_pb = [0.0] * M, [0.0] * M, [0.0] * M
        dst_pmask = self.dst_pmask
        n_sh = g / tab.K  # smallest local size while m itself is sharded
        ag_lb, ag_f, a2_lb, a2_f = tab.ag_lb, tab.ag_f, tab.a2_lb, tab.a2_f
        ar_lb, ar_f, rs_lb, rs_f = tab.ar_lb, tab.ar_f, tab.rs_lb, tab.rs_f
        for m in range(M):
            n_un = n_sh * k[m]  # ... while m is not sharded
            # A reduce-scatter towards a replicated target leaves a level that must be gathered; that
            # gather is counted by the gather bound, so here only min(ar, rs) (consistency).
            ar = ar_lb[m] + ar_f[m] * n_un
            rs = rs_lb[m] + rs_f[m] * n_un
            lb_pa[m] = to_r = ar if ar < rs else rs
            if not dst_pmask >> m & 1:
                lb_pb[m] = to_r
        # red[y]: bound on reducing away the partial dims in mask y (reduce-away dims only get
        # fewer).  A partial dim shards nothing, so when the first of them is reduced all of y is
        # unsharded: min over orders, each reduce at size >= g * prod(k of the dims still partial) / K.
        # Consistent: a reduce of x from y costs at least the ordering's term for x put first.  A
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
        # Levels that must move at least twice (see level_lb): gathered (then pushed back for free)
        # or moved away and back by two all-to-alls, so min(ag, 2 a2a).  Plain shards only: a strided
        # level can change place on its own dim in one step.  With fusion, only a level on its own
        # target dim (it must leave and come back whatever carries it; the base latency is counted
        # once anyway): a fused all-to-all can carry a block of levels, in order, into place at once.
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
        if not tab.bounded:
            self.drop_bounds()

    def drop_bounds(self):
        """A zero heuristic (the search is then Dijkstra)."""
        M, T = self.M, self.T
        self.lvl_lb, self.lb_pa, self.lb_pb, self.red = [0.0] * M, [0.0] * M, [0.0] * M, [0.0] * (1 << M)
        self.two = self.lvl_lb
        self.order_lb = self.own_lb = False
        self.lb_at, self.blk = [self.lvl_lb] * T, [0] * M
        self.cand_mask, self.glb = 0, [0.0] * (1 << M)
        self.base_share = 0.0

    def level_lb(self, d, below, m):
        """Bound for level ``m`` on tensor dim ``d`` with ``below`` under it, when the stack up to m
        is not a prefix of the target's (0 for levels the target does not shard: the gather bound
        has them).  It must move at least twice when
          * d is its own target dim: it has to leave and come back;
          * a level below it has the same target dim and a lower place there: that level must be in
            place before m arrives, and cannot leave before m has left, so m's first move is not its
            last (not under fusion: a fused all-to-all carries both, in order, at once).
        Consistent: the condition holds until m itself moves (the levels below it cannot move before
        it); leaving by all-to-all trades min(ag, 2 a2a) for a term >= 0 that is at least
        min(ag, a2a) where it lands, at a cost >= a2a; leaving by gather costs >= ag; arriving (push,
        all-to-all or reduce-scatter) only raises the term."""
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

    def stack_lb(self, d, st):
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

    def heuristic(self, stacks, pa, pb):
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
        hit = [0] * B ** M
        for v in range(1, B ** M):
            c = v % B
            hit[v] = hit[v // B] | (1 << c - 1) if c else 0
        _SMASKS[M] = hit
    return hit


def _layout(B: int, M: int, T: int) -> tuple[int, int, int]:
    """Bit layout of a packed state: (bits per stack field, shift of the reduce-away mask, shift of
    the keep-partial mask).  A stack holds at most M levels, so its digits base B fit in the field."""
    W = max(1, (B ** M - 1).bit_length())
    return W, W * T, W * T + M


def solve(problem: Problem, exhaust: frozenset | None = None, graph: dict | None = None):
    """Return (cost, [(Move, cost), ...], [state, ...]) of a min-cost path.

    ``exhaust``: instead, the min cost from the source to every reachable state (a Dijkstra run over
    the same moves, for ``distances``); its members are the target shard stacks at which a
    replicated dim may be made partial.  ``graph`` (with ``exhaust``): filled with every expanded
    state's moves, ``{state: [(state, cost), ...]}`` in the packed form ``state_key`` gives, for
    ``pairwise_costs``; states already in it (from an earlier run over the same moves, which
    recorded everything reachable from them too) are not expanded again, so the costs returned are
    complete only for a fresh graph.

    A state is packed into one int: per tensor dim a field holding its stack of levels as digits
    (the innermost level in the lowest digit; 0 is empty), then the mask of partial dims to reduce
    away and the mask of partial dims the target keeps.  A move is then a few additions and shifts,
    and hashing a small int is what makes the search cheap."""
    P = problem
    k = P.k
    start_t = (P.src_levels, P.start_pa, P.start_pb)
    goal_t = (P.dst_levels, 0, P.dst_pmask)
    if start_t == goal_t and exhaust is None:
        return 0.0, [], [start_t]
    M, T = P.M, P.T
    code, decode, tcodes = _codes(P)
    B = len(decode)
    W, PA, PB = _layout(B, M, T)
    wmask = (1 << W) - 1
    mmask = (1 << M) - 1
    stack_bits = (1 << PA) - 1
    shift = [W * d for d in range(T)]

    def enc(st):
        v = 0
        for lev in st:
            v = v * B + code[lev]
        return v

    def pack(stacks, pa, pb):
        x = pa << PA | pb << PB
        for d, st in enumerate(stacks):
            x |= enc(st) << shift[d]
        return x

    dec_memo: dict = {}

    def dec(v):
        st = dec_memo.get(v)
        if st is None:
            out, x = [], v
            while x:
                out.append(decode[x % B])
                x //= B
            st = dec_memo[v] = tuple(reversed(out))
        return st

    def unpack(x):
        return tuple(dec(x >> shift[d] & wmask) for d in range(T)), x >> PA & mmask, x >> PB

    prefix_ok = []
    for st in P.dst_levels:
        ok, v = {0}, 0
        for lev in st:
            v = v * B + code[lev]
            ok.add(v)
        prefix_ok.append(ok)
    scratch_groups, scratch_set = P.scratch_groups, P.scratch_set
    g_bytes = P.g
    dst_pmask = P.dst_pmask
    even_only, shape = P.even_only, P.shape

    fits_memo: dict = {}

    def fits(d, v):  # every level of the stack splits its extent exactly
        ok = fits_memo.get((d, v))
        if ok is None:
            e, ok = shape[d], True
            for mm, sff in dec(v):
                if e % (k[mm] * sff):
                    ok = False
                    break
                e //= k[mm]
            fits_memo[(d, v)] = ok
        return ok

    red, lb_pb = P.red, P.lb_pb
    # a level's bound above the target prefix (level_lb): lb_at[d][m], or two[m] where a level in the
    # stack under it (smask: its mesh dims) is one of blk[m]
    lb_at, two, blk = P.lb_at, P.two, P.blk
    smask = _stack_masks(M) if any(blk) else None
    cand_mask = P.cand_mask
    glb = P.glb
    tab = P.tab
    ag_l, ag_f, a2_l, a2_f = tab.ag_l, tab.ag_f, tab.a2_l, tab.a2_f
    ar_l, ar_f, rs_l, rs_f = tab.ar_l, tab.ar_f, tab.rs_l, tab.rs_f
    start_shards, start_mask = 1, 0
    for st in P.src_levels:
        for m, _ in st:
            start_shards *= k[m]
            start_mask |= 1 << m
    start = pack(P.src_levels, P.start_pa, P.start_pb)
    goal = pack(P.dst_levels, 0, P.dst_pmask)
    goal_stacks = goal & stack_bits
    h0 = P.heuristic(*start_t)
    best = {start: 0.0}
    parent = {}  # state -> (previous state, move, its cost), written when the state is expanded
    # With fusion the per-dim bounds leave the base latency out and add it once while anything is
    # left to do; "anything" is h above rounding (h is kept up by adding differences)
    bshare = P.base_share
    h_eps = 1e-9 * (1.0 + h0)
    # (f, -depth, g, state, shards, sharded mesh dims, h, previous state, move, move cost): ties on f
    # go deepest first; two entries never tie on (f, depth, g, state) (a state is pushed again only
    # for a strictly lower g)
    heap = [(h0 + (bshare if h0 > h_eps else 0.0), 0, 0.0, start, start_shards, start_mask, h0, None, None, 0.0)]
    push_heap = heapq.heappush
    pop_heap = heapq.heappop
    inf = math.inf
    # A simple plan bounds the search (prune anything dearer) and is returned as soon as nothing on
    # the frontier can beat it.  The placing plan pays off where searches are large (3+ mesh dims).
    if exhaust is not None:
        ub, stop, goal = inf, inf, None
        exhaust = {pack(stacks, 0, 0) for stacks in exhaust}
    else:
        # the placing plan is the better one but where reducing first pays (measured: direct won
        # only with partial dims to reduce, 5 of 197 cases on 3-5-D meshes)
        inc_cost = inf
        if M >= 3:
            inc_cost, inc_moves = placing_plan(P)
        if M < 3 or P.start_pa or inc_cost == inf:
            c, mv = direct_plan(P)
            if c < inc_cost:
                inc_cost, inc_moves = c, mv
        if even_only and not all(_fits(P, d, st) for lv in (P.src_levels, P.dst_levels) for d, st in enumerate(lv)):
            inc_cost = inf  # the simple plans pass only prefixes of these stacks: even only if both ends are
        # a frontier f this high: the incumbent is optimal (to rounding), so nothing that high is
        # pushed either
        ub = stop = inc_cost * (1 - 1e-12)
        if inc_cost < inf:
            h_eps += 1e-9 * inc_cost

    if graph is not None and B != M + 1:
        raise ValueError("solve(graph=...) takes plain shards only (no strided levels)")
    fuse = P.fuse
    # neighbours no cheaper than their best known cost are dropped before any tuple is built (the
    # push loop checks again); the exhaustive run records every move for ``graph``
    seen = best.get if graph is None else {}.get
    if fuse:
        fused_moves = _fused_move_generator(P, B, shift, dec, fits, glb, seen)
    while heap:
        _f, depth, gcost, state, shards, sharded, h, prev, pmove, pcost = pop_heap(heap)
        if gcost > best[state]:
            continue
        if graph is not None and state in graph:
            # recorded by an earlier run over the same moves, with everything reachable from it
            # (exhaustive runs prune nothing): only the graph is wanted, so nothing to add
            continue
        if _f >= stop:  # nothing left beats the incumbent (a goal this dear included)
            break
        parent[state] = (prev, pmove, pcost)
        if state == goal:
            return _unwind(parent, state, gcost, unpack)
        pa = state >> PA & mmask
        pb = state >> PB
        n = g_bytes / shards
        used = sharded | pa | pb
        mand = sharded & cand_mask
        h_ag = glb[mand]
        vals = [state >> sd & wmask for sd in shift]  # each tensor dim's stack
        empty_ok = 0  # the empty scratch dims that may be pushed onto: the first of each group
        for grp in scratch_groups:
            for d in grp:
                if not vals[d]:
                    empty_ok |= 1 << d
                    break
        depth -= 1
        at_target = state & stack_bits == goal_stacks if exhaust is None else state & stack_bits in exhaust
        nbrs = []  # (new_state, step_cost, new_shards, new_mask, dh, move)
        base_f = gcost + h
        for d in range(T):
            v = vals[d]
            if not v:
                continue
            c = v % B
            m, sf = decode[c]
            bit = 1 << m
            rest = v // B
            popped = state - (v - rest << shift[d])
            top_lb = 0.0 if v in prefix_ok[d] else two[m] if blk[m] and blk[m] & smask[rest] else lb_at[d][m]
            step_cost = ag_l[m] + ag_f[m] * n
            dh = glb[mand & ~bit] - h_ag - top_lb
            if base_f + step_cost + dh <= ub and gcost + step_cost + 1e-9 < seen(popped, inf):
                nbrs.append((popped, step_cost, shards // k[m], sharded & ~bit, dh, (AG, m, d, None, 1)))
            a2a_cost = a2_l[m] + a2_f[m] * n
            if base_f + a2a_cost - top_lb > ub:
                continue
            lim = gcost + a2a_cost + 1e-9
            for d2, sf2, c2 in tcodes[m]:
                if d2 == d:
                    if sf2 == sf:
                        continue
                    base = rest
                else:
                    base = vals[d2]
                    if not base and d2 in scratch_set and not empty_ok >> d2 & 1:
                        continue
                nv = base * B + c2
                if even_only and not fits(d2, nv):
                    continue
                new_lb = 0.0 if nv in prefix_ok[d2] else two[m] if blk[m] and blk[m] & smask[base] else lb_at[d2][m]
                if base_f + a2a_cost + new_lb - top_lb > ub:
                    continue
                ns = popped + (nv - base << shift[d2])
                if lim < seen(ns, inf):
                    nbrs.append((ns, a2a_cost, shards, sharded, new_lb - top_lb, (A2A, m, d, d2, sf2)))
        for m in range(M):
            bit = 1 << m
            if used & bit:
                if not (pa | pb) & bit:
                    continue
                if pa & bit:
                    old_lb, cleared = red[pa] - red[pa & ~bit], state & ~(bit << PA)
                else:
                    old_lb, cleared = lb_pb[m], state & ~(bit << PB)
                step_cost = ar_l[m] + ar_f[m] * n
                if base_f + step_cost - old_lb <= ub:
                    nbrs.append((cleared, step_cost, shards, sharded, -old_lb, (AR, m, None, None, 1)))
                step_cost, kind, base_dh = rs_l[m] + rs_f[m] * n, RS, -old_lb
            else:
                step_cost, kind, base_dh = 0.0, SHARD, 0.0
                cleared = state
                # Making a dim partial is free and changes no size, so it can always wait until
                # everything else is in place: only allow it there (never mixes reduce ops either).
                if dst_pmask & bit and at_target and not pa:
                    nbrs.append((state | bit << PB, 0.0, shards, sharded, lb_pb[m], (MAKE_PARTIAL, m, None, None, 1)))
            if cand_mask & bit:  # the new level will have to be gathered
                base_dh += glb[mand | bit] - h_ag
            if base_f + step_cost + base_dh > ub:
                continue
            lim = gcost + step_cost + 1e-9
            for d2, sf2, c2 in tcodes[m]:
                base = vals[d2]
                if not base and d2 in scratch_set and not empty_ok >> d2 & 1:
                    continue
                nv = base * B + c2
                if even_only and not fits(d2, nv):
                    continue
                new_lb = 0.0 if nv in prefix_ok[d2] else two[m] if blk[m] and blk[m] & smask[base] else lb_at[d2][m]
                if base_f + step_cost + base_dh + new_lb > ub:
                    continue
                ns = cleared + (nv - base << shift[d2])
                if lim < seen(ns, inf):
                    nbrs.append((ns, step_cost, shards * k[m], sharded | bit, base_dh + new_lb,
                                 (kind, m, None, d2, sf2)))
        # fused moves need two levels on one stack or two partial dims
        if fuse and (max(vals, default=0) >= B or (pa | pb) & ((pa | pb) - 1)):
            fused_moves(state, vals, pa, pb, gcost, base_f, ub, shards, sharded, mand, h_ag, empty_ok,
                        nbrs)
        if graph is not None:  # packed states: plain levels pack alike in every search (see state_key)
            graph[state] = [(x[0], x[1]) for x in nbrs]
        for new_state, step_cost, new_shards, new_mask, dh, move in nbrs:
            ng = gcost + step_cost
            nh = h + dh
            if new_state == goal:
                nh = 0.0
                if ng < ub:
                    ub = ng
            if ng < best.get(new_state, inf) - 1e-9:
                best[new_state] = ng
                push_heap(heap, (ng + nh + (bshare if nh > h_eps else 0.0), depth, ng, new_state, new_shards,
                                 new_mask, nh, state, move, step_cost))
    if exhaust is not None:  # states with nothing left to reduce
        out = {}
        for st, c in best.items():
            stacks, pa, pb = unpack(st)
            if not pa:
                out[stacks, pb] = c
        return out
    if exhaust is None and inc_cost < inf:  # everything else was dearer: the incumbent it is
        return inc_cost, [(Move._make(mv), c) for mv, c in inc_moves], replay(P, inc_moves)
    raise ValueError("no redistribution path exists")  # unreachable for valid specs


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


def _fused_move_generator(P: Problem, B: int, shift, dec, fits, glb, seen):
    """The moves of one collective over several mesh dims, on packed states: gather or all-to-all
    the innermost j >= 2 levels of a tensor dim (as a block, in order), all-reduce or reduce-scatter
    several partial dims of one reduce op (sum and avg mix) at once.  Returns a function that
    appends them to an expansion's neighbours, pruned as ``solve`` prunes single moves.  A fused
    collective's cost is the cost model's for the flattened group, memoised per (kind, dims, local
    size)."""
    k, T, M, cm = P.k, P.T, P.M, P.cost_model
    g_bytes, even_only = P.g, P.even_only
    scratch_set, cand_mask = P.scratch_set, P.cand_mask
    red, lb_pb, src_ops, dst_ops = P.red, P.lb_pb, P.src_ops, P.dst_ops
    PA, PB = _layout(B, M, T)[1:]
    powers = [B ** j for j in range(M + 1)]
    inf = math.inf
    tops: dict = {}
    slbs = [{} for _ in range(T)]
    costs: dict = {}

    def top_of(top):  # (strided?, mesh dims innermost last, sorted, their product, mask)
        t = tops.get(top)
        if t is None:
            levels = dec(top)
            dims = tuple(m for m, _ in levels)
            mask, prod = 0, 1
            for m in dims:
                mask |= 1 << m
                prod *= k[m]
            t = tops[top] = (any(sf != 1 for _, sf in levels), dims, tuple(sorted(dims)), prod, mask)
        return t

    def slb(d, v):  # stack bound of stack value v on tensor dim d
        x = slbs[d].get(v)
        if x is None:
            x = slbs[d][v] = P.stack_lb(d, dec(v))
        return x

    def cost(kind, dims, shards):
        c = costs.get((kind, dims, shards))
        if c is None:
            c = costs[kind, dims, shards] = cm.collective(kind, dims, g_bytes / shards)
        return c

    def moves(state, vals, pa, pb, gcost, base_f, ub, shards, sharded, mand, h_ag, empty_ok, out):
        for d in range(T):
            v = vals[d]
            if v < B:  # fewer than two levels
                continue
            removed_all = slb(d, v)
            for j in range(2, len(dec(v)) + 1):
                Bj = powers[j]
                top, rest = v % Bj, v // Bj
                strided, dims, sdims, prod, tmask = top_of(top)
                if strided:
                    break
                removed = removed_all - slb(d, rest)
                popped = state - ((v - rest) << shift[d])
                c = cost(ALL_GATHER, sdims, shards)
                dh = glb[mand & ~tmask] - h_ag - removed
                if base_f + c + dh <= ub and gcost + c + 1e-9 < seen(popped, inf):
                    out.append((popped, c, shards // prod, sharded & ~tmask, dh, (AG, dims, d, None, 1)))
                c = cost(ALL_TO_ALL, sdims, shards)
                if base_f + c - removed > ub:
                    continue
                for d2 in range(T):
                    if d2 == d:
                        continue
                    base = vals[d2]
                    if not base and d2 in scratch_set and not empty_ok >> d2 & 1:
                        continue
                    nv = base * Bj + top
                    if even_only and not fits(d2, nv):
                        continue
                    dh = slb(d2, nv) - slb(d2, base) - removed
                    ns = popped + ((nv - base) << shift[d2])
                    if base_f + c + dh <= ub and gcost + c + 1e-9 < seen(ns, inf):
                        out.append((ns, c, shards, sharded, dh, (A2A, dims, d, d2, 1)))
        pm = pa | pb
        if not pm & (pm - 1):  # fewer than two partial dims
            return
        dims_all = [m for m in range(M) if pm >> m & 1]
        for r in range(2, len(dims_all) + 1):
            Br = powers[r]
            for subset in itertools.combinations(dims_all, r):
                # a dim still to reduce holds the source's op; one kept or made partial, the target's
                ops = {src_ops[m] if pa >> m & 1 else dst_ops[m] for m in subset}
                if len(ops) > 1 and not ops <= _LINEAR:
                    continue  # one collective reduces with one op (sum and avg: sum, then scale)
                bits = 0
                prod = 1
                for m in subset:
                    bits |= 1 << m
                    prod *= k[m]
                old = red[pa] - red[pa & ~bits]
                for m in subset:
                    if pb >> m & 1:
                        old += lb_pb[m]
                cleared = state & ~(bits << PA) & ~(bits << PB)
                c = cost(ALL_REDUCE, subset, shards)
                if base_f + c - old <= ub and gcost + c + 1e-9 < seen(cleared, inf):
                    out.append((cleared, c, shards, sharded, -old, (AR, subset, None, None, 1)))
                c = cost(REDUCE_SCATTER, subset, shards)
                grown = glb[mand | (bits & cand_mask)] - h_ag - old
                if base_f + c + grown > ub:
                    continue
                for order in itertools.permutations(subset):
                    block = 0
                    for m in order:  # plain levels, the first of the order lowest
                        block = block * B + m + 1
                    for d2 in range(T):
                        base = vals[d2]
                        if not base and d2 in scratch_set and not empty_ok >> d2 & 1:
                            continue
                        nv = base * Br + block
                        if even_only and not fits(d2, nv):
                            continue
                        dh = grown + slb(d2, nv) - slb(d2, base)
                        ns = cleared + ((nv - base) << shift[d2])
                        if base_f + c + dh <= ub and gcost + c + 1e-9 < seen(ns, inf):
                            out.append((ns, c, shards * prod, sharded | bits, dh, (RS, order, None, d2, 1)))

    return moves


_LINEAR = frozenset(LINEAR_OPS)


def _fits(P, d, st):
    e = P.shape[d]
    for m, sf in st:
        if e % (P.k[m] * sf):
            return False
        e //= P.k[m]
    return True


def direct_plan(P: Problem) -> tuple[float, list]:
    """A simple valid plan, as an upper bound and incumbent: reduce what must be reduced
    (reduce-scatter where that extends the target's stack, else all-reduce), gather every level above
    the common prefix with the target, then shard (free) into the target's order and make dims
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
            if tuple(stacks[d]) + ((m, sf),) == tgt[d][:len(stacks[d]) + 1]:
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
        for m, sf in t[len(st):]:
            moves.append(((SHARD, m, None, d, sf), 0.0))
    for m in range(P.M):
        if P.dst_pmask >> m & 1 and not pb >> m & 1:
            moves.append(((MAKE_PARTIAL, m, None, None, 1), 0.0))


def replay(P: Problem, moves) -> list:
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


def state_key(levels, pa: int, pb: int, mesh_ndim: int) -> int:
    """A state packed as ``solve`` packs it when every level is a plain shard: per tensor dim its
    stack as digits base ``mesh_ndim + 1`` (mesh dim m is digit m + 1, innermost lowest) in a field
    of its own, then the two partial masks."""
    B = mesh_ndim + 1
    W, PA, PB = _layout(B, mesh_ndim, len(levels))
    x = pa << PA | pb << PB
    for d, st in enumerate(levels):
        v = 0
        for m, _ in st:
            v = v * B + m + 1
        x |= v << W * d
    return x


def distances(cost_model, mesh_shape, src_levels, src_partial: dict, target_stacks, target_pmask: int, ops: dict,
              global_bytes, shape, even_only=False, fuse=False, graph: dict | None = None) -> dict:
    """Min cost from one source to every reachable state, over exactly the moves ``solve`` uses:
    ``{(shard stacks, partial mask): cost}``.  One run replaces a plan per target: the automatic
    planner asks for every pair among a value's candidate placements.  ``ops``: the reduce op of each
    mesh dim the targets hold partial (``target_pmask``); a source partial dim with that op may stay,
    any other must be reduced (as ``solve`` treats them).  ``target_stacks`` are the stacks at which
    a replicated dim may be made partial (the targets holding partial dims).  Plain Dijkstra: no
    heuristic, no scratch-dim pruning (every target is a goal)."""
    T = len(src_levels)
    P = Problem(cost_model, mesh_shape, src_levels, tuple(() for _ in range(T)), src_partial, dict(ops),
                global_bytes, shape, even_only, fuse)
    P.dst_pmask = target_pmask
    keep = sum(1 << m for m, o in src_partial.items() if ops.get(m) == o)
    P.start_pa, P.start_pb = sum(1 << m for m in src_partial) & ~keep, keep
    P.drop_bounds()  # a zero heuristic: Dijkstra
    P.scratch, P.scratch_groups, P.scratch_set = [], [], set()
    return solve(P, exhaust=frozenset(target_stacks), graph=graph)


def placing_plan(P: Problem) -> tuple[float, list]:
    """Another simple valid plan, often far cheaper than ``direct_plan``: place target levels
    as early as they can go (free pushes, then reduce-scatters onto the target's stacks), and move a
    level that must leave its stack straight to its target place with one all-to-all when that place
    is next in line, gathering it otherwise.  Every state it passes is a prefix of the source's or the
    target's stacks, so it is valid under ``even_only`` too; a tighter upper bound prunes more.
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
        return math.inf, moves  # stuck (a level whose place never frees up): no bound from this plan
    for m in range(P.M):  # partial dims the target does not keep: all-reduce
        if (pa | pb) >> m & 1 and not (pb & keep_p) >> m & 1:
            c = tab.ar_l[m] + tab.ar_f[m] * g / shards
            moves.append(((AR, m, None, None, 1), c))
            cost += c
            pb &= ~(1 << m)
    _finish(P, stacks, pb, moves)
    return cost, moves
