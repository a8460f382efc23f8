"""Run a ``RedistributePlan`` on a local shard with functional collectives.

One code path serves three uses:

* eagerly on a real process group, with this rank's mesh coordinate as ints;
* eagerly on simulated ranks (``LocalTensorMode``): the coordinate is per-rank symbolic and the
  rank-dependent index arithmetic (``@per_rank``) runs once per rank, so uneven shards simply get
  per-rank shapes;
* traced into an FX graph (``make_fx``) with the coordinate passed as an int64 *tensor*: each
  rank-dependent choice becomes an ``index_select`` through a per-coordinate index table, so one
  graph serves every rank (rank-agnostic).  Tracing needs equal local shapes on every rank.

Collectives always run on dim 0 of a contiguous buffer.  Uneven chunks are padded to the largest
chunk of their group and trimmed afterwards; strided levels are permuted locally before or after.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._torch import c10d, flattened_group_name, per_rank
from ..core.spec import level_positions, levels_divide, local_extent
from .plan import RedistributePlan
from .problem import A2A, AG, AR, MAKE_PARTIAL, RS, SHARD

_F = c10d


class MeshGroups:
    """Process-group names of a ``DeviceMesh``: ``groups[m]`` for mesh dim ``m``, ``groups[(a, b)]``
    for the flattened group over several dims (created on first use, cached by DeviceMesh)."""

    def __init__(self, device_mesh: DeviceMesh):
        self.device_mesh = device_mesh

    def __getitem__(self, key):
        dm = self.device_mesh
        if isinstance(key, int):
            return dm.get_group(key).group_name
        names = dm.mesh_dim_names
        if names is None:
            raise ValueError(
                "a fused collective over several mesh dims needs a DeviceMesh with mesh_dim_names"
            )
        return flattened_group_name(dm, [names[m] for m in key])

    def __len__(self):
        return self.device_mesh.ndim


def group_names(device_mesh: DeviceMesh) -> MeshGroups:
    """The process-group names of a ``DeviceMesh`` (per mesh dim, and flattened groups)."""
    return MeshGroups(device_mesh)


def mesh_coordinate(device_mesh: DeviceMesh) -> tuple:
    """This rank's coordinate (per-rank symbolic under ``LocalTensorMode``)."""
    c = device_mesh.get_coordinate()
    if c is None:
        raise RuntimeError("this rank is not part of the device mesh")
    return tuple(c)


