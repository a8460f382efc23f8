"""lower: the annotated global graph -> one per-rank graph of local ops and functional collectives.

The global graph is re-traced (``make_fx``) by an interpreter that runs every node on *local* fake
tensors: ops run unchanged on shards (that is what their sharding rule guarantees), shape arguments
of view-like ops become the local shapes of the node's output spec, redistribute nodes expand into
the planner's executor (functional collectives + waits), and vocab-parallel embeddings become masked
local lookups.  The rank's mesh coordinate is the graph's first input (an int64 tensor), so one
graph serves every rank where every shard is even.  A program with uneven shards (torch.chunk's
layout, as DTensor shards: the last ranks hold less, or nothing) has local shapes that differ by
rank: it is lowered per rank, with that rank's coordinate baked in (``lower_to_local(coord=)``;
``local_shape_classes`` groups ranks by local shapes), and simulated eagerly, every rank's shapes
at once.  Collectives on uneven shards pad each chunk to the group's largest and trim after, so
every rank runs the same collectives on the same sizes.  Process groups appear by name;
``bind_groups`` swaps the names for a concrete ``DeviceMesh``'s.  Every collective of the
per-rank graph records the planned step it runs (``info(node).carries``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch import (
    COLLECTIVE_OPS,
    Replicate,
    Shard,
    fake_mode,
    fake_mode_of,
    is_symbolic,
    per_rank,
    simulating,
    size_hint,
)
from ..core.cost import CostModel
from ..core.spec import ShardingSpec, is_even, local_extent, mesh_coords, placements_str
from ..ir import BOUNDARY, Collective, NodeKind, backward_nodes, info
from ..planner import plan_in_program, plan_is_even
from ..planner.execute import MeshGroups, execute_plan
from ..rules import EMBEDDING, GATHER, SCATTER_OPS, SHAPE_RANDOM_OPS
from ..rules.experts import (
    MOE_EXPERTS_BACKWARD,
    MOE_EXPERTS_DISPATCH,
    MOE_EXPERTS_DISPATCH_BACKWARD,
    VARIANTS,
    expert_blocks,
)
from ..rules.ops import GROUPED_MM_EXPERTS, GROUPED_MM_WEIGHT_GRAD, GROUPED_MM_WEIGHT_GRAD_EXPERTS
from ..rules.own import is_grouped_mm

aten = torch.ops.aten
# ops taking their output's global shape as an argument (at this position): the local one on a
# shard (DTensor's op_to_shape_and_stride_idx); new_empty_strided takes its strides next
_SIZE_ARG_OPS = {
    aten.view.default: 1,
    aten._unsafe_view.default: 1,
    aten.view_copy.default: 1,
    aten.reshape.default: 1,
    aten.expand.default: 1,
    aten.expand_copy.default: 1,
    aten.new_empty.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_full.default: 1,
    aten.new_empty_strided.default: 1,
    aten.select_backward.default: 1,
    aten.slice_backward.default: 1,
    **{
        getattr(aten, name).default: 2  # input_size: the full [N, C, ...] shape
        for name in (
            "upsample_nearest1d_backward",
            "upsample_nearest2d_backward",
            "upsample_nearest3d_backward",
            "_upsample_nearest_exact1d_backward",
            "_upsample_nearest_exact2d_backward",
            "_upsample_nearest_exact3d_backward",
            "_upsample_bilinear2d_aa_backward",
            "_upsample_bicubic2d_aa_backward",
            "upsample_bicubic2d_backward",
            "upsample_bilinear2d_backward",
            "upsample_linear1d_backward",
            "upsample_trilinear3d_backward",
        )
        if hasattr(aten, name)
    },
}

# squeeze without dims squeezes what is size 1 *locally*: a shard of size 1 would go too, so the
# dims come from the global shape (DTensor rewrites these the same way)
_SQUEEZE_DIMS = {
    aten.squeeze.default: aten.squeeze.dims,
    aten.squeeze.dim: aten.squeeze.dims,
    aten.squeeze.dims: aten.squeeze.dims,
    aten.squeeze_copy.default: aten.squeeze_copy.dims,
    aten.squeeze_copy.dim: aten.squeeze_copy.dims,
    aten.squeeze_copy.dims: aten.squeeze_copy.dims,
}


_SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})


def _splits_sharded_dim(n: fx.Node, rec) -> bool:
    x = n.args[0].meta["val"]
    dim = (n.args[2] if len(n.args) > 2 else 0) % max(x.ndim, 1)
    return bool(rec.input_specs[0].levels[dim])


def _squeeze_dims(n: fx.Node) -> list[int]:
    """The dims a squeeze removes in the global program: its dims (all) that are size 1."""
    shape = n.args[0].meta["val"].shape
    given = n.args[1] if len(n.args) > 1 else range(len(shape))
    dims = [given] if isinstance(given, int) else list(given)
    return sorted({d % len(shape) for d in dims if len(shape) and shape[d % len(shape)] == 1})


def _local_strides(global_strides, shape) -> list[int]:
    """Dense strides for ``shape`` in the dim order of ``global_strides`` (innermost last)."""
    order = sorted(range(len(shape)), key=lambda d: (global_strides[d], -d), reverse=True)
    out, step = [0] * len(shape), 1
    for d in reversed(order):
        out[d] = step
        step = step * torch.sym_max(shape[d], 1)  # per-rank SymInts under simulation
    return out


# ops taking their input's global N, C, H*W as int arguments (from this position; input at that one)
_SHAPE_SCALARS = {aten.native_group_norm.default: 3, aten.native_group_norm_backward.default: 5}
_SHAPE_SCALARS_INPUT = {
    aten.native_group_norm.default: 0,
    aten.native_group_norm_backward.default: 1,
}


class PlaceholderGroups:
    """Stand-in group names (``fxshard_mesh_dim_0``, ``fxshard_mesh_dims_0_1``) until
    ``bind_groups``."""

    def __getitem__(self, key):
        if isinstance(key, int):
            return f"fxshard_mesh_dim_{key}"
        return "fxshard_mesh_dims_" + "_".join(map(str, key))


def local_shape(spec: ShardingSpec, coord=None) -> tuple:
    """The local shape of ``spec`` on the rank at ``coord`` (ints; per-rank SymInts when
    simulating, giving per-rank sizes).  Without a coordinate the shards must be even (every rank
    has rank 0's shape)."""
    if coord is None:
        return spec.local_shape((0,) * spec.mesh.ndim)
    return per_rank(spec.local_shape)(coord)


def symbolic_dims(val: object) -> tuple[int, ...]:
    """The dims of a value of a symbolic graph whose size is a symbol (dynamic shapes)."""
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(d for d, n in enumerate(val.shape) if is_symbolic(n))


def local_sizes(val: object, spec: ShardingSpec, local: Sequence, given=None) -> list:
    """The local sizes of a value: ``local`` (the spec's, from its hinted shape), except in the
    dims whose size is symbolic (never split, so local = global): there the size the graph itself
    computes (``given``: the op's size argument, evaluated: a SymInt when traced, a number when
    run), else the value's own symbolic size."""
    out = list(local)
    for d in symbolic_dims(val):
        out[d] = given[d] if given is not None else val.shape[d]
    return out


def _traced(coord) -> bool:
    return isinstance(coord, torch.Tensor)


class _LocalInterpreter(fx.Interpreter):
    def __init__(self, gm, groups, coord, device=None):
        super().__init__(gm)
        self.groups = groups
        self.coord = coord
        self.device = device

    def local_shape(self, spec: ShardingSpec) -> tuple:
        # traced with a coordinate tensor: a rank-agnostic (even) program
        return local_shape(spec, None if _traced(self.coord) else self.coord)

    def run_node(self, n):
        rec = info(n)
        if rec.kind == NodeKind.REDISTRIBUTE:
            (x,) = self.map_nodes_to_values(n.args, n)
            return execute_plan(rec.plan, x, self.groups, self.coord)
        if n.op == "call_function" and n.target is BOUNDARY:
            return self.env[n.args[0]]
        if n.op == "call_function" and n.target in _SIZE_ARG_OPS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            i = _SIZE_ARG_OPS[n.target]
            args = list(args)
            args[i] = local_sizes(n.meta.get("val"), rec.spec, self.local_shape(rec.spec), args[i])
            if n.target is aten.new_empty_strided.default:
                args[i + 1] = _local_strides(args[i + 1], args[i])
            if n.target in (aten.view.default, aten._unsafe_view.default):
                # The global graph only views where the global layout allows it; local kernels (e.g.
                # attention on shards) may return other strides, so let reshape copy when it must.
                if simulating() and not _traced(self.coord):
                    # simulated ranks of different local shapes: the wrapper's strides are not
                    # every rank's, so reshape could pick a view a rank cannot take
                    args[0] = aten.clone.default(args[0], memory_format=torch.contiguous_format)
                return aten.reshape.default(*args, **kwargs)
            return n.target(*args, **kwargs)
        if n.target in _SPLITS and rec.input_specs and _splits_sharded_dim(n, rec):
            # a strided dim split into its pieces (rules.STRIDED_SPLIT_OPS): the local pieces'
            # sizes, not the global ones
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            dim = (args[2] if len(args) > 2 else 0) % args[0].ndim
            sizes = [self.local_shape(s)[dim] for s in rec.spec]
            return aten.split_with_sizes.default(args[0], sizes, dim)
        if n.op == "call_function" and n.target in _SQUEEZE_DIMS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return _SQUEEZE_DIMS[n.target](args[0], _squeeze_dims(n))
        if n.target in _SHAPE_SCALARS:
            # N, C and HxW are ints of the global shape: the local input's, on a shard
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            at, x = _SHAPE_SCALARS[n.target], args[_SHAPE_SCALARS_INPUT[n.target]]
            hxw = 1
            for d in x.shape[2:]:
                hxw *= d
            args = (*args[:at], x.shape[0], x.shape[1], hxw, *args[at + 3 :])
            return n.target(*args, **kwargs)
        if n.target in SHAPE_RANDOM_OPS and _sharded(rec.spec):
            return self._random(n, rec)
        if is_grouped_mm(n.target) and _experts_sharded(rec.input_specs):
            # expert parallelism: this rank's experts, on the rows of the global sorted tokens
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            offs = args[2] if len(args) > 2 else kwargs["offs"]
            first = _index_tensor(_first_index(rec.input_specs[1], self.coord))
            return GROUPED_MM_EXPERTS(args[0], args[1], offs, first)
        if n.target in VARIANTS:
            return self._experts(n, rec)
        if n.target is GROUPED_MM_WEIGHT_GRAD and rec.spec.levels[0]:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            first = _index_tensor(_first_index(rec.spec, self.coord))
            count = self.local_shape(rec.spec)[0]
            return GROUPED_MM_WEIGHT_GRAD_EXPERTS(*args, first, count)
        if (n.target is GATHER or n.target in SCATTER_OPS) and _split_along(n, rec):
            # loss parallel: entries of a tensor split along the indexed dim (the vocabulary),
            # gathered or written where this rank holds them (rules.own)
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            x, dim = args[0], args[1] % args[0].ndim
            first = _first_index(rec.input_specs[0], self.coord, dim)
            if n.target is GATHER:
                return _vocab_parallel_gather(x, dim, args[2], first)
            return _vocab_parallel_scatter(n.target, x, dim, args[2], args[3], first)
        if n.target is EMBEDDING and rec.input_specs and rec.input_specs[0].levels[0]:
            # the weight's rows (the vocabulary) are sharded: a masked local lookup, summed by the
            # plan
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return _vocab_parallel_embedding(args[0], args[1], rec.input_specs[0], self.coord)
        if (
            self.device is not None
            and n.op == "call_function"
            and "device" in n.kwargs
            and not n.all_input_nodes
        ):
            # factories made where the program was captured (e.g. meta) run where it is compiled
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return n.target(*args, **{**kwargs, "device": self.device})
        return super().run_node(n)

    def _experts(self, n: fx.Node, rec) -> object:
        """An experts region op (``rules.experts``; forward or backward): as it is, on this rank's
        rows, or with the experts split on a mesh dim: this rank's pairs (tokens replicated
        there) or token dispatch (tokens split there too)."""
        args, _ = self.fetch_args_kwargs_from_env(n)
        whole, local, dispatch = VARIANTS[n.target]
        n_tok = 4 if n.target is MOE_EXPERTS_BACKWARD else 3
        xspec, pspec = rec.input_specs[n_tok - 3], rec.input_specs[n_tok]
        split = [m for m, p in enumerate(pspec.placements) if isinstance(p, Shard)]
        if not split:
            return whole(*args)
        (m,) = split
        if isinstance(xspec.placements[m], Shard):
            starts = expert_blocks(pspec.shape[0], pspec.mesh.shape[m])
            return dispatch(*args, starts, self.groups[m])
        return local(*args, _index_tensor(_first_index(pspec, self.coord)))

    def _random(self, n: fx.Node, rec) -> object:
        """A random op with sharded outputs: draw the global tensor as the single-device program
        does (every rank the same draw, from the same generator state), keep this rank's shard."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.target is aten.native_dropout.default:
            x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
            if not train:
                return super().run_node(n)
            template = n.args[0].meta["val"]
            full = self._zeros_like_global(template, x)
            _, mask = aten.native_dropout.default(full, p, train)
            mask = self._shard(mask, rec.spec[1])
            scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
            out = aten.mul.Tensor(aten.mul.Tensor(x, mask), scale)  # native_dropout's own order
            return out, mask
        glob = []
        for a, v in zip(n.args, args):
            val = a.meta.get("val") if isinstance(a, fx.Node) else None
            glob.append(
                self._zeros_like_global(val, v)
                if isinstance(v, torch.Tensor) and isinstance(val, torch.Tensor)
                else v
            )
        return self._shard(n.target(*glob, **kwargs), rec.spec)

    @staticmethod
    def _zeros_like_global(val: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        # the global shape is every rank's: built from plain ints, not the local tensor's sizes
        return torch.zeros(tuple(int(s) for s in val.shape), dtype=local.dtype, device=local.device)

    def _shard(self, full: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
        """This rank's shard of a global value every rank holds (local slicing, no collective)."""
        rep = ShardingSpec.make(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype)
        return execute_plan(
            plan_in_program(rep, spec, CostModel(spec.mesh)),
            full,
            self.groups,
            self.coord,
        )


def _specs_of(gm: fx.GraphModule):
    for n in gm.graph.nodes:
        rec = info(n)
        for s in (rec.spec, *(rec.input_specs or ())):
            for x in s if isinstance(s, tuple) else (s,):
                if isinstance(x, ShardingSpec):
                    yield x


def is_uneven(gm: fx.GraphModule) -> bool:
    """Some value of the annotated graph, or some state one of its redistributions passes
    through, is sharded unevenly: local shapes differ by rank (the program is lowered per rank)."""
    if not all(is_even(s) for s in _specs_of(gm)):
        return True
    return any(
        not plan_is_even(info(n).plan)
        for n in gm.graph.nodes
        if info(n).kind == NodeKind.REDISTRIBUTE
    )


def local_shape_classes(gm: fx.GraphModule, mesh_shape: Sequence[int]) -> list[list[tuple]]:
    """The mesh coordinates grouped by the local shapes they give every value (ranks of one group
    run the same per-rank graph)."""
    specs = list(dict.fromkeys(_specs_of(gm)))
    groups: dict = {}
    for coord in mesh_coords(mesh_shape):
        key = tuple(s.local_shape(coord) for s in specs)
        groups.setdefault(key, []).append(coord)
    return list(groups.values())


def run_per_rank(gm: fx.GraphModule, groups, coord, local_args: Sequence) -> object:
    """Run an annotated global graph eagerly as the per-rank program would (the lowering's
    interpreter, not traced): ``local_args`` are this rank's (or simulated ranks') shards."""
    return _LocalInterpreter(gm, groups, coord).run(*local_args)


def _sharded(spec) -> bool:
    specs = spec if isinstance(spec, tuple) else (spec,)
    return any(isinstance(s, ShardingSpec) and s.num_shards > 1 for s in specs)


def _first_index(spec: ShardingSpec, coord, dim: int = 0):
    """The global index of this rank's first row of ``spec``'s dim ``dim`` (its length where the
    rank holds none): coordinate arithmetic on the traced coordinate (even rows), else per rank
    (torch.chunk's layout)."""
    if _traced(coord):  # even rows: offset = coordinate x rows per rank, as index arithmetic
        n = spec.shape[dim]
        offset = None
        for m, _sf in spec.levels[dim]:
            k = spec.mesh.shape[m]
            n = n // k
            term = coord[m] * n
            offset = term if offset is None else offset + term
        return offset
    return per_rank(_first_row)(spec, coord, dim)


def _index_tensor(index):
    """An index as the 0-d tensor an op takes (per rank where it differs by rank)."""
    if isinstance(index, torch.Tensor):
        return index
    return per_rank(lambda i: torch.scalar_tensor(i, dtype=torch.long))(index)


def _experts_sharded(input_specs) -> bool:
    """A grouped matmul whose weight's experts (dim 0) are split over ranks."""
    w = input_specs[1] if len(input_specs) > 1 else None
    return isinstance(w, ShardingSpec) and bool(w.levels[0])


def _vocab_parallel_embedding(weight, indices, wspec, coord):
    """Rows outside this rank's vocab slice contribute zeros; the sum over ranks is the lookup
    (uneven rows: torch.chunk's layout; an empty shard: all masked)."""
    offset = _first_index(wspec, coord)
    local = indices - offset
    mask = (local < 0) | (local >= weight.shape[0])
    # an empty shard (fewer rows than ranks) looks up a zero row instead of indexing nothing
    table = weight if weight.shape[0] else weight.new_zeros((1, *weight.shape[1:]))
    out = aten.embedding.default(table, local.masked_fill(mask, 0))
    return out.masked_fill(mask.unsqueeze(-1), 0)


def _first_row(wspec: ShardingSpec, coord, dim: int = 0) -> int:
    rows = wspec.local_indices(coord, dim)
    return rows[0] if rows else wspec.shape[dim]


def _split_along(n: fx.Node, rec) -> bool:
    """A gather / scatter whose ``self`` is split along the dim it indexes."""
    spec = rec.input_specs[0] if rec.input_specs else None
    if not isinstance(spec, ShardingSpec) or not spec.shape:
        return False
    return bool(spec.levels[n.args[1] % len(spec.shape)])


def _masked_local(index, first, size):
    """The local positions of global ``index`` entries in a block of ``size`` starting at
    ``first``, and where they fall outside it."""
    local = index - first
    return local, (local < 0) | (local >= size)


def _vocab_parallel_gather(x, dim, index, first):
    """Entries outside this rank's slice of ``dim`` gather zeros; the sum over ranks is the
    gather (uneven slices: torch.chunk's layout; an empty slice: all masked)."""
    local, mask = _masked_local(index, first, x.shape[dim])
    if x.shape[dim] == 0:
        x = x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1 :]))
    return aten.gather.default(x, dim, local.masked_fill(mask, 0)).masked_fill(mask, 0)


