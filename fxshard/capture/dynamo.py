"""The ATen graph of a dynamo graph (the ``torch.compile`` backend).

Dynamo hands the backend a torch-level graph whose placeholders are the frame's tensors, parameters
included (named by their dynamo sources, e.g. ``L['self']._modules['fc1']._parameters['weight']``).
It is re-traced on this call's arguments into ATen (``make_fx``, or the joint forward+backward under
autograd), with planned module boundaries marked from ``nn_module_stack`` (hooks would be exact, but
dynamo has already traced).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from collections.abc import Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.traceback import preserve_node_meta

from .._torch import (
    describe,
    fake_mode,
    functionalized,
    is_fake,
    placeholder_source,
    symbolic_empty,
    symbolic_fake,
    symbolic_fake_mode,
)
from ..ir import BOUNDARY, BUFFER, CONSTANT, INPUT, PARAM, Role, info
from .common import (
    Captured,
    check_no_input_mutation,
    decomposition_table,
    drop_trace_checks,
    lift_constants,
    normalize_source,
    path_fqn,
    record,
    source_root,
)
from .joint import capture_joint
from .regions import expert_regions
from .symbolic import DynamicDims, SymbolicGraph, hinted

_SOURCE_PART = re.compile(
    r"\.(_modules|_parameters|_buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z_0-9]*)"
)


def source_fqn(source_name: str, roots: dict | None = None) -> tuple[str, str | None]:
    """(kind, FQN) of a dynamo placeholder source such as
    ``L['self']._modules['fc1']._parameters['weight']`` -> (param, "fc1.weight"); ``roots`` gives
    the FQN prefix of frame locals that are submodules (``{"layer": "layers.1."}``)."""
    source_name = normalize_source(source_name)
    root = source_root(source_name)
    if root is None:
        return INPUT, None
    parts, kind = [], INPUT
    for a, b, attr in _SOURCE_PART.findall(source_name[root[3] :]):
        if attr:
            parts.append(attr)
        else:
            parts.append(b)
            if a == "_parameters":
                kind = PARAM
            elif a == "_buffers":
                kind = BUFFER
    if kind == INPUT or not source_name.startswith("L["):
        return INPUT, None
    return kind, (roots or {}).get(root[0], "") + ".".join(parts)


def _module_path(node: fx.Node, roots: dict | None = None) -> list[str]:
    return [
        path_fqn(path, roots) for path, _cls in (node.meta.get("nn_module_stack") or {}).values()
    ]


def _insert_dynamo_boundaries(
    gm: fx.GraphModule, boundaries: dict[str, tuple[int, int]], own, roots=None
) -> None:
    """Mark planned module boundaries in a dynamo graph from its ``nn_module_stack`` metadata.

    A module's inputs are the tensors its nodes consume that are made outside it (not its own
    parameters / buffers), in order of first use; its outputs are the values it makes that are used
    outside it, in order of production.  Hooks would be exact, but dynamo has already traced."""
    graph = gm.graph

    def members_of(fqn):
        return [
            n
            for n in graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and fqn in _module_path(n, roots)
        ]

    def mark(value, fqn, tag, like):
        b = graph.call_function(BOUNDARY, (value, tag))
        b.meta.update(
            {k: v for k, v in like.meta.items() if k not in ("example_value", "nn_module_stack")}
        )
        b.meta["example_value"] = value.meta.get("example_value")
        stack = {}
        for key, (path, cls) in (like.meta.get("nn_module_stack") or {}).items():
            stack[key] = (path, cls)
            if path_fqn(path, roots) == fqn:
                break
        b.meta["nn_module_stack"] = stack  # inside the module, outside its children
        return b

    depth = lambda fqn: fqn.count(".")
    # inputs outermost first (an inner module's input is then the outer boundary), outputs innermost
    # first
    for fqn in sorted(boundaries, key=depth):
        n_in = boundaries[fqn][0]
        inside = members_of(fqn)
        if not n_in or not inside:
            continue  # the module is not called in this graph (graph break, or unused)
        members = set(inside)
        ins = []
        for n in inside:
            for a in n.all_input_nodes:
                if a in members or a in ins or not _is_tensor(a):
                    continue
                if a.op == "placeholder" and own(a, fqn):
                    continue
                ins.append(a)
        for i, a in enumerate(ins[:n_in]):
            with graph.inserting_before(inside[0]):
                b = mark(a, fqn, f"{fqn}:in:{i}", inside[0])
            for n in inside:
                n.replace_input_with(a, b)
    for fqn in sorted(boundaries, key=depth, reverse=True):
        n_out = boundaries[fqn][1]
        inside = members_of(fqn)
        if not n_out or not inside:
            continue
        members = set(inside)
        outs = [n for n in inside if any(u not in members for u in n.users) and _is_tensor(n)]
        if len(outs) > n_out:  # a module returns its last value(s); other escapes are internals
            outs = outs[-n_out:]
        for i, o in enumerate(outs):
            users = [u for u in o.users if u not in members]
            with graph.inserting_after(o):
                b = mark(o, fqn, f"{fqn}:out:{i}", o)
            for u in users:
                u.replace_input_with(o, b)
    graph.lint()
    gm.recompile()


def _is_tensor(n: fx.Node) -> bool:
    v = n.meta.get("example_value", n.meta.get("val"))
    return isinstance(v, torch.Tensor)


def dynamo_sources(gm: fx.GraphModule) -> list[str | None]:
    """Every placeholder's dynamo source name; read them in the backend call (dynamo drops them
    after)."""
    return [placeholder_source(p) for p in gm.graph.nodes if p.op == "placeholder"]


def _state_updates_as_outputs(traced: fx.GraphModule, kinds: Sequence[tuple]) -> None:
    """Functionalization writes a buffer updated in forward back with ``copy_`` into its
    placeholder: make the new value an output instead (role ``("mutate", fqn)``; a user input's:
    ``("mutate_input", input index)``), which the program hands back and the caller copies into
    the buffer or input, as eager PyTorch updates it."""
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    fqn = {p: k[1] for p, k in zip(placeholders, kinds) if k[0] in (PARAM, BUFFER)}
    # user inputs updated in place (a static KV cache's tensors): by their input index
    inputs = [p for p, k in zip(placeholders, kinds) if k[0] == INPUT]
    role_of = {p: Role("mutate", f) for p, f in fqn.items()}
    role_of.update({p: Role("mutate_input", i) for i, p in enumerate(inputs)})
    out = next(n for n in traced.graph.nodes if n.op == "output")
    updates = []
    for n in list(traced.graph.nodes):
        if (
            n.op == "call_function"
            and n.target is torch.ops.aten.copy_.default
            and n.args[0] in role_of
            and not n.users
        ):
            updates.append((role_of[n.args[0]], n.args[1]))
            traced.graph.erase_node(n)
    if not updates:
        return
    flat = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    info(out).roles = tuple([Role("output", i) for i in range(len(flat))] + [r for r, _ in updates])
    out.args = (tuple(flat) + tuple(v for _, v in updates),)
    traced.recompile()


def capture_dynamo_graph(
    gm: fx.GraphModule,
    args: Sequence,
    boundaries: dict[str, tuple[int, int]] | None = None,
    roots: dict[str, str] | None = None,
    sources: Sequence[str | None] | None = None,
    training: bool = False,
    dynamic: DynamicDims | None = None,
    experts: dict | None = None,
    mesh_shape: Sequence[int] = (),
) -> Captured:
    """A dynamo graph + this call's concrete arguments -> a Captured ATen graph (``training``: the
    joint forward+backward graph, parameters' gradients as gradients of those inputs).

    Shapes are specialised to ``args``, except with ``dynamic`` (forward graphs): its dims are
    traced symbolically (``capture.symbolic``), the Captured graph is the hinted twin and
    ``Captured.symbolic`` the symbolic graph.
    Placeholders become parameters / buffers (by their dynamo source, e.g.
    ``L['self']._modules['fc1']._parameters ['weight']`` -> ``fc1.weight``) or user inputs; SymInt
    arguments are baked in as their values.  ``experts`` ({FQN: module}; training): experts
    modules made one region op before AOT traces (``capture.regions``)."""
    sources = list(sources) if sources is not None else dynamo_sources(gm)
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kinds = []
    for src in sources:
        kinds.append(source_fqn(src, roots) if src else (INPUT, None))
    fqn_of = {p: k[1] for p, k in zip(placeholders, kinds)}

    def own(a, module_fqn):
        f = fqn_of.get(a)
        return f is not None and f.startswith(module_fqn + ".")

    # Python numbers first: a module boundary would otherwise count one as a module input
    _bake_python_scalars(gm, placeholders, args)
    if boundaries:
        _insert_dynamo_boundaries(gm, boundaries, own, roots)
    if training and experts:
        # experts regions before AOT traces the joint graph (the region op's backward is its own)
        def members(fqn):
            return [
                n
                for n in gm.graph.nodes
                if n.op in ("call_function", "call_method", "call_module")
                and n.target is not BOUNDARY
                and fqn in _module_path(n, roots)
            ]

        expert_regions(gm, experts, mesh_shape, members, fqn_of.get, "example_value")
    # symbolic captures: a Python int dynamo made dynamic that is no tensor's size comes in as a
    # tensor of that length (its size carrier: the program reads the number from its shape)
    carriers = set(dynamic.free) if dynamic is not None and not training else set()
    tensor_pos = [
        i for i, a in enumerate(args) if isinstance(a, torch.Tensor) or i in carriers
    ]  # fmt: skip
    fixed = {
        i: (int(a) if isinstance(a, (int, torch.SymInt)) else a)
        for i, a in enumerate(args)
        if i not in tensor_pos
    }

    def run(*tensors):
        full = dict(fixed)
        full.update((i, t.shape[0] if i in carriers else t) for i, t in zip(tensor_pos, tensors))
        return fx.Interpreter(gm).run(*[full[i] for i in range(len(args))])

    if training:
        return _capture_dynamo_joint(run, args, tensor_pos, kinds)
    if dynamic is not None:
        mode, fakes, inputs = _symbolic_inputs(args, tensor_pos, dynamic)
        fixed.update({i: v for i, v in enumerate(inputs) if i not in tensor_pos and v is not None})
    else:
        mode = fake_mode(allow_non_fake_inputs=False)
        fakes = [mode.from_tensor(args[i].detach()) for i in tensor_pos]
    with warnings.catch_warnings(), preserve_node_meta():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        traced = make_fx(
            functionalized(run),
            decomposition_table=decomposition_table(),
            tracing_mode="fake",
        )(*fakes)
    _state_updates_as_outputs(traced, [kinds[i] for i in tensor_pos])
    check_no_input_mutation(traced)
    drop_trace_checks(traced)
    state: dict[str, torch.Tensor] = {}
    kept = []
    n_inputs = 0
    for i in tensor_pos:
        kind, fqn = kinds[i]
        if kind in (PARAM, BUFFER):
            state[fqn] = args[i].detach()
        else:
            n_inputs += 1
        kept.append((kind, fqn))
    constants = lift_constants(traced, mode)
    state.update(constants)
    kept += [(CONSTANT, name) for name in constants]
    record(traced, kept, roots)
    for n, i in zip([n for n in traced.graph.nodes if n.op == "placeholder"], tensor_pos):
        info(n).arg_index = i
    traced.graph.lint()
    traced.recompile()
    if dynamic is not None:
        symbolic = SymbolicGraph(traced, mode, inputs)
        return Captured(hinted(traced), state, n_inputs, None, symbolic=symbolic)
    return Captured(traced, state, n_inputs, None)


def _symbolic_inputs(args, tensor_pos, dynamic: DynamicDims) -> tuple:
    """(fake mode, fakes of the tensor arguments, every argument's stand-in) for a symbolic
    capture: the dims ``dynamic`` names are symbols of a ShapeEnv of ours (dims of equal size
    share one, as dynamo's do, until a call tells them apart), SymInt arguments the sizes they
    stand for."""
    mode = symbolic_fake_mode()
    fakes = {}
    inputs = [None] * len(args)
    for i in tensor_pos:
        a = args[i]
        if not isinstance(a, torch.Tensor):  # a size carrier: its length is the number
            fakes[i] = size_carrier(int(a))
            fakes[i] = symbolic_fake(mode, fakes[i], (0,), f"a{i}")
            inputs[i] = fakes[i].shape[0]
            continue
        a = a.detach()
        dims = dynamic.tensors.get(i, ())
        if is_fake(a):  # a DTensor's global value (never allocated)
            fakes[i] = symbolic_empty(mode, a.shape, dims, a.dtype, a.device, f"a{i}")
        else:
            fakes[i] = symbolic_fake(mode, a, dims, f"a{i}")
        inputs[i] = fakes[i]
    for i, (j, d) in dynamic.sizes.items():
        inputs[i] = fakes[j].shape[d]
    return mode, [fakes[i] for i in tensor_pos], inputs


def size_carrier(n: int, device=None) -> torch.Tensor:
    """The tensor a symbolic program takes for a dynamic Python int that is no tensor's size: its
    length is the number (zeros: every rank's is alike)."""
    return torch.zeros(n, dtype=torch.uint8, device=device)


class _Run(nn.Module):
    """The dynamo graph's interpreter as a module (what AOT traces)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *tensors):
        return self.fn(*tensors)


def _capture_dynamo_joint(run, args, tensor_pos, kinds) -> Captured:
    input_kinds = [
        kinds[i] if kinds[i][0] in (PARAM, BUFFER) else (INPUT, None) for i in tensor_pos
    ]
    c = capture_joint(_Run(run), [args[i] for i in tensor_pos], input_kinds=input_kinds)
    for n in c.gm.graph.nodes:
        if n.op == "placeholder":
            kind, what = describe(n.meta.get("desc"))
            if kind == INPUT:
                info(n).arg_index = tensor_pos[what]
    # the graph's parameters and buffers, and the tensor constants capture_joint lifted
    state = {f: t for f, t in c.state.items() if f.startswith("primals_")}
    state.update(
        {
            fqn: args[i].detach()
            for i, (kind, fqn) in zip(tensor_pos, input_kinds)
            if kind in (PARAM, BUFFER)
        }
    )
    c.gm.graph.lint()
    c.gm.recompile()
    return dataclasses.replace(c, state=state)


def _bake_python_scalars(gm: fx.GraphModule, placeholders, args) -> None:
    """Python numbers dynamo passes as 0-d tensors (``.item()`` in the graph, e.g. an Embedding's
    ``norm_type`` under dynamic=True) become constants: the backend specialises per call anyway."""
    changed = False
    for p, a in zip(placeholders, args):
        if not (isinstance(a, torch.Tensor) and a.ndim == 0):
            continue
        for u in list(p.users):
            if u.op == "call_method" and u.target == "item":
                value = a.item()
                for user in list(u.users):
                    user.args = fx.node.map_arg(
                        user.args, lambda n, u=u, v=value: v if n is u else n
                    )
                    user.kwargs = fx.node.map_arg(
                        user.kwargs, lambda n, u=u, v=value: v if n is u else n
                    )
                gm.graph.erase_node(u)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