def execute_plan(
    plan: RedistributePlan, local: torch.Tensor, groups: MeshGroups, coord: tuple | torch.Tensor
) -> torch.Tensor:
    """Apply every step of ``plan`` to ``local`` (this rank's shard of ``plan.src``).

    ``groups[m]`` is the process-group name of mesh dim ``m`` (``groups[(a, b)]`` of the flattened
    group of several dims, for fused steps); ``coord`` is this rank's mesh coordinate: a tuple of
    ints (or per-rank SymInts) eagerly, an int64 tensor when tracing.
    """
    mesh_shape = plan.src.mesh.shape
    if isinstance(coord, torch.Tensor):
        _check_traceable(plan)
    x = local
    for step, before, part in zip(plan.steps, plan.levels[:-1], plan.partials[:-1]):
        mv = step.move
        dims = step.mesh_dims  # sorted: the flattened group's rank order is row-major over them
        k = math.prod(mesh_shape[m] for m in dims)
        gname = groups[dims[0]] if len(dims) == 1 else groups[dims]
        ops = {part[m] for m in dims if m in part}
        # sum and avg reduce as a sum, then the avg dims' share is divided out (gloo has no avg)
        op = "sum" if ops and ops <= {"sum", "avg"} else (next(iter(ops)) if ops else None)
        scale = math.prod(mesh_shape[m] for m in dims if part.get(m) == "avg")
        if mv.kind == SHARD:
            x = _shard_local(x, coord, mv.mesh_dim, k, mv.dst_dim, mv.sf)
        elif mv.kind == MAKE_PARTIAL:
            if step.dst.reduce_op == "sum":  # one rank keeps the value, the others contribute zero
                x = _keep_on_coord0(x, coord, mv.mesh_dim)
        elif mv.kind == AR:
            x = _F.wait_tensor(_F.all_reduce(x, op, gname))
            x = average(x, scale) if scale > 1 else x
        elif mv.kind == RS:
            levels = tuple((m, mv.sf) for m in mv.mesh_dims)
            buf = _rs_pack(x, mv.dst_dim, levels, mesh_shape)
            out = _F.wait_tensor(_F.reduce_scatter_tensor(buf, op, k, gname))
            x = _rs_unpack(out, coord, mv.dst_dim, levels, x.size(mv.dst_dim), mesh_shape)
            x = average(x, scale) if scale > 1 else x
        else:
            d = mv.src_dim
            j = len(mv.mesh_dims)
            levels = before[d][-j:]  # the levels that leave tensor dim d, innermost last
            # extent of tensor dim d across the group = before the levels that leave
            ext = (plan.src.shape[d], before[d][:-j], mesh_shape)
            if mv.kind == AG:
                buf = _ag_pack(x, coord, d, levels, ext)
                out = _F.wait_tensor(_F.all_gather_into_tensor(buf, k, gname))
                x = _ag_unpack(out, coord, d, levels, ext)
            elif mv.kind == A2A and mv.dst_dim != d:
                new = levels if mv.fused else ((mv.mesh_dim, mv.sf),)
                ext2 = (plan.src.shape[mv.dst_dim], before[mv.dst_dim], mesh_shape)
                buf = _a2a_pack(x, coord, d, mv.dst_dim, levels, new, ext)
                out = _F.wait_tensor(_F.all_to_all_single(buf, [1] * k, [1] * k, gname))
                x = _a2a_unpack(out, coord, d, mv.dst_dim, levels, new, ext, ext2)
            elif mv.kind == A2A:
                m, sf = levels[0]
                buf = _regroup_pack(x, coord, m, d, k, sf, mv.sf, ext)
                out = _F.wait_tensor(_F.all_to_all_single(buf, [1] * k, [1] * k, gname))
                x = _regroup_unpack(out, coord, m, d, k, sf, mv.sf, ext)
            else:  # pragma: no cover
                raise AssertionError(mv.kind)
    return x


@lru_cache(maxsize=8192)
def member_positions(U: int, levels: tuple, mesh_shape: tuple) -> tuple[tuple[int, ...], ...]:
    """Positions (of an extent of U) each member of the group over the levels' mesh dims keeps,
    after the levels are applied in order.  Members are numbered row-major over the sorted mesh
    dims, the rank order of DeviceMesh's (flattened) groups."""
    dims = sorted(m for m, _ in levels)
    ks = [mesh_shape[m] for m in dims]
    out = []
    for r in range(math.prod(ks)):
        coords, rest = {}, r
        for m, kk in zip(reversed(dims), reversed(ks)):
            coords[m] = rest % kk
            rest //= kk
        pos = list(range(U))
        for m, sf in levels:
            pos = [pos[p] for p in level_positions(len(pos), mesh_shape[m], sf)[coords[m]]]
        out.append(tuple(pos))
    return tuple(out)


def _member_index(coord, levels, mesh_shape):
    """This rank's member number in the group of the levels' mesh dims (int, or tensor if
    traced)."""
    r = 0
    for m in sorted(m for m, _ in levels):
        r = r * mesh_shape[m] + coord[m]
    return r


def _check_traceable(plan: RedistributePlan):
    mesh = plan.src.mesh
    for levels in plan.levels:
        for n, lv in zip(plan.src.shape, levels):
            if not levels_divide(n, lv, mesh.shape):
                raise ValueError(
                    f"cannot trace a rank-agnostic redistribution {plan.src} -> {plan.dst} of "
                    "shape "
                    f"{plan.src.shape}: shards are uneven, so local shapes differ by rank; run it "
                    f"eagerly (per-rank shapes) or pad the tensor to a multiple of the mesh size"
                )


