"""lower: the annotated global graph -> one per-rank graph of local ops and functional collectives.

The global graph is re-traced (``make_fx``) by an interpreter that runs every node on *local* fake
tensors: ops run unchanged on shards (that is what their sharding rule guarantees), shape arguments
of view-like ops become the local shapes of the node's output spec, redistribute nodes expand into
the planner's executor (functional collectives + waits), and vocab-parallel embeddings become masked
local lookups.  The rank's mesh coordinate is the graph's first input (an int64 tensor), so one
graph serves every rank.  Process groups appear by name; ``bind_groups`` swaps the names for a
concrete ``DeviceMesh``'s.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from ..planner.execute import execute_plan
from .capture import BOUNDARY, info

aten = torch.ops.aten
_SIZE_ARG_OPS = {aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1,
                 aten.expand.default: 1, aten.new_empty.default: 1, aten.new_zeros.default: 1,
                 aten.new_ones.default: 1, aten.new_full.default: 1}
COLLECTIVE_OPS = {torch.ops._c10d_functional.all_gather_into_tensor.default,
                  torch.ops._c10d_functional.reduce_scatter_tensor.default,
                  torch.ops._c10d_functional.all_reduce.default,
                  torch.ops._c10d_functional.all_to_all_single.default}


class PlaceholderGroups:
    """Stand-in group names (``fxshard_mesh_dim_0``, ``fxshard_mesh_dims_0_1``) until ``bind_groups``."""

    def __getitem__(self, key):
        if isinstance(key, int):
            return f"fxshard_mesh_dim_{key}"
        return "fxshard_mesh_dims_" + "_".join(map(str, key))


def placeholder_group_names(ndim: int) -> PlaceholderGroups:
    return PlaceholderGroups()


def local_shape(spec) -> tuple[int, ...]:
    # even shardings only (annotate guarantees it): every rank has the shape of rank 0
    return spec.local_shape((0,) * spec.mesh.ndim)


class _LocalInterpreter(fx.Interpreter):
    def __init__(self, gm, groups, coord, device=None):
        super().__init__(gm)
        self.groups = groups
        self.coord = coord
        self.device = device

    def run_node(self, n):
        rec = info(n)
        if rec.kind == "redistribute":
            (x,) = self.map_nodes_to_values(n.args, n)
            return execute_plan(rec.plan, x, self.groups, self.coord)
        if n.op == "call_function" and n.target is BOUNDARY:
            return self.env[n.args[0]]
        if n.op == "call_function" and n.target in _SIZE_ARG_OPS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            i = _SIZE_ARG_OPS[n.target]
            args = list(args)
            args[i] = list(local_shape(rec.spec))
            if n.target in (aten.view.default, aten._unsafe_view.default):
                # The global graph only views where the global layout allows it; local kernels (e.g.
                # attention on shards) may return other strides, so let reshape copy when it must.
                return aten.reshape.default(*args, **kwargs)
            return n.target(*args, **kwargs)
        if n.op == "call_function" and rec.extra.get("vocab_dims"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return _vocab_parallel_embedding(args[0], args[1], info(n).input_specs[0], self.coord)
        if self.device is not None and n.op == "call_function" and "device" in n.kwargs and not n.all_input_nodes:
            # factories made where the program was captured (e.g. meta) run where it is compiled
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            return n.target(*args, **{**kwargs, "device": self.device})
        return super().run_node(n)


def _vocab_parallel_embedding(weight, indices, wspec, coord):
    """Rows outside this rank's vocab slice contribute zeros; the sum over ranks is the lookup."""
    n = wspec.shape[0]
    offset = None
    for m, _sf in wspec.levels[0]:
        k = wspec.mesh.shape[m]
        n = n // k
        term = coord[m] * n
        offset = term if offset is None else offset + term
    local = indices - offset
    mask = (local < 0) | (local >= weight.shape[0])
    out = aten.embedding.default(weight, local.masked_fill(mask, 0))
    return out.masked_fill(mask.unsqueeze(-1), 0)


def lower_to_local(gm: fx.GraphModule, mesh_ndim: int, groups=None, device=None) -> fx.GraphModule:
    """The per-rank graph: inputs ``(coord, *local placeholders)``, outputs local shards.

    ``device``: where the graph will run (factory ops are moved there); default: where it was captured."""
    groups = groups if groups is not None else placeholder_group_names(mesh_ndim)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    device = torch.device(device) if device is not None else None

    def run(coord, *args):
        return _LocalInterpreter(gm, groups, coord, device).run(*args)

    fm = FakeTensorMode(allow_non_fake_inputs=True)
    with fm:
        fakes = [torch.zeros(mesh_ndim, dtype=torch.long, device=device)]
        for p in placeholders:
            spec = info(p).spec
            val = p.meta.get("val")
            where = device if device is not None else (val.device if isinstance(val, torch.Tensor) else None)
            fakes.append(torch.empty(local_shape(spec), dtype=spec.dtype, device=where))
    local = make_fx(run, tracing_mode="fake")(*fakes)
    # name the inputs after the global graph's placeholders (the first is the mesh coordinate)
    names = ["mesh_coord"] + [p.name for p in placeholders]
    for node, name in zip([n for n in local.graph.nodes if n.op == "placeholder"], names):
        node.name = node.target = name
    local.graph.lint()
    local.recompile()
    return local


def bind_groups(local: fx.GraphModule, groups) -> fx.GraphModule:
    """A copy of ``local`` whose collectives use the process groups ``groups`` (one name per mesh dim)."""
    out = copy.deepcopy(local)
    for n in out.graph.nodes:
        if n.op == "call_function" and n.target in COLLECTIVE_OPS:
            name = n.args[-1]
            if isinstance(name, str) and name.startswith("fxshard_mesh_dim_"):
                n.args = (*n.args[:-1], groups[int(name.rsplit("_", 1)[1])])
            elif isinstance(name, str) and name.startswith("fxshard_mesh_dims_"):
                dims = tuple(int(x) for x in name[len("fxshard_mesh_dims_"):].split("_"))
                n.args = (*n.args[:-1], groups[dims])
    out.recompile()
    return out


def collective_nodes(local: fx.GraphModule) -> list[fx.Node]:
    return [n for n in local.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]