def _vocab_parallel_scatter(op, x, dim, index, value, first):
    """Entries outside this rank's slice of ``dim`` write into a spare slot, dropped after."""
    n = x.shape[dim]
    local, mask = _masked_local(index, first, n)
    spare = x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1 :]))
    out = op(torch.cat([x, spare], dim), dim, local.masked_fill(mask, n), value)
    return out.narrow(dim, 0, n)


def lower_to_local(
    gm: fx.GraphModule,
    mesh_ndim: int,
    device: torch.device | str | None = None,
    coord: tuple[int, ...] | None = None,
) -> fx.GraphModule:
    """The per-rank graph: inputs ``(coord, *local placeholders)``, outputs local shards.

    ``device``: where the graph will run (factory ops are moved there); default: where it was
    captured.  ``coord``: the rank it is lowered for, baked in (needed where shards are uneven;
    the graph's coordinate input is then unused); None: one rank-agnostic graph (even shards)."""
    groups = PlaceholderGroups()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    device = torch.device(device) if device is not None else None
    fixed = tuple(int(c) for c in coord) if coord is not None else None

    def run(coord, *args):
        where = coord if fixed is None else fixed
        return _LocalInterpreter(gm, groups, where, device).run(*args)

    vals = [p.meta.get("val") for p in placeholders]
    # a symbolic graph (dynamic shapes) is traced in its own fake mode: its sizes' symbols
    symbolic = any(symbolic_dims(v) for v in vals)
    fm = fake_mode_of(vals) if symbolic else fake_mode(allow_non_fake_inputs=True)
    with fm:
        fakes = [torch.zeros(mesh_ndim, dtype=torch.long, device=device)]
        for p, val in zip(placeholders, vals):
            spec = info(p).spec
            where = (
                device
                if device is not None
                else (val.device if isinstance(val, torch.Tensor) else None)
            )
            sizes = local_sizes(val, spec, local_shape(spec, fixed))
            fakes.append(torch.empty(sizes, dtype=spec.dtype, device=where))
    local = make_fx(run, tracing_mode="fake")(*fakes)
    # name the inputs after the global graph's placeholders (the first is the mesh coordinate)
    names = ["mesh_coord"] + [p.name for p in placeholders]
    for node, name in zip([n for n in local.graph.nodes if n.op == "placeholder"], names):
        node.name = node.target = name
    _record_collectives(local, gm, fixed if fixed is not None else (0,) * mesh_ndim)
    local.graph.lint()
    local.recompile()
    return local


