"""Dynamic shapes: one sharded program for every size of the dims dynamo made dynamic.

Dynamo makes a dim dynamic once a graph was called with a second size of it (a KV cache that grows
by a token per call, an attention mask, a prompt of another length) and hands the backend a graph
whose placeholders have symbolic sizes.  Capturing and compiling once per size would cost a
trace, a plan and an Inductor compile per generated token, so the backend captures such a graph
symbolically once (``capture.dynamo``: the dynamic dims are SymInts of a ShapeEnv of fxshard's own)
and keeps both views of it:

* the *hinted* twin (``hinted``): every SymInt at the value it had in the call that built the
  program, shape computations folded into numbers.  Node for node the symbolic graph, with the
  same names; the planning stages see a concrete program, as for any other graph.  A dynamic dim
  is never sharded: its hinted values carry the dims that must stay whole (``whole_dims``), and
  ``PlacementProblem.spec`` refuses a placement that splits one, so every placement the stages
  choose holds for any size of those dims.
* the *symbolic* graph: after placement, the annotated graph gets its symbolic values and shape
  arguments back (``restore``) and is lowered and compiled (Inductor, dynamic kernels) from them.

The ShapeEnv's guards (what the trace and Inductor assumed of the sizes: relations between them,
ranges) are checked on every call (``runtime``: ``shape_guards``); a call that fails them builds
another program.  Where a symbolic program cannot be built (a plan that shards a dynamic dim, a
training graph, a shape that depends on tensor values) the backend falls back to one program per
size, logged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from .._torch import (
    SHAPE_ASSERT_OPS,
    fake_mode,
    is_sym_value,
    is_symbolic,
    same_symbol,
    size_hint,
)
from ..ir import NodeKind, NotSymbolic, flat_args, info, whole_dims


@dataclass(frozen=True)
class DynamicDims:
    """Which arguments of a dynamo graph vary in size between calls: ``tensors`` maps an argument
    index to its dynamic dims; ``sizes`` maps a SymInt argument to the (tensor argument, dim) whose
    size it is; ``free`` lists the other dynamic ints (a cache's length counter: they come into
    the program as tensors of that length, ``capture.dynamo.size_carrier``)."""

    tensors: dict
    sizes: dict
    free: tuple = ()  # dynamic int arguments that are no tensor's size (taken as size carriers)

    @classmethod
    def of(cls, gm: fx.GraphModule) -> DynamicDims | None:
        """From the example values dynamo gave the graph's placeholders; None for a static graph."""
        vals = [p.meta.get("example_value") for p in gm.graph.nodes if p.op == "placeholder"]
        tensors = {}
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                dims = tuple(d for d, s in enumerate(v.shape) if is_symbolic(s))
                if dims:
                    tensors[i] = dims
        sizes, free = {}, []
        for i, v in enumerate(vals):
            if not is_symbolic(v) or not isinstance(v, torch.SymInt):
                continue
            for j, dims in tensors.items():
                d = next((d for d in dims if same_symbol(vals[j].shape[d], v)), None)
                if d is not None:
                    sizes[i] = (j, d)
                    break
            else:
                free.append(i)
        if not tensors and not free:
            return None
        return cls(tensors, sizes, tuple(free))

    def static_key(self, args) -> tuple:
        """The part of a call's signature a symbolic program is specific to: every size but the
        dynamic ones."""
        out = []
        tensors = self.tensors
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                dims = tensors.get(i)
                shape = (
                    tuple(None if d in dims else s for d, s in enumerate(a.shape))
                    if dims
                    else a.shape  # (most arguments: parameters; a Size hashes as its tuple)
                )
                out.append((shape, a.dtype, a.device))
            elif i in self.sizes or i in self.free:
                out.append(None)
            else:
                out.append(int(a) if isinstance(a, (int, torch.SymInt)) else (type(a), a))
        return tuple(out)


@dataclass
class SymbolicGraph:
    """A symbolic capture: the ATen graph with SymInt sizes (``gm``), its fake mode (its ShapeEnv
    holds the guards) and the fakes / SymInts standing for the dynamo graph's arguments
    (``inputs``, argument order; None for an argument baked in as its value)."""

    gm: fx.GraphModule
    mode: object
    inputs: list


def _hint(x):
    h = size_hint(x)
    if h is None:
        raise NotSymbolic("a size depends on tensor values (no hint)")
    return h


def _hinted_value(v, mode):
    if isinstance(v, torch.Tensor):
        with mode:
            t = torch.empty_strided(
                [_hint(s) for s in v.shape],
                [_hint(s) for s in v.stride()],
                dtype=v.dtype,
                device=v.device,
            )
        dims = tuple(d for d, s in enumerate(v.shape) if is_symbolic(s))
        if dims:
            t._fxshard_dynamic = dims
        return t
    if isinstance(v, (tuple, list)):
        return type(v)(_hinted_value(x, mode) for x in v)
    if is_sym_value(v):
        return _hint(v)
    return v


def is_shape_node(n: fx.Node) -> bool:
    """A node of a symbolic trace that computes a size (or asserts on one), not a tensor."""
    if n.op != "call_function":
        return False
    return is_sym_value(n.meta.get("val")) or n.target in SHAPE_ASSERT_OPS


def hinted(gm: fx.GraphModule) -> fx.GraphModule:
    """The concrete twin of a symbolic graph: the same nodes under the same names, with every
    size at its hint, shape computations folded into their values and their asserts dropped;
    each node's record is its own copy."""
    graph = fx.Graph()
    env: dict = {}
    mode = fake_mode(allow_non_fake_inputs=True)
    for n in gm.graph.nodes:
        if is_shape_node(n):
            if n.target not in SHAPE_ASSERT_OPS:
                env[n] = _hint(n.meta["val"])
            continue
        new = graph.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        new.meta["val"] = _hinted_value(n.meta.get("val"), mode)
        if "fxshard" in n.meta:
            new.meta["fxshard"] = dataclasses.replace(info(n))
        env[n] = new
    out = fx.GraphModule(gm, graph)
    out.meta.update(gm.meta)
    return out


