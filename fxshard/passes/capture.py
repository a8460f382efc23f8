"""capture: an nn.Module or callable + example inputs -> an ATen FX graph to shard.

``torch.export`` (non-strict) traces the model; we then decompose to ATen with Inductor-free core
decompositions, except scaled-dot-product attention, which stays one op (sharding it on batch and
heads is simple; its decomposition is a forest of masks and matmuls).  Every placeholder knows what
it is (parameter / buffer / constant / user input) and its FQN; every op node keeps the module it
came from (``nn_module_stack``), its source line and a fake-tensor ``meta["val"]``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from ..adapter import placeholder_source, record_frames_of

PARAM, BUFFER, CONSTANT, INPUT, TANGENT = "param", "buffer", "constant", "input", "tangent"
GRAD_TAG = "grad:"  # boundary tag of a complete gradient: "grad:<forward node name>"


@dataclass
class NodeInfo:
    """``node.meta["fxshard"]``: everything the stages record about one node."""

    kind: str = "op"  # param / buffer / constant / input / op / redistribute / constraint / output
    fqn: str | None = None  # parameters, buffers, constants
    input_index: int | None = None  # user inputs
    module: str = ""  # FQN of the innermost module the node belongs to ("" = top level)
    source: str = ""  # "file.py:123"
    code: str = ""  # that line of source
    spec: object = None  # output ShardingSpec (tuple of them for multi-output ops)
    input_specs: tuple = ()  # required ShardingSpec per tensor input (None: non-tensor arg)
    provenance: str = ""  # who decided the placement
    plan: object = None  # RedistributePlan (redistribute nodes)
    extra: dict = field(default_factory=dict)


def info(node: fx.Node) -> NodeInfo:
    rec = node.meta.get("fxshard")
    if rec is None:
        rec = node.meta["fxshard"] = NodeInfo()
    return rec


@dataclass
class Captured:
    """A captured program and everything the later stages need (passed from stage to stage)."""

    gm: fx.GraphModule
    state: dict[str, torch.Tensor]  # parameters, buffers and constants by FQN
    num_inputs: int
    model: nn.Module | None
    mesh: object = None  # MeshSpec
    device_mesh: object = None  # DeviceMesh, when one was given
    constraints: object = None  # PlanConstraints
    cost_model: object = None
    warnings: list = field(default_factory=list)
    stage: str = "captured"  # captured -> annotated -> redistributed
    fuse: bool = True  # plan collectives over flattened mesh dims where that is cheaper
    bucket_bytes: int = 25 * 1024 * 1024  # bucket independent collectives up to this size (0: off)
    batch_size: int | None = None  # data-parallel dims shard only inputs of this leading size (None: all)
    training: bool = False  # a joint forward+backward graph (outputs: forward outputs, then gradients)
    replicate_grads: bool = False  # joint graphs: gradients handed back global, not placed like their values
    out_spec: object = None  # pytree spec of the model's outputs (None: a flat tuple or one value)
    auto: object = None  # plan="auto": the solver's AutoReport


class _FnModule(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        record_frames_of(fn)

    def forward(self, *args):
        return self.fn(*args)


@torch.library.custom_op("fxshard::boundary", mutates_args=())
def boundary(x: torch.Tensor, tag: str) -> torch.Tensor:
    """Marks a value crossing a planned module's boundary; the identity on values."""
    return x.clone()


@boundary.register_fake
def _boundary_fake(x, tag):
    return torch.empty_like(x)


BOUNDARY = torch.ops.fxshard.boundary.default


_MARKING = [True]  # boundary hooks mark values (off while reuse_layers probes call signatures)


@contextlib.contextmanager
def boundary_marking(on: bool):
    """Boundary hooks mark values (``on``) or pass them through unmarked (a marker changes no
    tensor metadata); the previous setting comes back after."""
    was, _MARKING[0] = _MARKING[0], on
    try:
        yield
    finally:
        _MARKING[0] = was


