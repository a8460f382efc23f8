"""Trace a repeated layer once: the joint graph of a deep model from one layer's joint graph.

AOTAutograd traces every op of every layer through four Python dispatch modes, ~0.3 s per
LLaMA-3-8B layer here, so a 32-layer capture costs ~9 s before any planning.  With
``capture(..., reuse_layers=True)`` the model is traced with each repeated layer as one opaque op
(``fxshard::layer_fwd`` / ``fxshard::layer_bwd``, a custom autograd function), each distinct layer
is traced once on its own (forward + backward), and every opaque pair is then replaced by a copy of
that layer's joint graph wired to the layer's own parameters, inputs and incoming gradient.

What is traced for real: the model's own code around the layers (so an index-dependent loop, a skip
connection or a different argument per layer is captured as written) and each layer's code once per
call signature. What is assumed: two layers whose state is equal (same class and submodule
structure, parameter and buffer shapes/dtypes/strides/requires_grad, equal plain attributes, no
hooks inside that differ) compute the same function of their tensors. A layer whose state differs
(say a ``layer_idx`` attribute, or a sliding-window flag) gets its own trace; a call this pass
cannot represent makes the whole capture fall back to the plain trace, with a log line that says
why: an argument that is neither a tensor nor a constant (tensors may come in tuples, lists, dicts
and keywords: HF's ``position_embeddings=(cos, sin)``; None, numbers, strings and dtypes are baked
into the layer's trace and are part of its signature); outputs that are not a tensor or a flat tuple
of tensors; an output that is (a view of) an input or of another output (AOT gives it no gradient
input of its own, so its gradient would be lost); an output the model never differentiates (the
layer's backward would run on zeros, which the plain trace never does); tied parameters inside a
layer; gradients off. Outputs autograd does not track stay untracked (marked non-differentiable),
and a layer graph's tensor constants are copied into the model's graph under fresh names.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import (
    describe,
    export_joint,
    is_fake,
    is_fake_of,
    no_fake_mode,
    run_observed,
    tree_flatten,
    tree_map,
)
from ..ir import BOUNDARY
from .common import CallArgs
from .layers import alike_layers, tensor_key
from .markers import Markers

log = logging.getLogger("fxshard.stitch")

_LAYERS: dict[str, _LayerTrace] = {}  # key -> traced layer, for the opaque ops' fake kernels


class Unsupported(Exception):
    """This model's layers cannot be traced once; the caller falls back to the plain trace."""


@dataclass
class _LayerTrace:
    key: str
    fqn: str  # the layer whose code was traced
    state_names: list[str]  # parameters then buffers, as passed to the opaque op
    out_meta: list[tuple]  # (shape, stride, dtype, device) per forward output
    single: bool  # the layer returns one tensor (else a flat tuple of tensors)
    grad_of: list[tuple[str, int]]  # what layer_bwd returns: ("state", i) / ("input", i)
    joint: fx.GraphModule | None = None
    diff: tuple[bool, ...] = ()  # per forward output: autograd tracks it (it has a gradient)
    consts: dict | None = None  # get_attr target -> tensor constant of the layer's graph


# ---- the opaque ops ------------------------------------------------------------------------------


@torch.library.custom_op("fxshard::layer_fwd", mutates_args=())
def layer_fwd(
    key: str, state: list[torch.Tensor], inputs: list[torch.Tensor]
) -> list[torch.Tensor]:
    raise RuntimeError(
        "fxshard::layer_fwd exists only while fxshard traces a model (capture reuse_layers=True)"
    )


@layer_fwd.register_fake
def _layer_fwd_fake(key, state, inputs):
    lt = _LAYERS[key.partition("@")[0]]
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device)
        for shape, stride, dtype, device in lt.out_meta
    ]


