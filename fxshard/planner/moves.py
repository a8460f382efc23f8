"""The moves of the search, on packed states: one generator for A*, the exhaustive search and
the recording of the state graph.

A state is packed into one int: per tensor dim a field holding its stack of levels as digits
(the innermost level in the lowest digit; 0 is empty), then the mask of partial dims to reduce away
and the mask of partial dims the target keeps.  A move is then a few additions and shifts, and
hashing a small int is what makes the search cheap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

from ..core.cost import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER
from ..core.spec import Levels, levels_divide
from .problem import (
    A2A,
    AG,
    AR,
    LINEAR_OPS,
    MAKE_PARTIAL,
    RS,
    SHARD,
    Problem,
    _codes,
    _layout,
    _stack_masks,
)

_LINEAR = frozenset(LINEAR_OPS)


class Packing:
    """How the states of one problem pack into ints (see the module docstring)."""

    def __init__(self, P: Problem):
        self.code, self.decode, self.tcodes = _codes(P)
        self.B = B = len(self.decode)
        self.W, self.PA, self.PB = W, PA, _PB = _layout(B, P.M, P.T)
        self.wmask = (1 << W) - 1
        self.mmask = (1 << P.M) - 1
        self.stack_bits = (1 << PA) - 1
        self.shift = [W * d for d in range(P.T)]
        self.k, self.shape, self.T = P.k, P.shape, P.T
        self._dec: dict = {}
        self._fits: dict = {}
        # per tensor dim: the stack values that are prefixes of the target's stack
        self.prefix_ok = []
        for st in P.dst_levels:
            ok, v = {0}, 0
            for lev in st:
                v = v * B + self.code[lev]
                ok.add(v)
            self.prefix_ok.append(ok)

    def enc(self, st: tuple) -> int:
        v, B, code = 0, self.B, self.code
        for lev in st:
            v = v * B + code[lev]
        return v

    def pack(self, stacks: Sequence[tuple], pa: int, pb: int) -> int:
        x = pa << self.PA | pb << self.PB
        for d, st in enumerate(stacks):
            x |= self.enc(st) << self.shift[d]
        return x

    def dec(self, v: int) -> tuple:
        """The levels of a packed stack value, outermost first."""
        st = self._dec.get(v)
        if st is None:
            out, x, B, decode = [], v, self.B, self.decode
            while x:
                out.append(decode[x % B])
                x //= B
            st = self._dec[v] = tuple(reversed(out))
        return st

    def unpack(self, x: int) -> tuple:
        wmask, shift = self.wmask, self.shift
        return (
            tuple(self.dec(x >> shift[d] & wmask) for d in range(self.T)),
            x >> self.PA & self.mmask,
            x >> self.PB,
        )

    def fits(self, d: int, v: int) -> bool:
        """The stack value ``v`` splits tensor dim ``d`` evenly (``levels_divide``)."""
        ok = self._fits.get((d, v))
        if ok is None:
            ok = self._fits[(d, v)] = levels_divide(self.shape[d], self.dec(v), self.k)
        return ok


def expander(P: Problem, pk: Packing, seen: Callable, targets: set[int]) -> Callable:
    """``expand(state, gcost, h, shards, sharded, ub) -> [(state', step cost, shards', sharded',
    dh, move), ...]``: every move from ``state`` (reached at cost ``gcost``, heuristic ``h``,
    ``shards`` = how many ways the tensor is split, ``sharded`` = mask of the mesh dims splitting
    it), pruned where ``gcost + cost + h'`` exceeds ``ub`` or does not beat ``seen(state')`` (the
    best cost known; ``{}.get`` keeps every move).  A replicated dim may be made partial only at
    the stacks in ``targets`` (packed, no partial bits).  ``dh`` is the change of the heuristic,
    ``move`` a tuple as ``Move`` takes it.

    One algorithm kept whole on purpose: ``expand`` is the search's hot loop (every state of every
    plan passes through it), so the tables it reads are bound once here and the moves of each kind
    are written out inline rather than called."""
    k, M, T = P.k, P.M, P.T
    B, decode, tcodes, shift, wmask = pk.B, pk.decode, pk.tcodes, pk.shift, pk.wmask
    PA, PB, mmask, stack_bits, prefix_ok = pk.PA, pk.PB, pk.mmask, pk.stack_bits, pk.prefix_ok
    fits = pk.fits
    scratch_groups, scratch_set = P.scratch_groups, P.scratch_set
    g_bytes, dst_pmask, even_only = P.g, P.dst_pmask, P.even_only
    red, lb_pb = P.red, P.lb_pb
    # a level's bound above the target prefix (level_lb): lb_at[d][m], or two[m] where a level in
    # the stack under it (smask: its mesh dims) is one of blk[m]
    lb_at, two, blk = P.lb_at, P.two, P.blk
    smask = _stack_masks(M) if any(blk) else None
    cand_mask, glb = P.cand_mask, P.glb
    tab = P.tab
    ag_l, ag_f, a2_l, a2_f = tab.ag_l, tab.ag_f, tab.a2_l, tab.a2_f
    ar_l, ar_f, rs_l, rs_f = tab.ar_l, tab.ar_f, tab.rs_l, tab.rs_f
    inf = math.inf
    fuse = P.fuse
    fused_moves = _fused_move_generator(P, pk, seen) if fuse else None

    def expand(state: int, gcost: float, h: float, shards: int, sharded: int, ub: float) -> list:
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
        at_target = state & stack_bits in targets
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
            top_lb = (
                0.0
                if v in prefix_ok[d]
                else two[m]
                if blk[m] and blk[m] & smask[rest]
                else lb_at[d][m]
            )
            step_cost = ag_l[m] + ag_f[m] * n
            dh = glb[mand & ~bit] - h_ag - top_lb
            if base_f + step_cost + dh <= ub and gcost + step_cost + 1e-9 < seen(popped, inf):
                nbrs.append(
                    (popped, step_cost, shards // k[m], sharded & ~bit, dh, (AG, m, d, None, 1))
                )
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
                new_lb = (
                    0.0
                    if nv in prefix_ok[d2]
                    else two[m]
                    if blk[m] and blk[m] & smask[base]
                    else lb_at[d2][m]
                )
                if base_f + a2a_cost + new_lb - top_lb > ub:
                    continue
                ns = popped + (nv - base << shift[d2])
                if lim < seen(ns, inf):
                    nbrs.append(
                        (ns, a2a_cost, shards, sharded, new_lb - top_lb, (A2A, m, d, d2, sf2))
                    )
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
                    nbrs.append(
                        (cleared, step_cost, shards, sharded, -old_lb, (AR, m, None, None, 1))
                    )
                step_cost, kind, base_dh = rs_l[m] + rs_f[m] * n, RS, -old_lb
            else:
                step_cost, kind, base_dh = 0.0, SHARD, 0.0
                cleared = state
                # Making a dim partial is free and changes no size, so it can always wait until
                # everything else is in place: only allow it there (never mixes reduce ops either).
                if dst_pmask & bit and at_target and not pa:
                    nbrs.append(
                        (
                            state | bit << PB,
                            0.0,
                            shards,
                            sharded,
                            lb_pb[m],
                            (MAKE_PARTIAL, m, None, None, 1),
                        )
                    )
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
                new_lb = (
                    0.0
                    if nv in prefix_ok[d2]
                    else two[m]
                    if blk[m] and blk[m] & smask[base]
                    else lb_at[d2][m]
                )
                if base_f + step_cost + base_dh + new_lb > ub:
                    continue
                ns = cleared + (nv - base << shift[d2])
                if lim < seen(ns, inf):
                    nbrs.append(
                        (
                            ns,
                            step_cost,
                            shards * k[m],
                            sharded | bit,
                            base_dh + new_lb,
                            (kind, m, None, d2, sf2),
                        )
                    )
        # fused moves need two levels on one stack or two partial dims
        if fuse and (max(vals, default=0) >= B or (pa | pb) & ((pa | pb) - 1)):
            fused_moves(
                state, vals, pa, pb, gcost, base_f, ub, shards, sharded, mand, h_ag, empty_ok, nbrs
            )
        return nbrs

    return expand


def _fused_move_generator(P: Problem, pk: Packing, seen):
    """The moves of one collective over several mesh dims, on packed states: gather or all-to-all
    the innermost j >= 2 levels of a tensor dim (as a block, in order), all-reduce or reduce-scatter
    several partial dims of one reduce op (sum and avg mix) at once.  Returns a function that
    appends them to an expansion's neighbours, pruned as ``solve`` prunes single moves.  A fused
    collective's cost is the cost model's for the flattened group, memoised per (kind, dims, local
    size).  Kept whole for the reason ``expander`` is."""
    k, T, M, cm = P.k, P.T, P.M, P.cost_model
    g_bytes, even_only = P.g, P.even_only
    scratch_set, cand_mask = P.scratch_set, P.cand_mask
    red, lb_pb, src_ops, dst_ops = P.red, P.lb_pb, P.src_ops, P.dst_ops
    B, shift, dec, fits, glb = pk.B, pk.shift, pk.dec, pk.fits, P.glb
    PA, PB = pk.PA, pk.PB
    powers = [B**j for j in range(M + 1)]
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
            t = tops[top] = (
                any(sf != 1 for _, sf in levels),
                dims,
                tuple(sorted(dims)),
                prod,
                mask,
            )
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
                    out.append(
                        (popped, c, shards // prod, sharded & ~tmask, dh, (AG, dims, d, None, 1))
                    )
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
                # a dim still to reduce holds the source's op; one kept or made partial, the
                # target's (a state graph shared by runs of linear target ops, ``_share_graphs``,
                # holds dims kept or made partial for another run's targets: linear, as sum)
                ops = {src_ops[m] if pa >> m & 1 else dst_ops.get(m, "sum") for m in subset}
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
                            out.append(
                                (ns, c, shards * prod, sharded | bits, dh, (RS, order, None, d2, 1))
                            )

    return moves


def state_key(levels: Levels, pa: int, pb: int, mesh_ndim: int) -> int:
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