def _install_boundary_hooks(module: nn.Module, hooked: dict[str, tuple[int, int]]):
    handles = []
    modules = dict(module.named_modules())
    for fqn, (n_in, n_out) in hooked.items():
        mod = modules[fqn]

        def pre(_m, args, fqn=fqn, n_in=n_in):
            if not _MARKING[0]:
                return None
            return tuple(boundary(a, f"{fqn}:in:{i}") if i < n_in and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))

        def post(_m, _args, out, fqn=fqn, n_out=n_out):
            if not _MARKING[0]:
                return None
            if isinstance(out, torch.Tensor):
                return boundary(out, f"{fqn}:out:0") if n_out > 0 else out
            if isinstance(out, tuple):
                return tuple(boundary(o, f"{fqn}:out:{i}") if i < n_out and isinstance(o, torch.Tensor) else o
                             for i, o in enumerate(out))
            return out

        pre.fxshard_boundary = ("in", n_in)  # what the hook marks, for reuse_layers' "alike" test
        post.fxshard_boundary = ("out", n_out)
        if n_in:
            handles.append(mod.register_forward_pre_hook(pre))
        if n_out:
            handles.append(mod.register_forward_hook(post))
    return handles


def _decomposition_table():
    """torch.export's default decompositions but scaled-dot-product attention (a fresh dict each
    call, from one built once: building it costs ~70 ms)."""
    return dict(_decompositions())


@functools.lru_cache(maxsize=1)
def _decompositions():
    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if "scaled_dot_product" in str(op):
            del table[op]
    return table


_THIS_FILE = "fxshard/passes/capture.py"
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _source(stack_trace: str | None) -> tuple[str, str]:
    """(file:line, code) of the innermost user frame of a stack trace."""
    if not stack_trace:
        return "", ""
    lines = stack_trace.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.search(lines[i])
        if m and "/torch/" not in m.group(1) and not m.group(1).endswith(_THIS_FILE):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}", code
    return "", ""


def capture(model: nn.Module | Callable, example_inputs: Sequence, example_kwargs: dict | None = None,
            boundaries: dict[str, tuple[int, int]] | None = None) -> Captured:
    """Trace ``model`` on ``example_inputs``.  ``boundaries`` names modules whose first inputs /
    outputs get ``fxshard::boundary`` marker nodes (the plan constrains placements there)."""
    if example_kwargs:
        raise NotImplementedError("fxshard.capture: keyword example inputs are not supported yet; pass them "
                                  "positionally")
    module = model if isinstance(model, nn.Module) else _FnModule(model)
    handles = _install_boundary_hooks(module, boundaries or {})
    try:
        with warnings.catch_warnings():  # torch's own pytree deprecation noise during export
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = torch.export.export(module, tuple(example_inputs), strict=False)
    except Exception as e:  # surface which model failed, keep torch's reason
        raise RuntimeError(f"fxshard.capture: torch.export could not trace {type(module).__name__}: {e}") from e
    finally:
        for h in handles:
            h.remove()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        ep = ep.run_decompositions(_decomposition_table())
    sig = ep.graph_signature
    if sig.buffers_to_mutate or getattr(sig, "user_inputs_to_mutate", None):
        raise NotImplementedError(
            f"fxshard.capture: the model mutates buffers/inputs in forward ({dict(sig.buffers_to_mutate)}); "
            f"in-place state updates are not supported by the sharding pass yet")
    gm = ep.graph_module
    state: dict[str, torch.Tensor] = {}
    state.update(ep.state_dict)
    state.update(ep.constants)
    kinds = {}
    for spec in sig.input_specs:
        name = spec.arg.name
        k = spec.kind.name
        if k == "PARAMETER":
            kinds[name] = (PARAM, spec.target)
        elif k == "BUFFER":
            kinds[name] = (BUFFER, spec.target)
        elif k in ("CONSTANT_TENSOR", "CUSTOM_OBJ"):
            kinds[name] = (CONSTANT, spec.target)
        elif k == "USER_INPUT":
            kinds[name] = (INPUT, None)
        else:  # pragma: no cover
            raise NotImplementedError(f"fxshard.capture: unsupported graph input kind {k} for {name}")
    n_inputs = _record(gm, [kinds[p.name] for p in gm.graph.nodes if p.op == "placeholder"])
    for name, t in list(state.items()):
        if isinstance(t, nn.Parameter):
            state[name] = t.detach()
    c = Captured(gm, state, n_inputs, model if isinstance(model, nn.Module) else None)
    c.out_spec = ep.call_spec.out_spec
    return c