def planned_collectives(gm: fx.GraphModule) -> list[Collective]:
    """Every collective step of every redistribution of the annotated global graph, in graph order
    (the order lowering emits them)."""
    out = []
    backward = backward_nodes(gm.graph)
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.kind != NodeKind.REDISTRIBUTE:
            continue
        where = f"{rec.module}: " if rec.module else ""
        for step, nbytes in rec.plan.collective_bytes():
            out.append(
                Collective(
                    step.collective,
                    step.mesh_dims,
                    nbytes,
                    step.cost,
                    n.name,
                    f"{where}{rec.provenance}",
                    f"{placements_str((step.src,))}->{placements_str((step.dst,))}",
                    "backward" if n in backward else "forward",
                )
            )
    return out


def _own_bytes(gm: fx.GraphModule, coord) -> list[float]:
    """Per collective step, in ``planned_collectives`` order: the bytes of local data the members
    of ``coord``'s group bring to it, on average (every member's buffer is padded to one size:
    what it holds beyond its data is padding)."""
    out = []
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.kind != NodeKind.REDISTRIBUTE:
            continue
        plan = rec.plan
        mesh = plan.src.mesh.shape
        for step, levels in zip(plan.steps, plan.levels):
            if not step.collective:
                continue
            members = [
                tuple(
                    m[step.mesh_dims.index(d)] if d in step.mesh_dims else c
                    for d, c in enumerate(coord)
                )
                for m in itertools.product(*(range(mesh[d]) for d in step.mesh_dims))
            ]
            total = 0
            for member in members:
                numel = 1
                for size, lv in zip(plan.src.shape, levels):
                    numel *= local_extent(size, lv, mesh, member)
                total += numel
            out.append(total / len(members) * plan.src.dtype.itemsize)
    return out