def average(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x / n`` in ``x``'s dtype: the mean of an integer partial value rounds toward zero, as
    integer division does (an integer tensor stays one)."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return x / n
    return torch.div(x, n, rounding_mode="trunc")


# ---- rank-dependent selection --------------------------------------------------------------------
# Under tracing the coordinate is a tensor and every rank-dependent choice is a table lookup.


def _traced(coord) -> bool:
    return isinstance(coord, torch.Tensor)


def _extent(coord, ext) -> int:
    n, levels, mesh_shape = ext
    if _traced(coord):  # even shards: every rank has the same extent
        coord = (0,) * len(mesh_shape)
    return local_extent(n, levels, mesh_shape, coord)


def _pick(rows, c, device):
    """Row ``c`` of a per-coordinate table of index lists, as a LongTensor."""
    if isinstance(c, torch.Tensor):
        t = torch.tensor(rows, dtype=torch.long, device=device)
        index = c.reshape(1)
        if index.device != t.device:  # a meta-device model's program: the coordinate is on cpu
            index = index.to(t.device)
        return t.index_select(0, index).reshape(-1)
    return torch.tensor(rows[c], dtype=torch.long, device=device)


def _is_identity(idx) -> bool:
    return all(i == j for i, j in enumerate(idx))


def _take(x, dim, pos):
    if (
        len(pos) == 0
        or pos[-1] - pos[0] + 1 == len(pos)
        and pos == list(range(pos[0], pos[-1] + 1))
    ):
        return x.narrow(dim, pos[0] if pos else 0, len(pos))
    return x.index_select(dim, torch.tensor(pos, dtype=torch.long, device=x.device))


def _with_zero_slot(x, dim):
    """``x`` with one zero slice appended along ``dim``: index ``x.size(dim)`` then means
    padding."""
    shape = list(x.shape)
    shape[dim] = 1
    return torch.cat([x, x.new_zeros(shape)], dim)


def _pad_to(x, dim, size):
    if x.size(dim) == size:
        return x
    shape = list(x.shape)
    shape[dim] = size - x.size(dim)
    return torch.cat([x, x.new_zeros(shape)], dim)


# ---- local moves ---------------------------------------------------------------------------------


@per_rank
def _shard_local(x, coord, m, k, d, sf):
    rows = [list(p) for p in level_positions(x.size(d), k, sf)]
    if _traced(coord):
        return x.index_select(d, _pick(rows, coord[m], x.device)).contiguous()
    return _take(x, d, rows[coord[m]]).contiguous()


@per_rank
def _keep_on_coord0(x, coord, m):
    if _traced(coord):
        return x * (coord[m] == 0).to(x.dtype)
    return x if coord[m] == 0 else torch.zeros_like(x)


# ---- all-gather: pad, gather on dim 0, undo padding / striding -----------------------------------


def _gather_index(pos, P):
    """Index into k stacked chunks of P producing the group's extent in natural order."""
    inv = [0] * sum(len(p) for p in pos)
    for r, p in enumerate(pos):
        for t, u in enumerate(p):
            inv[u] = r * P + t
    return inv


@per_rank
def _ag_pack(x, coord, d, levels, ext):
    pos = member_positions(_extent(coord, ext), levels, ext[2])
    return _pad_to(x.movedim(d, 0), 0, max(len(p) for p in pos)).contiguous()


@per_rank
def _ag_unpack(out, coord, d, levels, ext):
    pos = member_positions(_extent(coord, ext), levels, ext[2])
    inv = _gather_index(pos, max(len(p) for p in pos))
    if not _is_identity(inv) or len(inv) != out.size(0):
        out = out.index_select(0, torch.tensor(inv, dtype=torch.long, device=out.device))
    return out.movedim(0, d).contiguous()


# ---- reduce-scatter: lay out each destination's positions contiguously, padded -------------------


@per_rank
def _rs_pack(x, d, levels, mesh_shape):
    pos = member_positions(x.size(d), levels, mesh_shape)
    k = len(pos)
    P = max(len(p) for p in pos)
    flat = [u for p in pos for u in p]
    y = x.movedim(d, 0)
    if P * k == x.size(d) and all(len(p) == P for p in pos):
        return (
            y if _is_identity(flat) else y.index_select(0, torch.tensor(flat, device=x.device))
        ).contiguous()
    return torch.cat([_pad_to(_take(y, 0, list(p)), 0, P) for p in pos], 0).contiguous()


@per_rank
def _rs_unpack(out, coord, d, levels, U, mesh_shape):
    if _traced(coord):  # even: nothing to trim
        return out.movedim(0, d).contiguous()
    n = len(member_positions(U, levels, mesh_shape)[_member_index(coord, levels, mesh_shape)])
    return out.narrow(0, 0, n).movedim(0, d).contiguous()


# ---- all-to-all between two tensor dims ----------------------------------------------------------


@per_rank
def _a2a_pack(x, coord, d, d2, levels, new, ext):
    """Slab s = what destination s keeps along d2, padded to uniform size; stacked on a new dim
    0."""
    pos = member_positions(_extent(coord, ext), levels, ext[2])
    pos2 = member_positions(x.size(d2), new, ext[2])
    P1, P2 = max(len(p) for p in pos), max(len(p) for p in pos2)
    slabs = [_pad_to(_pad_to(_take(x, d2, list(p)), d2, P2), d, P1) for p in pos2]
    return torch.stack(slabs, 0).contiguous()


@per_rank
def _a2a_unpack(out, coord, d, d2, levels, new, ext, ext2):
    pos = member_positions(_extent(coord, ext), levels, ext[2])
    k = len(pos)
    P1 = max(len(p) for p in pos)
    # out[r]: rank r's positions along d (padded to P1) x my positions along d2 (padded)
    pos2 = member_positions(_extent(coord, ext2), new, ext[2])
    n2 = len(pos2[0] if _traced(coord) else pos2[_member_index(coord, new, ext[2])])
    cat = torch.cat([out[r] for r in range(k)], d).narrow(d2, 0, n2)
    inv = _gather_index(pos, P1)
    if not _is_identity(inv) or len(inv) != cat.size(d):
        cat = cat.index_select(d, torch.tensor(inv, dtype=torch.long, device=out.device))
    return cat.contiguous()


# ---- all-to-all within one tensor dim (change of split factor, e.g. _StridedShard <-> Shard) -----


def _regroup_tables(U, k, sf, sf2):
    pos = level_positions(U, k, sf)  # who holds what now
    pos2 = level_positions(U, k, sf2)  # who must hold what
    where = {}
    for r, p in enumerate(pos):
        for t, u in enumerate(p):
            where[u] = (r, t)
    # send[c][s]: my local positions (holding coordinate c) that destination s needs, in s's order
    send = [
        [[where[u][1] for u in pos2[s] if where[u][0] == c] for s in range(k)] for c in range(k)
    ]
    Q = max(1, max(len(v) for row in send for v in row))
    return pos, pos2, send, Q


@per_rank
def _regroup_pack(x, coord, m, d, k, sf, sf2, ext):
    U = _extent(coord, ext)
    pos, _, send, Q = _regroup_tables(U, k, sf, sf2)
    slot = len(pos[0]) if _traced(coord) else x.size(d)  # index of the zero slot
    rows = [
        [i for s in range(k) for i in send[c][s] + [slot] * (Q - len(send[c][s]))] for c in range(k)
    ]
    xs = _with_zero_slot(x, d)
    idx = _pick(rows, coord[m], x.device)
    y = xs.index_select(d, idx).movedim(d, 0)
    return y.reshape((k, Q) + tuple(y.shape[1:])).contiguous()


@per_rank
def _regroup_unpack(out, coord, m, d, k, sf, sf2, ext):
    U = _extent(coord, ext)
    pos, pos2, send, Q = _regroup_tables(U, k, sf, sf2)
    # out[r, j]: the j-th element rank r sent me; rebuild my positions pos2[c] in order
    rows = []
    for c in range(k):
        seen = [0] * k
        row = []
        for u in pos2[c]:
            r = next(r for r in range(k) if u in pos[r])
            row.append(r * Q + seen[r])
            seen[r] += 1
        rows.append(row)
    flat = out.reshape((k * Q,) + tuple(out.shape[2:]))
    return flat.index_select(0, _pick(rows, coord[m], out.device)).movedim(0, d).contiguous()