def _record(gm: fx.GraphModule, kinds: list[tuple[str, str | None]], roots: dict | None = None) -> int:
    """Fill every node's NodeInfo (kind, FQN, module, source line); returns the number of user inputs."""
    n_inputs = 0
    placeholders = iter(kinds)
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder":
            kind, fqn = next(placeholders)
            rec.kind, rec.fqn = kind, fqn
            if kind == INPUT:
                rec.input_index = n_inputs
                n_inputs += 1
            elif kind == TANGENT:
                rec.input_index = fqn  # the forward output this is the gradient of
                rec.fqn = None
        elif node.op == "output":
            rec.kind = "output"
        else:
            if node.target is BOUNDARY:
                rec.kind = "boundary"
                rec.extra["tag"] = node.args[1]
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                rec.module = _path_fqn(list(stack.values())[-1][0], roots)
            rec.source, rec.code = _source(node.meta.get("stack_trace"))
    return n_inputs


# ---- dynamo graphs (the torch.compile backend) ---------------------------------------------------

_SOURCE_PART = re.compile(r"\.(_modules|_parameters|_buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z_0-9]*)")


def source_fqn(source_name: str, roots: dict | None = None) -> tuple[str, str | None]:
    """(kind, FQN) of a dynamo placeholder source such as
    ``L['self']._modules['fc1']._parameters['weight']`` -> (param, "fc1.weight"); ``roots`` gives
    the FQN prefix of frame locals that are submodules (``{"layer": "layers.1."}``)."""
    m = re.match(r"^(?:L|G)\['([^']+)'\]", source_name)
    if m is None:
        return INPUT, None
    parts, kind = [], INPUT
    for a, b, attr in _SOURCE_PART.findall(source_name[m.end():]):
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
    return kind, (roots or {}).get(m.group(1), "") + ".".join(parts)


def _module_path(node: fx.Node, roots: dict | None = None) -> list[str]:
    return [_path_fqn(path, roots) for path, _cls in (node.meta.get("nn_module_stack") or {}).values()]


def _path_fqn(path: str, roots: dict | None) -> str:
    """FQN of a module path such as ``L['layer'].attention.wq``: the frame local's FQN (``roots``,
    e.g. {"layer": "layers.1."}) + the rest."""
    m = re.match(r"^L\['([^']+)'\]", path)
    prefix = (roots or {}).get(m.group(1), "") if m else ""
    return _join(prefix, _clean_fqn(path))


def _join(prefix: str, fqn: str) -> str:
    return (prefix + fqn if fqn else prefix.rstrip(".")) if prefix else fqn


def _insert_dynamo_boundaries(gm: fx.GraphModule, boundaries: dict[str, tuple[int, int]], own, roots=None) -> None:
    """Mark planned module boundaries in a dynamo graph from its ``nn_module_stack`` metadata.

    A module's inputs are the tensors its nodes consume that are made outside it (not its own
    parameters / buffers), in order of first use; its outputs are the values it makes that are used
    outside it, in order of production.  Hooks would be exact, but dynamo has already traced."""
    graph = gm.graph

    def members_of(fqn):
        return [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")
                and fqn in _module_path(n, roots)]

    def mark(value, fqn, tag, like):
        b = graph.call_function(BOUNDARY, (value, tag))
        b.meta.update({k: v for k, v in like.meta.items() if k not in ("example_value", "nn_module_stack")})
        b.meta["example_value"] = value.meta.get("example_value")
        stack = {}
        for key, (path, cls) in (like.meta.get("nn_module_stack") or {}).items():
            stack[key] = (path, cls)
            if _path_fqn(path, roots) == fqn:
                break
        b.meta["nn_module_stack"] = stack  # inside the module, outside its children
        return b

    depth = lambda fqn: fqn.count(".")
    # inputs outermost first (an inner module's input is then the outer boundary), outputs innermost first
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
    """Every placeholder's dynamo source name; read them in the backend call (dynamo drops them after)."""
    return [placeholder_source(p) for p in gm.graph.nodes if p.op == "placeholder"]