def _record_collectives(local: fx.GraphModule, gm: fx.GraphModule, coord: tuple) -> None:
    """Each collective of the per-rank graph carries its planned step: lowering emits them in the
    global graph's order, one functional collective per collective step."""
    planned = planned_collectives(gm)
    nodes = collective_nodes(local)
    if len(nodes) != len(planned):  # pragma: no cover - would be a lowering bug
        raise AssertionError(
            f"fxshard.lower: {len(nodes)} collectives in the per-rank graph for {len(planned)} "
            f"planned"
        )
    own = _own_bytes(gm, coord)
    for n, c, mine in zip(nodes, planned, own):
        v = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        sent = size_hint(v.numel()) * v.element_size() if isinstance(v, torch.Tensor) else mine
        info(n).carries = (dataclasses.replace(c, padding=max(0, round(sent - mine))),)


def bind_groups(local: fx.GraphModule, groups: MeshGroups) -> fx.GraphModule:
    """A copy of ``local`` whose collectives use the process groups ``groups`` (one name per mesh
    dim)."""
    out = copy.deepcopy(local)
    for n in out.graph.nodes:
        if n.op == "call_function" and (
            n.target in COLLECTIVE_OPS
            or n.target in (MOE_EXPERTS_DISPATCH, MOE_EXPERTS_DISPATCH_BACKWARD)
        ):
            name = n.args[-1]
            if isinstance(name, str) and name.startswith("fxshard_mesh_dim_"):
                n.args = (*n.args[:-1], groups[int(name.rsplit("_", 1)[1])])
            elif isinstance(name, str) and name.startswith("fxshard_mesh_dims_"):
                dims = tuple(int(x) for x in name[len("fxshard_mesh_dims_") :].split("_"))
                n.args = (*n.args[:-1], groups[dims])
    out.recompile()
    return out


def collective_nodes(local: fx.GraphModule) -> list[fx.Node]:
    return [n for n in local.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]
