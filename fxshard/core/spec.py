"""A value's sharding: placements per mesh dim + shard order + global shape/dtype.

Internally a sharded tensor dim is described by its *levels*: the mesh dims that split it, in the
order they were applied, each with a split factor (1 for ``Shard``, ``sf`` for ``_StridedShard``).
Splitting follows DTensor exactly (``torch.chunk`` semantics: chunks of ``ceil(n/k)``, trailing
chunks shorter or empty), so every local shape and index below matches DTensor, uneven sizes too.

Level ``(m, sf)`` applied to a local extent of ``n`` elements: cut it into ``sf`` pieces, cut each
piece into ``k_m`` chunks, and rank ``c`` on mesh dim ``m`` keeps chunk ``c`` of every piece.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .._torch import (
    Partial,
    Placement,
    Replicate,
    Shard,
    StridedShard,
    is_strided_shard,
    placement_kind,
    strided_split_factor,
)
from .mesh import MeshSpec

Level = tuple[int, int]  # (mesh_dim, split_factor)
Levels = tuple[tuple[Level, ...], ...]  # one tuple of levels per tensor dim


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """(start, length) of each of ``k`` torch.chunk-style chunks of ``n`` elements."""
    cs = -(-n // k) if n else 0
    out = []
    for c in range(k):
        start = min(c * cs, n)
        out.append((start, max(0, min(cs, n - start))))
    return out


@lru_cache(maxsize=65536)
def level_positions(n: int, k: int, sf: int) -> tuple[tuple[int, ...], ...]:
    """For each of the ``k`` ranks: the positions (0..n-1) of the local extent it keeps."""
    if sf == 1:
        return tuple(tuple(range(s, s + ln)) for s, ln in chunk_bounds(n, k))
    pieces = chunk_bounds(n, sf)
    out: list[list[int]] = [[] for _ in range(k)]
    for ps, pl in pieces:
        for c, (s, ln) in enumerate(chunk_bounds(pl, k)):
            out[c].extend(range(ps + s, ps + s + ln))
    return tuple(tuple(o) for o in out)


def local_indices(
    n: int, levels: Sequence[Level], mesh_shape: Sequence[int], coord: Sequence[int]
) -> list[int]:
    """Global indices held along one tensor dim by the rank at ``coord``, in local order."""
    idx = list(range(n))
    for m, sf in levels:
        pos = level_positions(len(idx), mesh_shape[m], sf)[coord[m]]
        idx = [idx[p] for p in pos]
    return idx


@lru_cache(maxsize=4096)
def _position_tensor(n: int, k: int, sf: int, c: int) -> torch.Tensor:
    """``level_positions(n, k, sf)[c]`` as an int64 tensor, built from ranges (no per-element
    Python: the reshape check asks this of dims of 10^5-10^6 elements)."""
    if sf == 1:
        s, ln = chunk_bounds(n, k)[c]
        return torch.arange(s, s + ln, dtype=torch.int64)
    parts = []
    for ps, pl in chunk_bounds(n, sf):
        s, ln = chunk_bounds(pl, k)[c]
        parts.append(torch.arange(ps + s, ps + s + ln, dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def local_index_tensor(
    n: int, levels: Sequence[Level], mesh_shape: Sequence[int], coord: Sequence[int]
) -> torch.Tensor:
    """``local_indices`` as an int64 tensor."""
    idx = torch.arange(n, dtype=torch.int64)
    for m, sf in levels:
        idx = idx[_position_tensor(len(idx), mesh_shape[m], sf, coord[m])]
    return idx


def local_extent(
    n: int, levels: Sequence[Level], mesh_shape: Sequence[int], coord: Sequence[int]
) -> int:
    for m, sf in levels:
        if sf != 1:
            n = len(level_positions(n, mesh_shape[m], sf)[coord[m]])
        else:
            n = chunk_bounds(n, mesh_shape[m])[coord[m]][1]
    return n


def levels_divide(n: int, levels: Sequence[Level], mesh_shape: Sequence[int]) -> bool:
    """Every level splits the extent it is applied to exactly (so every rank holds as many
    elements: what one rank-agnostic per-rank graph needs).  The one evenness check."""
    for m, sf in levels:
        k = mesh_shape[m]
        if n % (k * sf):
            return False
        n //= k
    return True


def is_even(spec: ShardingSpec) -> bool:
    """Every tensor dim of ``spec`` is split exactly (``levels_divide``)."""
    shape = spec.mesh.shape
    return all(levels_divide(n, lv, shape) for n, lv in zip(spec.shape, spec.levels) if lv)


def mesh_coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every mesh coordinate, row-major (the ranks' order)."""
    return list(itertools.product(*(range(k) for k in mesh_shape)))