def capture_dynamo_graph(gm: fx.GraphModule, args: Sequence, boundaries: dict[str, tuple[int, int]] | None = None,
                         roots: dict[str, str] | None = None, sources: Sequence[str | None] | None = None,
                         training: bool = False) -> Captured:
    """A dynamo graph + this call's concrete arguments -> a Captured ATen graph (``training``: the
    joint forward+backward graph, parameters' gradients as gradients of those inputs).

    Shapes are specialised to ``args`` (the backend captures once per input signature).  Placeholders
    become parameters / buffers (by their dynamo source, e.g. ``L['self']._modules['fc1']._parameters
    ['weight']`` -> ``fc1.weight``) or user inputs; SymInt arguments are baked in as their values."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.traceback import preserve_node_meta

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

    if boundaries:
        _insert_dynamo_boundaries(gm, boundaries, own, roots)
    _bake_python_scalars(gm, placeholders, args)
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    fixed = {i: (int(a) if isinstance(a, (int, torch.SymInt)) else a) for i, a in enumerate(args)
             if not isinstance(a, torch.Tensor)}

    def run(*tensors):
        full = dict(fixed)
        full.update(zip(tensor_pos, tensors))
        return fx.Interpreter(gm).run(*[full[i] for i in range(len(args))])

    if training:
        return _capture_dynamo_joint(run, args, tensor_pos, kinds)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes = [mode.from_tensor(args[i].detach()) for i in tensor_pos]
    with warnings.catch_warnings(), preserve_node_meta():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        traced = make_fx(torch.func.functionalize(run, remove="mutations"),
                         decomposition_table=_decomposition_table(), tracing_mode="fake")(*fakes)
    _check_no_input_mutation(traced)
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
    new_placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for n, i in zip(new_placeholders, tensor_pos):
        n.meta["fxshard_arg_index"] = i
    _record(traced, kept, roots)
    traced.graph.lint()
    traced.recompile()
    return Captured(traced, state, n_inputs, None)


class _Run(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *tensors):
        return self.fn(*tensors)


def _capture_dynamo_joint(run, args, tensor_pos, kinds) -> Captured:
    from ..adapter import describe

    input_kinds = [kinds[i] if kinds[i][0] in (PARAM, BUFFER) else (INPUT, None) for i in tensor_pos]
    c = capture_joint(_Run(run), [args[i] for i in tensor_pos], input_kinds=input_kinds)
    for n in c.gm.graph.nodes:
        if n.op == "placeholder":
            kind, what = describe(n.meta.get("desc"))
            if kind == INPUT:
                n.meta["fxshard_arg_index"] = tensor_pos[what]
    c.state = {fqn: args[i].detach() for i, (kind, fqn) in zip(tensor_pos, input_kinds) if kind in (PARAM, BUFFER)}
    return c


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
                    user.args = fx.node.map_arg(user.args, lambda n, u=u, v=value: v if n is u else n)
                    user.kwargs = fx.node.map_arg(user.kwargs, lambda n, u=u, v=value: v if n is u else n)
                gm.graph.erase_node(u)
                changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _check_no_input_mutation(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder":
            raise NotImplementedError(
                f"fxshard: the compiled code mutates its input {n.args[0].name} in place; in-place updates of "
                f"parameters, buffers or inputs inside a sharded graph are not supported yet")


def capture_joint(model: nn.Module | Callable, example_inputs: Sequence,
                  boundaries: dict[str, tuple[int, int]] | None = None,
                  input_kinds: Sequence[tuple[str, str | None]] | None = None,
                  reuse_layers: bool = False) -> Captured:
    """The joint forward+backward ATen graph of ``model`` (AOTAutograd's export with descriptors).

    Placeholders: parameters, buffers, user inputs, then one tangent (incoming gradient) per
    differentiable forward output.  Outputs: the forward outputs, then the gradient of every
    parameter (and of every user input that requires grad); ``info(output).extra["outputs"]`` says
    which is which: ("output", i), ("grad_param", fqn), ("grad_input", i).

    ``input_kinds``: (kind, FQN) per tensor input, when some inputs are really parameters or buffers
    (a dynamo graph takes its parameters as inputs); user inputs are then renumbered.

    ``reuse_layers``: trace each repeated layer once and stitch copies of its joint graph in
    (``fxshard.passes.stitch``: the model's own code is still traced, layers of equal state are
    assumed to compute the same function); falls back to the plain trace, with a log line, where
    that does not apply."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..adapter import describe, export_joint, lazy_graph_modules

    module = model if isinstance(model, nn.Module) else _FnModule(model)
    handles = _install_boundary_hooks(module, boundaries or {})
    # AOT swaps parameters for traced ones and back; a module reachable by two paths (a ModuleList
    # slice kept as an attribute) comes back holding the traced ones: put the originals back after
    state_slots = [(m, kind, n, t) for m in module.modules() for kind in ("_parameters", "_buffers")
                   for n, t in getattr(m, kind).items()]
    from torch._guards import detect_fake_mode

    fm = detect_fake_mode(tuple(example_inputs)) or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [fm.from_tensor(x) if isinstance(x, torch.Tensor) and not _is_fake_of(fm, x) else x
             for x in example_inputs]
    try:
        with warnings.catch_warnings(), lazy_graph_modules():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            # reuse_layers stops a trace from inside a layer's backward (a fallback): not an error
            warnings.filterwarnings("ignore", message="Error detected in .*fxshard_layer_fwd")
            gm = None
            if reuse_layers:
                gm, out_spec = _export_stitched(module, fm, fakes)
            if gm is None:
                with fm:
                    gm, out_spec = export_joint(module, fakes, _decomposition_table())
    except Exception as e:
        raise RuntimeError(f"fxshard.capture: could not trace the forward+backward of {type(module).__name__}: "
                           f"{e}") from e
    finally:
        for h in handles:
            h.remove()
        for m, kind, n, t in state_slots:
            if getattr(m, kind).get(n) is not t:
                getattr(m, kind)[n] = t
    # flat calling convention (AOT's pytree codegen groups inputs/outputs as (primals, tangents))
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()
    kinds = []
    for p in gm.graph.nodes:
        if p.op != "placeholder":
            continue
        kind, what = describe(p.meta.get("desc"))
        if kind in (PARAM, BUFFER):
            kinds.append((kind, what))
        elif kind == INPUT:
            kinds.append(tuple(input_kinds[what]) if input_kinds is not None else (INPUT, None))
        elif kind == TANGENT:
            if what is None:
                raise NotImplementedError(f"fxshard.capture: unsupported tangent {p.meta.get('desc')}")
            kinds.append((TANGENT, what))
        else:
            raise NotImplementedError(f"fxshard.capture: unsupported joint-graph input {p.meta.get('desc')}")
    _mark_gradients(gm)
    n_inputs = _record(gm, kinds)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    roles = [describe(d) for d in out.meta.get("desc", ())]
    other = [r[0] for r in roles if r[0] not in ("output", "grad_param", "grad_input", "NoneType")]
    if other:  # e.g. InputMutationAOTOutput: BatchNorm updating running stats in training mode
        raise NotImplementedError(
            f"fxshard.capture: the model's forward+backward has outputs of kind {sorted(set(other))} (an in-place "
            f"update of a buffer or input, e.g. BatchNorm running statistics in train mode); in-place state "
            f"updates are not supported by the sharding pass yet (use eval() for such modules, or remove the "
            f"update)")
    if input_kinds is not None:  # gradients of inputs that are parameters -> of those parameters
        user_index = {}
        for i, (kind, _) in enumerate(input_kinds):
            if kind == INPUT:
                user_index[i] = len(user_index)
        roles = [(("grad_param", input_kinds[r[1]][1]) if input_kinds[r[1]][0] == PARAM else
                  ("grad_input", user_index.get(r[1]))) if r[0] == "grad_input" else r for r in roles]
    info(out).extra["outputs"] = roles
    _check_no_input_mutation(gm)
    # every name a shared tensor goes by (AOT may name its placeholder by any of them)
    state = {f: t.detach() for f, t in module.named_parameters(remove_duplicate=False)}
    state.update({f: t.detach() for f, t in module.named_buffers(remove_duplicate=False)})
    c = Captured(gm, state, n_inputs, model if isinstance(model, nn.Module) else None)
    c.training = True
    c.out_spec = out_spec
    return c


def _export_stitched(module: nn.Module, fm, fakes):
    """(joint graph, out spec) with each repeated layer traced once, or (None, None) where the
    model does not allow it (logged)."""
    from ..adapter import export_joint
    from . import stitch

    try:
        with stitch.opaque_layers(module, fm, fakes, _decomposition_table(), export_joint) as inline:
            with fm:
                gm, out_spec = export_joint(module, fakes, _decomposition_table())
            return inline(gm), out_spec
    except Exception as e:  # anything in the way: the plain trace (which reports its own errors)
        cause = e
        while cause is not None and not isinstance(cause, stitch.Unsupported):
            cause = cause.__cause__ or cause.__context__
        why = cause if cause is not None else f"{type(e).__name__}: {e}"
        quiet = str(why).startswith("no repeated layers")  # nothing to reuse: not worth a line
        (stitch.log.debug if quiet else stitch.log.info)(
            "fxshard.capture: tracing every layer (reuse_layers does not apply: %s)", why)
        return None, None


def _is_fake_of(mode, value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor) and value.fake_mode is mode


def _mark_gradients(gm: fx.GraphModule) -> None:
    """Mark every complete gradient of a forward value with a ``grad:<forward node>`` boundary.

    AOTAutograd tags each backward node with the ``seq_nr`` of the forward op it differentiates.  A
    backward value consumed by another op's backward (not by an accumulating add) is the gradient
    of that op's output, all contributions summed: the forward node of that ``seq_nr`` with the
    same shape.  Annotation places it like the forward value."""
    forward: dict[int, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.meta.get("partitioner_tag") == "is_forward" and "seq_nr" in n.meta:
            forward.setdefault(n.meta["seq_nr"], []).append(n)

    def is_accumulation(u):
        return u.op == "call_function" and u.target is torch.ops.aten.add.Tensor

    aten = torch.ops.aten
    # the gradient of a view flows on to the viewed value's gradient: only "real" values are marked
    views = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.permute.default,
             aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
             aten.alias.default, aten.expand.default, aten.slice.Tensor, aten.select.int}

    for b in list(gm.graph.nodes):
        if b.op != "call_function" or b.meta.get("partitioner_tag") != "is_backward" or not _is_tensor(b):
            continue
        groups = {}
        for u in b.users:
            if u.op == "call_function" and u.meta.get("seq_nr") != b.meta.get("seq_nr") and not is_accumulation(u):
                groups.setdefault(u.meta.get("seq_nr"), []).append(u)
        for seq, users in groups.items():
            shape = tuple(b.meta["val"].shape)
            match = [f for f in forward.get(seq, ()) if _is_tensor(f) and tuple(f.meta["val"].shape) == shape
                     and f.target not in views]
            if not match:
                continue
            with gm.graph.inserting_after(b):
                m = gm.graph.call_function(BOUNDARY, (b, f"{GRAD_TAG}{match[-1].name}"))
            m.meta.update({k: v for k, v in b.meta.items() if k in ("val", "seq_nr", "partitioner_tag",
                                                                       "nn_module_stack", "stack_trace")})
            for u in users:
                u.replace_input_with(b, m)
    gm.graph.lint()
    gm.recompile()


@boundary.register_autograd
def _boundary_backward(ctx, grad):
    # a boundary constrains the forward value only; its gradient flows through unconstrained
    return grad, None


def _clean_fqn(path: str) -> str:
    # nn_module_stack paths look like "L['self'].layers[0].attention" in some versions; normalise
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")