def _pairs(a, b, out: list) -> None:
    """(leaf of ``a``, leaf of ``b``) of two argument structures, which must be alike."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            raise NotSymbolic("a node's arguments differ between the symbolic and the hinted graph")
        for x, y in zip(a, b):
            _pairs(x, y, out)
    elif isinstance(a, dict) or isinstance(b, dict):
        if not isinstance(a, dict) or not isinstance(b, dict) or a.keys() != b.keys():
            raise NotSymbolic("a node's keyword arguments differ")
        for k in a:
            _pairs(a[k], b[k], out)
    else:
        out.append((a, b))


def restore(annotated: fx.GraphModule, symbolic: fx.GraphModule) -> fx.GraphModule:
    """The annotated (hinted) graph with the symbolic graph's values and shape arguments put back:
    what lowering traces into a per-rank graph with symbolic sizes.  Placements, redistribute
    nodes and records are the annotated graph's; a shape computation is copied in before its first
    use, reading the tensors it measures from their producers (a dynamic dim is whole on every
    rank, so a local tensor's size there is the global one)."""
    g = fx.Graph()
    env: dict = {}
    for n in annotated.graph.nodes:
        new = g.node_copy(n, lambda a: env[a])
        new.meta = dict(n.meta)
        if "fxshard" in n.meta:
            new.meta["fxshard"] = dataclasses.replace(info(n))
        env[n] = new
    out = fx.GraphModule(annotated, g)
    by_name = {n.name: n for n in out.graph.nodes}
    sym_nodes = {n.name: n for n in symbolic.graph.nodes}
    copied: dict = {}

    def copy_shape(s: fx.Node, before: fx.Node) -> fx.Node:
        if s in copied:
            return copied[s]

        def arg(a):
            if not isinstance(a, fx.Node):
                return a
            if is_shape_node(a):
                return copy_shape(a, before)
            mine = by_name.get(a.name)
            if mine is None:
                raise NotSymbolic(f"{a.name} (measured by {s.name}) is not in the program")
            return mine

        with out.graph.inserting_before(before):
            c = out.graph.create_node(
                s.op, s.target, fx.node.map_aggregate(s.args, arg),
                fx.node.map_aggregate(s.kwargs, arg),
            )  # fmt: skip
        c.meta = dict(s.meta)
        copied[s] = c
        return c

    for n in list(out.graph.nodes):
        rec = info(n)
        s = sym_nodes.get(n.name)
        if s is None or s.op != n.op or s.target != n.target:
            if rec.kind == NodeKind.REDISTRIBUTE:
                n.meta["val"] = n.args[0].meta["val"]
                continue
            raise NotSymbolic(f"node {n.name} of the program has no symbolic counterpart")
        if n.op != "output":
            n.meta["val"] = s.meta.get("val")
        if n.op not in ("call_function", "output"):
            continue
        # the size arguments, and sizes the program returns (a cache's length counter: dynamo
        # stores it into an attribute), are the symbolic graph's computations again
        pairs: list = []
        _pairs((n.args, n.kwargs), (s.args, s.kwargs), pairs)
        shaped = [isinstance(b, fx.Node) and is_shape_node(b) for _, b in pairs]
        if not any(shaped):
            continue
        leaves = iter([copy_shape(b, n) if sh else a for (a, b), sh in zip(pairs, shaped)])
        n.args, n.kwargs = _map_leaves((n.args, n.kwargs), lambda _a, it=leaves: next(it))
    # asserts on sizes (ranges, relations a decomposition checked at run time) come along too
    last = next(n for n in out.graph.nodes if n.op == "output")
    for s in symbolic.graph.nodes:
        if s.op == "call_function" and s.target in SHAPE_ASSERT_OPS and s not in copied:
            if all(not isinstance(a, fx.Node) or is_shape_node(a) for a in flat_args(s.args)):
                copy_shape(s, last)
    out.graph.lint()
    out.recompile()
    return out


def _map_leaves(x, fn):
    if isinstance(x, (list, tuple)):
        return type(x)(_map_leaves(y, fn) for y in x)
    if isinstance(x, dict):
        return {k: _map_leaves(v, fn) for k, v in x.items()}
    return fn(x)


def splits_dynamic(gm: fx.GraphModule) -> str | None:
    """Where the placed (hinted) graph splits a dynamic dim (a given placement, a redistribution's
    intermediate state): a description, or None where no placement does."""
    from ..core.spec import ShardingSpec

    def bad(spec, val) -> bool:
        dims = whole_dims(val)
        return isinstance(spec, ShardingSpec) and any(spec.levels[d] for d in dims)

    for n in gm.graph.nodes:
        rec = info(n)
        val = n.meta.get("val")
        specs = rec.spec if isinstance(rec.spec, tuple) else (rec.spec,)
        vals = val if isinstance(val, (tuple, list)) else (val,)
        for spec, v in zip(specs, vals):
            if bad(spec, v):
                return f"{n.name} is placed {spec}"
        if rec.kind == NodeKind.REDISTRIBUTE and rec.plan is not None:
            dims = whole_dims(val)
            for levels in rec.plan.levels:
                if any(levels[d] for d in dims):
                    return f"{n.name} passes through a state that splits dim {dims}"
    return None


__all__ = [
    "DynamicDims",
    "SymbolicGraph",
    "NotSymbolic",
    "hinted",
    "restore",
    "splits_dynamic",
    "is_shape_node",
]