@lru_cache(maxsize=65536)
def local_numels(spec: ShardingSpec) -> tuple[int, ...]:
    """Elements each rank holds (row-major mesh coordinates)."""
    return tuple(math.prod(spec.local_shape(c)) for c in mesh_coords(spec.mesh.shape))


@lru_cache(maxsize=65536)
def has_empty_shard(spec: ShardingSpec) -> bool:
    """Some rank holds nothing of a dim that is not empty (torch.chunk leaves the last ranks
    empty where a dim has fewer chunks of ``ceil(n/k)`` than ranks: 6 over 4 is 2, 2, 2, 0)."""
    if is_even(spec):
        return False
    return any(
        0 in spec.local_shape(c) and 0 not in spec.shape for c in mesh_coords(spec.mesh.shape)
    )


# a reshape group larger than this is not checked index by index (its strided candidates: refused)
_VIEW_CHECK_LIMIT = 1 << 22


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list | None:
    """The dims of shape ``a`` and ``b`` (size-1 dims left out) that a row-major reshape maps onto
    each other: ``[(a dims, b dims), ...]`` with equal products; None where the sizes do not
    factor so (they always do for a valid view)."""
    da = [d for d, n in enumerate(a) if n != 1]
    db = [d for d, n in enumerate(b) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(da) or j < len(db):
        if i >= len(da) or j >= len(db):
            return None
        ga, gb, pa, pb = [da[i]], [db[j]], a[da[i]], b[db[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(da):
                    return None
                ga.append(da[i])
                pa *= a[da[i]]
                i += 1
            else:
                if j >= len(db):
                    return None
                gb.append(db[j])
                pb *= b[db[j]]
                j += 1
        groups.append((ga, gb))
    return groups


@lru_cache(maxsize=4096)
def reshape_keeps_shards(src: ShardingSpec, dst: ShardingSpec) -> bool:
    """Whether every rank's shard of ``dst`` is its shard of ``src`` reshaped (row-major) to its
    local shape: what a per-rank view computes.  Checked exactly, on the global indices each rank
    holds, group by group of the dims the reshape maps onto each other (a mesh dim splitting dims
    of two groups, or a group too large to check, is refused).  DTensor's view rule is right for
    plain shards; for strided ones (a merged or split dim whose pieces are strided) it is not
    always, so fxshard asks this of every strided candidate of a reshape."""
    if src.partials != dst.partials or math.prod(src.shape) != math.prod(dst.shape):
        return False
    mesh = src.mesh.shape
    if any(lv and n == 1 for s in (src, dst) for n, lv in zip(s.shape, s.levels)):
        return False
    groups = reshape_groups(src.shape, dst.shape)
    if groups is None:
        return False
    owner = {}  # mesh dim -> the group it splits, in src and in dst alike
    for g, (ga, gb) in enumerate(groups):
        for side, dims in (("a", ga), ("b", gb)):
            spec = src if side == "a" else dst
            for d in dims:
                for m, _sf in spec.levels[d]:
                    if owner.setdefault((side, m), g) != g:
                        return False
    if {m: g for (s, m), g in owner.items() if s == "a"} != {
        m: g for (s, m), g in owner.items() if s == "b"
    }:
        return False
    for g, (ga, gb) in enumerate(groups):
        mdims = sorted(m for (s, m), h in owner.items() if s == "a" and h == g)
        if not mdims:
            continue
        sa, sb = [src.shape[d] for d in ga], [dst.shape[d] for d in gb]
        if math.prod(sa) > _VIEW_CHECK_LIMIT:
            return False
        base = torch.arange(math.prod(sa), dtype=torch.int64)
        full_a, full_b = base.view(sa), base.view(sb)
        for sub in itertools.product(*(range(mesh[m]) for m in mdims)):
            coord = [0] * len(mesh)
            for m, c in zip(mdims, sub):
                coord[m] = c
            ia = [local_index_tensor(src.shape[d], src.levels[d], mesh, coord) for d in ga]
            ib = [local_index_tensor(dst.shape[d], dst.levels[d], mesh, coord) for d in gb]
            got = full_a[torch.meshgrid(*ia, indexing="ij")]
            want = full_b[torch.meshgrid(*ib, indexing="ij")]
            if got.numel() != want.numel() or not torch.equal(got.reshape(-1), want.reshape(-1)):
                return False
    return True


def placement_str(p: Placement) -> str:
    k = placement_kind(p)
    if k == "SS":
        return f"_S({p.dim},{strided_split_factor(p)})"
    if k == "S":
        return f"S({p.dim})"
    if k == "R":
        return "R"
    if k == "P":
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return repr(p)


def _check_placements(mesh: MeshSpec, placements, ndim: int, what: str) -> tuple:
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements {tuple(placement_str(p) for p in placements)} "
            "for a "
            f"{mesh.ndim}-D mesh {mesh.shape}; give exactly one placement per mesh dim"
        )
    kinds = set()
    normalized = []
    for i, p in enumerate(placements):
        k = placement_kind(p)
        if k in ("S", "SS"):
            if not -ndim <= p.dim < ndim:
                raise ValueError(
                    f"{what}: {placement_str(p)} on mesh dim {i} shards tensor dim {p.dim}, "
                    f"out of range for a {ndim}-D tensor"
                )
            if k == "SS" and strided_split_factor(p) < 1:
                raise ValueError(f"{what}: {placement_str(p)} on mesh dim {i} has split factor < 1")
            if p.dim < 0:  # normalise negative shard dims so equal shardings compare equal
                p = (
                    type(p)(p.dim % ndim, split_factor=strided_split_factor(p))
                    if k == "SS"
                    else Shard(p.dim % ndim)
                )
        elif k == "P":
            kinds.add(p.reduce_op)
        elif k != "R":
            raise ValueError(
                f"{what}: unknown placement {p!r} on mesh dim {i}; expected Replicate(), Shard(d), "
                f"Partial(op) or _StridedShard(d, sf)"
            )
        normalized.append(p)
    if len(kinds) > 1 and not kinds <= {"sum", "avg"}:
        # sum and avg are both linear, so their order does not matter; max/min with anything does
        raise ValueError(
            f"{what}: mixed Partial kinds {sorted(kinds)} in one placement; use one reduce op "
            f"(only sum and avg may be mixed)"
        )
    for op in kinds:
        if op not in ("sum", "avg", "max", "min"):
            raise ValueError(f"{what}: Partial({op!r}) is not supported; use sum, avg, max or min")
    return tuple(normalized)


_REDUCE_OPS = ("sum", "avg", "max", "min")


def _plain_levels(mesh: MeshSpec, placements, ndim: int, order: dict | None = None):
    """Levels when every placement is exactly Replicate, Shard(0 <= d < ndim) or Partial of one
    allowed op (sum and avg may mix), in the default order or a ``{tensor dim: mesh dims}`` order
    that matches the placements; None for anything else (the general path normalises or
    explains)."""
    if len(placements) != mesh.ndim:
        return None
    by_dim: dict = {}  # tensor dim -> mesh dims sharding it, ascending
    op0 = None
    for m, p in enumerate(placements):
        t = type(p)
        if t is Replicate:
            continue
        if t is Shard:
            d = p.dim
            if not 0 <= d < ndim:
                return None
            ms = by_dim.get(d)
            if ms is None:
                by_dim[d] = [m]
            else:
                ms.append(m)
        elif t is Partial and p.reduce_op in _REDUCE_OPS:
            op = p.reduce_op
            if op0 is None:
                op0 = op
            elif op != op0 and not (op in _LINEAR and op0 in _LINEAR):
                return None
        else:
            return None
    # must name every sharded dim, with exactly its mesh dims (else: the general path)
    if order is not None:
        for d in by_dim:
            if d not in order:
                return None
        for d, ms in order.items():
            if (
                type(d) is not int
                or not 0 <= d < ndim
                or any(type(m) is not int for m in ms)
                or sorted(ms) != by_dim.get(d, [])
            ):
                return None
        by_dim = order
    levels = [()] * ndim
    for d, ms in by_dim.items():
        if ms:
            levels[d] = tuple([_LEVEL[m] if m < len(_LEVEL) else (m, 1) for m in ms])
    return tuple(levels)


_LINEAR = ("sum", "avg")
_LEVEL = tuple((m, 1) for m in range(16))  # plain levels, shared


def _is_shard_like(p) -> bool:
    return placement_kind(p) in ("S", "SS")


def _normalize_order(shard_order, placements, ndim: int, what: str) -> dict[int, tuple[int, ...]]:
    """{tensor_dim: mesh dims in application order}; default: ascending mesh dims."""
    default: dict[int, list[int]] = {}
    for i, p in enumerate(placements):
        if _is_shard_like(p):
            default.setdefault(p.dim, []).append(i)
    if shard_order is None:
        return {d: tuple(ms) for d, ms in default.items()}
    if isinstance(shard_order, dict):
        entries = list(shard_order.items())
    else:
        entries = [(e[0], e[1]) for e in shard_order]
    order: dict[int, tuple[int, ...]] = {}
    for tdim, mdims in entries:
        order[int(tdim) % ndim] = tuple(int(m) for m in mdims)
    for d in set(order) | set(default):
        if sorted(order.get(d, ())) != sorted(default.get(d, ())):
            raise ValueError(
                f"{what}: shard order {order} does not match the placements: tensor dim {d} is "
                "sharded "
                f"by mesh dims {tuple(default.get(d, ()))}"
            )
    return order


@dataclass(frozen=True)
class ShardingSpec:
    """Placements + shard order + global shape/dtype of one value on one mesh."""

    mesh: MeshSpec
    placements: tuple
    shape: tuple[int, ...]
    dtype: torch.dtype
    levels: Levels

    # Specs key every table of annotation and planning (millions of lookups on a 3-D mesh): the
    # hash is computed once, and equal specs are usually one object (``make`` is memoised).
    def _fields(self) -> tuple:
        return (self.mesh, self.placements, self.shape, self.dtype, self.levels)

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._fields())
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return hash(self) == hash(other) and self._fields() == other._fields()

    def __getstate__(self) -> dict:  # the cached hash is this process's (pickled specs rehash)
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @classmethod
    def make(
        cls,
        mesh: MeshSpec,
        placements: Sequence[Placement],
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        shard_order: dict | tuple | None = None,
        what: str = "sharding",
        cache: bool = True,
    ) -> ShardingSpec:
        """Validated spec; ``what`` names the value in error messages.  Memoised: annotation asks
        for the same (placements, shape) pairs thousands of times (``cache=False``: built
        afresh)."""
        if not cache:
            return cls._make(mesh, placements, shape, dtype, shard_order, what)
        try:
            key_order = (
                None
                if shard_order is None
                else (
                    tuple(sorted(shard_order.items()))
                    if isinstance(shard_order, dict)
                    else tuple(shard_order)
                )
            )
            return _make_cached(mesh, tuple(placements), tuple(shape), dtype, key_order, what)
        except TypeError:  # unhashable input (e.g. lists inside): build uncached
            return cls._make(mesh, placements, shape, dtype, shard_order, what)

    @classmethod
    def _make(
        cls,
        mesh: MeshSpec,
        placements: Sequence[Placement],
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        shard_order: dict | tuple | None = None,
        what: str = "sharding",
    ) -> ShardingSpec:
        shape = tuple(map(int, shape))
        order = shard_order
        if isinstance(order, tuple):  # (tensor dim, mesh dims) pairs, as make() keys them
            order = dict(order) if all(type(e) is tuple and len(e) == 2 for e in order) else False
        if order is None or isinstance(order, dict):
            levels = _plain_levels(mesh, placements, len(shape), order)
            if levels is not None:  # the common case, validated without the general machinery
                return cls(mesh, tuple(placements), shape, dtype, levels)
        placements = _check_placements(mesh, placements, len(shape), what)
        order = _normalize_order(shard_order, placements, len(shape), what)
        levels = []
        for d in range(len(shape)):
            lv = []
            for m in order.get(d, ()):
                p = placements[m]
                lv.append((m, strided_split_factor(p) if is_strided_shard(p) else 1))
            levels.append(tuple(lv))
        levels = tuple(levels)
        canon = canonical_levels(levels, shape, mesh.shape)
        if canon == levels:  # already canonical: keep the validated placements
            return cls(mesh, placements, shape, dtype, levels)
        partial = {m: p.reduce_op for m, p in enumerate(placements) if placement_kind(p) == "P"}
        return cls(mesh, levels_to_placements(canon, partial, mesh.ndim), shape, dtype, canon)

    @property
    def partials(self) -> dict[int, str]:
        """{mesh dim: reduce op} of the partial mesh dims."""
        return {m: p.reduce_op for m, p in enumerate(self.placements) if placement_kind(p) == "P"}

    @property
    def partial_op(self) -> str | None:
        for p in self.placements:
            if placement_kind(p) == "P":
                return p.reduce_op
        return None

    @property
    def shard_order(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        return tuple((d, tuple(m for m, _ in lv)) for d, lv in enumerate(self.levels) if lv)

    @property
    def num_shards(self) -> int:
        return math.prod(self.mesh.shape[m] for lv in self.levels for m, _ in lv)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def local_shape(self, coord: Sequence[int]) -> tuple[int, ...]:
        return tuple(
            local_extent(n, lv, self.mesh.shape, coord) for n, lv in zip(self.shape, self.levels)
        )

    def local_indices(self, coord: Sequence[int], dim: int) -> list[int]:
        return local_indices(self.shape[dim], self.levels[dim], self.mesh.shape, coord)

    def local_of(self, full: torch.Tensor, coord: Sequence[int]) -> torch.Tensor:
        """``shard_full`` for hot paths: even block shards are narrowed, not gathered by index;
        replicated values come back as they are (made contiguous)."""
        if any(isinstance(p, Partial) for p in self.placements):
            return self.shard_full(full, coord)
        out = full
        for d, lv in enumerate(self.levels):
            start, size = 0, self.shape[d]
            for m, sf in lv:  # outermost level first: each splits the block the previous one left
                k = self.mesh.shape[m]
                if sf != 1 or size % k:
                    return self.shard_full(full, coord)
                size //= k
                start += coord[m] * size
            if lv:
                out = out.narrow(d, start, size)
        return out.contiguous()

    def shard_full(self, full: torch.Tensor, coord: Sequence[int]) -> torch.Tensor:
        """This rank's local tensor of ``full`` (Partial dims: rank 0 of the dim holds the
        value)."""
        out = full
        for d, lv in enumerate(self.levels):
            if lv:
                idx = self.local_indices(coord, d)
                out = out.index_select(d, torch.tensor(idx, dtype=torch.long, device=full.device))
        for m, p in enumerate(self.placements):
            if isinstance(p, Partial) and p.reduce_op == "sum" and coord[m] != 0:
                out = torch.zeros_like(out)
        return out.contiguous()

    def __str__(self) -> str:
        return placements_str(self.placements, self.levels)

    def at_sizes(self, shape: Sequence[int]) -> ShardingSpec:
        """This spec for a value of another global ``shape`` differing only in dims it does not
        split (dynamic shapes: a program for every size of a whole dim)."""
        shape = tuple(int(n) for n in shape)
        if shape == self.shape:
            return self
        if len(shape) != len(self.shape) or any(
            lv and a != b for a, b, lv in zip(shape, self.shape, self.levels)
        ):
            raise ValueError(f"{self} of {self.shape} cannot describe a value of {shape}")
        return replace(self, shape=shape)

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape of a value whose shard (on any rank) has ``local_shape``, where the
        dims this spec does not split may have any size."""
        return tuple(n if lv else int(m) for n, m, lv in zip(self.shape, local_shape, self.levels))


@lru_cache(maxsize=1 << 16)
def _make_cached(mesh, placements, shape, dtype, shard_order, what):
    return ShardingSpec._make(mesh, placements, shape, dtype, shard_order, what)


def placements_str(placements: Sequence[Placement], levels: Levels | None = None) -> str:
    """Compact form such as ``S(0)[1]S(0)[0]R``: the bracket is the position in the shard order,
    shown only when the order is not the default."""
    s = []
    pos = {}
    nondefault = False
    if levels is not None:
        for lv in levels:
            ms = [m for m, _ in lv]
            if ms != sorted(ms):
                nondefault = True
            for j, (m, _) in enumerate(lv):
                pos[m] = j
    for i, p in enumerate(placements):
        t = placement_str(p)
        if nondefault and i in pos:
            t += f"[{pos[i]}]"
        s.append(t)
    return "".join(s)


def canonical_levels(levels: Levels, shape: Sequence[int], mesh_shape: Sequence[int]) -> Levels:
    """Rewrite strided levels that are only a shard order in disguise as plain levels.

    ``(m, sf)`` followed by plain levels whose sizes multiply to ``sf`` is the same partition as
    those levels followed by ``(m, 1)`` (the right-to-left sharding _StridedShard was made for).
    The rewrite is kept only when it gives every rank exactly the same indices (uneven sizes can
    differ).
    """
    if not any(sf != 1 for lv in levels for _, sf in lv):
        return levels  # only strided levels can be rewritten
    out = []
    for n, lv in zip(shape, levels):
        lv = tuple(lv)
        changed = True
        while changed:
            changed = False
            for p, (m, sf) in enumerate(lv):
                rest = lv[p + 1 :]
                if sf == 1 or not rest or any(s != 1 for _, s in rest):
                    continue
                if math.prod(mesh_shape[r] for r, _ in rest) != sf:
                    continue
                cand = lv[:p] + rest + ((m, 1),)
                if _same_partition(n, lv, cand, mesh_shape):
                    lv, changed = cand, True
                    break
        out.append(lv)
    return tuple(out)


def _same_partition(n, a, b, mesh_shape) -> bool:
    dims = sorted({m for m, _ in a})
    for coord_vals in _coords([mesh_shape[m] for m in dims]):
        coord = [0] * len(mesh_shape)
        for m, c in zip(dims, coord_vals):
            coord[m] = c
        if local_indices(n, a, mesh_shape, coord) != local_indices(n, b, mesh_shape, coord):
            return False
    return True


def _coords(sizes):
    if not sizes:
        yield ()
        return
    for c in range(sizes[0]):
        for rest in _coords(sizes[1:]):
            yield (c, *rest)


def levels_to_placements(levels: Levels, partial: dict[int, str], mesh_ndim: int) -> tuple:
    """Placements tuple for a planner state (levels + partial mesh dims)."""
    out: list = [Replicate()] * mesh_ndim
    for d, lv in enumerate(levels):
        for m, sf in lv:
            out[m] = StridedShard(d, split_factor=sf) if sf != 1 else Shard(d)
    for m, op in partial.items():
        out[m] = Partial(op)
    return tuple(out)