@torch.library.custom_op("fxshard::layer_bwd", mutates_args=())
def layer_bwd(
    key: str, state: list[torch.Tensor], inputs: list[torch.Tensor], grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    raise RuntimeError(
        "fxshard::layer_bwd exists only while fxshard traces a model (capture reuse_layers=True)"
    )


@layer_bwd.register_fake
def _layer_bwd_fake(key, state, inputs, grads):
    lt = _LAYERS[key.partition("@")[0]]
    return [torch.empty_like(state[i] if kind == "state" else inputs[i]) for kind, i in lt.grad_of]


def _setup(ctx, inputs, output):
    key, state, ins = inputs
    ctx.key, ctx.n_state = key, len(state)
    ctx.save_for_backward(*state, *ins)
    lt = _LAYERS[key.partition("@")[0]]
    # as in the layer itself
    ctx.mark_non_differentiable(*[o for o, d in zip(output, lt.diff) if not d])
    ctx.set_materialize_grads(False)  # an output nobody differentiates arrives as None (see below)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    state, ins = list(saved[: ctx.n_state]), list(saved[ctx.n_state :])
    lt = _LAYERS[ctx.key.partition("@")[0]]
    grads = [g for g, d in zip(grads, lt.diff) if d]
    if any(g is None for g in grads):
        # The layer's joint graph differentiates every output; fed zeros it would compute (and
        # could turn NaN) a backward the plain trace never has.
        raise Unsupported(
            "a layer output that carries gradients is not differentiated by the model"
        )
    out = layer_bwd(ctx.key, state, ins, grads)
    g_state: list = [None] * len(state)
    g_in: list = [None] * len(ins)
    for (kind, i), g in zip(lt.grad_of, out):
        (g_state if kind == "state" else g_in)[i] = g
    return None, g_state, g_in


layer_fwd.register_autograd(_backward, setup_context=_setup)
LAYER_FWD = torch.ops.fxshard.layer_fwd.default
LAYER_BWD = torch.ops.fxshard.layer_bwd.default


# ---- capture -------------------------------------------------------------------------------------


class _Alone(nn.Module):
    """One layer traced on its own: its class's forward (its own hooks are the model's business)."""

    def __init__(self, layer, call: CallArgs):
        super().__init__()
        self.inner = layer
        self.call = call

    def forward(self, *tensors):
        args, kwargs = self.call.rebuild(tensors)
        return type(self.inner).forward(self.inner, *args, **kwargs)


def _call(fqn: str, args: tuple, kwargs: dict) -> CallArgs:
    """How a layer is called (``CallArgs``): HF's decoder layers take ``position_embeddings=(cos,
    sin)``, masks and flags as keywords, which the trace bakes in (part of the signature)."""
    call = CallArgs(args, kwargs)
    if not call.tensors:
        raise Unsupported(f"{fqn} is called without tensor arguments")
    if call.unsupported:
        raise Unsupported(f"{fqn} is called with a {call.unsupported[0]} argument")
    return call


def _state(layer: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    names, tensors = [], []
    for n, p in layer.named_parameters():
        names.append(n)
        tensors.append(p)
    for n, b in layer.named_buffers():
        names.append(n)
        tensors.append(b)
    return names, tensors


@contextlib.contextmanager
def opaque_layers(
    model: nn.Module, fake_mode: object, fakes: Sequence, decompositions: dict, markers: Markers
):
    """Inside: ``model``'s repeated layers are opaque ops.  A first pass runs the model on the fake
    inputs to find every layer call signature and trace each once (outside any other trace); the
    context then yields a function that inlines the layers into a graph traced inside it."""
    groups = alike_layers(model)
    if not groups:
        raise Unsupported("no repeated layers (equal-state children of a ModuleList / Sequential)")
    for group in groups:
        owner: dict[int, str] = {}
        for fqn, layer in group:
            for name, sub in layer.named_modules():
                first = owner.setdefault(id(sub), f"{fqn}.{name}" if name else fqn)
                if first != fqn and not first.startswith(fqn + "."):
                    # its markers (and anything keyed by its name) belong to its first owner, not
                    # to each copy: not a layer of its own
                    raise Unsupported(f"{fqn}.{name} is {first}: layers sharing a submodule")
    if not torch.is_grad_enabled():
        raise Unsupported("gradients are off: nothing to differentiate")
    traces: dict[tuple, _LayerTrace] = {}
    checked: set[tuple] = set()  # signatures whose trace a second layer's run confirmed
    firsts: dict[tuple, tuple] = {}  # signature -> (the layer traced, its call)
    patched = []
    prefix = f"{id(model):x}"

    def signature(gi, fqn, args, kwargs):
        call = _call(fqn, args, kwargs)
        return (
            gi,
            call.key(),
            tuple(tensor_key(a) + (a.device,) for a in call.tensors),
        ), call

    def make_probe(gi, fqn, layer):
        def probe(*args, **kwargs):
            sig, call = signature(gi, fqn, args, kwargs)
            lt = traces.get(sig)
            if lt is None:
                with markers.marking(True):  # markers inside the layer belong in its graph
                    lt = traces[sig] = _trace_layer(
                        f"{prefix}:{len(traces)}", fqn, layer, call, fake_mode, decompositions
                    )
                firsts[sig] = (layer, call)
            elif sig not in checked and fqn != lt.fqn:
                # Equal state is not proof of equal behaviour (a forward may read a global, or
                # its module's identity): a second layer runs too, and must run the very ops
                # (forward and backward) the first runs.
                checked.add(sig)
                first, first_call = firsts[sig]
                with markers.marking(True):
                    same = _same_run(
                        _run_record(first, lt.fqn, first_call, fake_mode),
                        _run_record(layer, fqn, call, fake_mode),
                    )
                    if same is None:  # the eager run failed: compare the joint graphs
                        other = _trace_layer(
                            f"{prefix}:check", fqn, layer, call, fake_mode, decompositions
                        )
                        _LAYERS.pop(other.key, None)
                        same = _same_trace(lt, other)
                if not same:
                    raise Unsupported(
                        f"{lt.fqn} and {fqn} have equal state but trace to different graphs (their "
                        f"forward depends on something outside their state)"
                    )
            outs = [
                torch.empty_strided(s, st, dtype=dt, device=dev).requires_grad_(d)
                for (s, st, dt, dev), d in zip(lt.out_meta, lt.diff)
            ]
            return outs[0] if lt.single else tuple(outs)

        return probe

    def make_call(gi, fqn, layer):
        def call(*args, **kwargs):
            sig, how = signature(gi, fqn, args, kwargs)
            lt = traces.get(sig)
            if lt is None:
                raise Unsupported(
                    f"{fqn} is called with inputs the probing pass did not see ({sig[2]})"
                )
            out = layer_fwd(
                f"{lt.key}@{fqn}", _state(layer)[1], list(how.tensors)
            )  # which layer: for its markers
            return out[0] if lt.single else tuple(out)

        return call

    try:
        for gi, group in enumerate(groups):
            for fqn, layer in group:
                patched.append((layer, "forward" in vars(layer), vars(layer).get("forward")))
                layer.forward = make_probe(gi, fqn, layer)
        with fake_mode, markers.marking(False):  # the layers' own traces mark (see probe)
            model(*fakes)
        for gi, group in enumerate(groups):
            for fqn, layer in group:
                layer.forward = make_call(gi, fqn, layer)
        yield lambda gm: _stitch(gm, {lt.key: lt for lt in traces.values()})
    finally:
        for layer, had, old in reversed(patched):
            if had:
                layer.forward = old
            else:
                del layer.forward
        for lt in traces.values():
            _LAYERS.pop(lt.key, None)


def _trace_layer(key, fqn, layer, call: CallArgs, fake_mode, decompositions) -> _LayerTrace:
    fakes = [
        (
            a.detach() if is_fake_of(fake_mode, a) else fake_mode.from_tensor(a.detach())
        ).requires_grad_(a.requires_grad)
        for a in call.tensors
    ]
    with fake_mode:  # which outputs autograd tracks, and that they are a flat tuple of tensors
        args, kwargs = call.rebuild(fakes)
        real = type(layer).forward(layer, *args, **kwargs)
        leaves, spec = tree_flatten(real)
        gm, out_spec = export_joint(_Alone(layer, call), fakes, decompositions)
    if not (
        spec.is_leaf() or (spec.type is tuple and all(c.is_leaf() for c in spec.children()))
    ) or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise Unsupported(
            f"{fqn} returns {spec}: only a tensor or a flat tuple of tensors is stitched"
        )
    diff = tuple(bool(x.requires_grad) for x in leaves)
    names, _ = _state(layer)
    index = {n: i for i, n in enumerate(names)}
    out = next(n for n in gm.graph.nodes if n.op == "output")
    outs, grad_of = [], []
    for val, desc in zip(out.args[0], out.meta.get("desc", ())):
        kind, what = describe(desc)
        if kind == "output":
            v = val.meta["val"]
            outs.append((tuple(v.shape), tuple(v.stride()), v.dtype, v.device))
        elif val is None:
            continue  # no gradient (an unused parameter, an input that needs none)
        elif kind == "grad_param" and what[len("inner.") :] in index:
            grad_of.append(("state", index[what[len("inner.") :]]))
        elif kind == "grad_input":
            grad_of.append(("input", what))
        else:
            raise Unsupported(f"{fqn}: its joint graph has an output of kind {kind} ({what})")
    tangents = set()
    for p in gm.graph.nodes:
        if p.op != "placeholder":
            continue
        kind, what = describe(p.meta.get("desc"))
        if kind not in ("param", "buffer", "input", "tangent"):
            raise Unsupported(f"{fqn}: its joint graph has an input {p.meta.get('desc')}")
        if kind in ("param", "buffer") and what[len("inner.") :] not in index:
            raise Unsupported(
                f"{fqn}: parameter {what} is not among the layer's own (tied weights?)"
            )
        if kind == "tangent":
            tangents.add(what)
    if len(outs) != len(diff):
        raise Unsupported(f"{fqn}: {len(outs)} traced outputs for {len(diff)} returned")
    for i, d in enumerate(diff):
        if d != (i in tangents):
            # AOT gives an output that is (a view of) an input or of another output no gradient
            # input of its own: its gradient would be lost in the copy
            raise Unsupported(f"{fqn}: output {i} aliases an input or another output")
    consts = {n.target: _attr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    lt = _LayerTrace(key, fqn, names, outs, spec.type is not tuple, grad_of, gm, diff, consts)
    _LAYERS[key] = lt
    return lt


def _run_record(layer, fqn: str, call: CallArgs, fake_mode) -> tuple[list, list] | None:
    """The ATen calls of one eager forward and backward of ``layer`` on fake tensors, as comparable
    tuples: op, arguments (a tensor as the input, state entry or earlier call output it is, else by
    shape, stride and dtype; a real tensor as a constant compared by value), output shapes; and the
    constants.  Tens of milliseconds where a joint export of the layer takes a third of a second
    (a LLaMA-3-8B layer); None where the eager run fails."""
    _, state = _state(layer)
    fakes = [
        (
            a.detach() if is_fake_of(fake_mode, a) else fake_mode.from_tensor(a.detach())
        ).requires_grad_(a.requires_grad)
        for a in call.tensors
    ]
    where: dict[int, tuple] = {id(t): ("state", i) for i, t in enumerate(state)}
    where.update((id(t), ("input", i)) for i, t in enumerate(fakes))
    alive: list = [*state, *fakes]  # ids stay unique while recorded
    ops: list = []
    consts: list = []
    prefix = fqn + "."

    def arg(a):
        if isinstance(a, torch.Tensor):
            w = where.get(id(a))
            if w is not None:
                return w
            if not is_fake(a) and a.device.type != "meta":
                alive.append(a)
                consts.append(a)
                return ("const", len(consts) - 1)
            return ("tensor", tuple(a.shape), tuple(a.stride()), a.dtype)
        if isinstance(a, str):
            return a[len(prefix) :] if a.startswith(prefix) else a
        if isinstance(a, float):
            return ("float", a.hex())
        if isinstance(a, (int, bool, type(None), torch.dtype, torch.device, torch.layout)):
            return a
        return (type(a).__name__, repr(a))

    def observe(func, args, kwargs, out):
        k = len(ops)
        outs, _ = tree_flatten(out)
        shapes = []
        for j, t in enumerate(outs):
            if isinstance(t, torch.Tensor):
                where[id(t)] = ("op", k, j)
                alive.append(t)
                shapes.append((tuple(t.shape), t.dtype))
        ops.append((str(func), tree_map(arg, tuple(args)), tree_map(arg, dict(kwargs)), shapes))

    def run():
        args, kwargs = call.rebuild(fakes)
        out = type(layer).forward(layer, *args, **kwargs)
        leaves = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        diff = [x for x in leaves if x.requires_grad]
        wrt = [t for t in (*state, *fakes) if t.requires_grad]
        if diff and wrt:
            torch.autograd.grad(diff, wrt, [torch.ones_like(x) for x in diff], allow_unused=True)

    try:
        with fake_mode:
            run_observed(run, observe)
    except Exception as e:  # noqa: BLE001 - any failure means: compare the joint graphs instead
        log.debug("eager run of %s for the layer check failed: %r", fqn, e)
        return None
    return ops, consts


def _same_run(a: tuple[list, list] | None, b: tuple[list, list] | None) -> bool | None:
    """Two ``_run_record``s ran the same ops on the same arguments; None when one is missing."""
    if a is None or b is None:
        return None
    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    return all(
        x.shape == y.shape and x.dtype == y.dtype and _equal(x, y) for x, y in zip(a[1], b[1])
    )


def _trace_key(lt: _LayerTrace) -> list:
    """A layer's joint graph as comparable tuples: op, target, arguments (nodes by position, marker
    tags relative to the layer), value shapes and dtypes; tensor constants by shape and dtype."""
    pos = {n: i for i, n in enumerate(lt.joint.graph.nodes)}
    prefix = lt.fqn + "."

    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", pos[a])
        if isinstance(a, str):
            return a[len(prefix) :] if a.startswith(prefix) else a
        if isinstance(a, float):
            return ("float", a.hex())
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(arg(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, arg(v)) for k, v in a.items()))
        return (
            type(a).__name__,
            a if isinstance(a, (int, bool, type(None), torch.dtype)) else repr(a),
        )

    out = []
    for n in lt.joint.graph.nodes:
        v = n.meta.get("val")
        val = (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
        target = str(n.target) if n.op != "get_attr" else None
        out.append((n.op, target, arg(n.args), arg(n.kwargs), val))
    return out


def _same_trace(a: _LayerTrace, b: _LayerTrace) -> bool:
    if a.out_meta != b.out_meta or a.diff != b.diff or a.grad_of != b.grad_of:
        return False
    if _trace_key(a) != _trace_key(b):
        return False
    ca = [n.target for n in a.joint.graph.nodes if n.op == "get_attr"]
    cb = [n.target for n in b.joint.graph.nodes if n.op == "get_attr"]
    for x, y in zip(ca, cb):  # tensor constants made in forward: equal values too
        tx, ty = a.consts[x], b.consts[y]
        if not isinstance(tx, torch.Tensor) or not isinstance(ty, torch.Tensor):
            if tx is not ty:
                return False
        elif tx.shape != ty.shape or tx.dtype != ty.dtype or not _equal(tx, ty):
            return False
    return True


def _equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    try:
        with no_fake_mode():  # the probing pass runs under the fake mode
            return bool(torch.equal(x, y))
    except Exception:  # a constant with no data to compare: not proven equal
        return False


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _stitch(gm: fx.GraphModule, traces: dict[str, _LayerTrace]) -> fx.GraphModule:
    """Replace every layer_fwd / layer_bwd pair by a copy of its layer's joint graph."""
    graph = gm.graph
    seq = max((n.meta.get("seq_nr", -1) for n in graph.nodes), default=-1) + 1
    # AOT tags a gradient accumulation with the sequence number of the last forward op (the
    # engine's last): in a plain trace that is the model's, so copies' accumulations get it too
    last = max(
        (
            n.meta["seq_nr"]
            for n in graph.nodes
            if n.meta.get("partitioner_tag") == "is_forward" and "seq_nr" in n.meta
        ),
        default=-1,
    )
    fwd = [n for n in graph.nodes if n.op == "call_function" and n.target is LAYER_FWD]
    bwd_of = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target is LAYER_BWD:
            bwd_of[(n.args[0], tuple(n.args[1]), tuple(n.args[2]))] = n
    # before edits
    pairs = [(f, bwd_of.pop((f.args[0], tuple(f.args[1]), tuple(f.args[2])), None)) for f in fwd]
    renamed: dict[str, dict[str, str]] = {}  # a layer graph's constants, under fresh names in gm
    for lt in traces.values():
        renamed[lt.key] = {}
        for target, value in (lt.consts or {}).items():
            name = f"_fxshard_layer_const_{len(renamed)}_{len(renamed[lt.key])}"
            setattr(gm, name, value)
            renamed[lt.key][target] = name
    for f, b in pairs:
        key, _, own = f.args[0].partition("@")
        seq = _inline(graph, traces[key], f, b, seq, last, renamed[key], own)
    if bwd_of:
        raise Unsupported(
            f"layer backward calls without their forward: {[n.name for n in bwd_of.values()]}"
        )
    graph.lint()
    gm.recompile()
    return gm


def _inline(
    graph: fx.Graph,
    lt: _LayerTrace,
    f: fx.Node,
    b: fx.Node | None,
    seq: int,
    last: int,
    consts: dict[str, str],
    own: str,
) -> int:
    """Copy ``lt.joint`` into ``graph``: forward nodes before ``f``, backward nodes before ``b``;
    the copy's ``seq_nr`` (which ties a backward op to its forward op) start at ``seq``, its
    gradient accumulations take ``last`` (as in a trace of the whole model)."""
    joint = lt.joint
    fqn = f.name
    state, inputs = list(f.args[1]), list(f.args[2])
    tags = (lt.fqn + ".", own + ".")  # the template's markers inside it -> this layer's
    grads = list(b.args[3]) if b is not None else []
    env: dict[fx.Node, object] = {}
    backward: set[fx.Node] = set()
    for p in joint.graph.nodes:
        if p.op != "placeholder":
            continue
        kind, what = describe(p.meta.get("desc"))
        if kind in ("param", "buffer"):
            env[p] = state[lt.state_names.index(what[len("inner.") :])]
        elif kind == "input":
            env[p] = inputs[what]
        elif kind == "tangent":
            if b is None:
                raise Unsupported(
                    f"{fqn}: a layer output needs a gradient but no backward call was traced"
                )
            env[p] = grads[what]
            backward.add(p)
    base = seq
    top = seq
    own_last = max(
        (
            n.meta["seq_nr"]
            for n in joint.graph.nodes
            if n.meta.get("partitioner_tag") == "is_forward" and "seq_nr" in n.meta
        ),
        default=None,
    )
    parts: tuple[list, list] = ([], [])
    for n in joint.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        in_bwd = n.meta.get("partitioner_tag") == "is_backward" or any(
            a in backward for a in n.all_input_nodes
        )
        if in_bwd:
            backward.add(n)
            if b is None:
                raise Unsupported(f"{fqn}: backward nodes but no backward call")
        parts[in_bwd].append(n)
    for where, nodes in ((f, parts[0]), (b, parts[1])):
        if nodes:
            top = _copy_nodes(graph, where, nodes, env, base, top, last, own_last, consts, tags)
    out = next(n for n in joint.graph.nodes if n.op == "output")
    fw_vals, g_vals = [], []
    for val, desc in zip(out.args[0], out.meta.get("desc", ())):
        kind, _ = describe(desc)
        if kind == "output":
            fw_vals.append(env[val])
        elif val is not None and kind in ("grad_param", "grad_input"):
            g_vals.append(env[val])
    for node, values in ((b, g_vals), (f, fw_vals)):  # the opaque calls' results -> the copies
        if node is None:
            continue
        for u in list(node.users):
            if u.op != "call_function" or u.target is not operator.getitem:
                raise Unsupported(f"{node.name} is used by {u.name} directly")
            u.replace_all_uses_with(values[u.args[1]])
            graph.erase_node(u)
        graph.erase_node(node)
    return top


def _copy_nodes(graph, where, nodes, env, base, top, last, own_last, consts, tags) -> int:
    add = torch.ops.aten.add.Tensor
    boundary = BOUNDARY
    with graph.inserting_before(where):
        for n in nodes:
            c = graph.node_copy(n, env.__getitem__)  # meta is copied (shallow: fake values shared)
            if c.op == "get_attr":
                # the layer graph's constant, not a model one of that name
                c.target = consts[n.target]
            elif c.target is boundary and c.args[1].startswith(tags[0]):
                c.args = (
                    c.args[0],
                    tags[1] + c.args[1][len(tags[0]) :],
                )  # the template's marker, this layer's name
            seq = n.meta.get("seq_nr")
            if seq is not None:
                # AOT tags accumulations with the last forward op's number, or the one after it
                if (
                    n.target is add
                    and own_last is not None
                    and seq >= own_last
                    and n.meta.get("partitioner_tag") == "is_backward"
                ):
                    c.meta["seq_nr"] = last  # an accumulation (the backward of an add is no add)
                else:
                    c.meta["seq_nr"] = base + seq
                    top = max(top, base + seq + 1)
            env[n] = c
    return top
