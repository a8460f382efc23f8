"""The joint forward+backward graph of a model: AOTAutograd's export with descriptors.

Placeholders: parameters, buffers, user inputs, then one tangent (incoming gradient) per
differentiable forward output.  Outputs: the forward outputs, then the gradient of every parameter
(and of every user input that requires grad); the output node's ``roles`` say which is which.
Complete gradients of forward values are marked (``grad:<forward node>`` boundaries) so that
annotation can place them like the values.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import (
    describe,
    export_joint,
    fake_mode,
    fake_mode_of,
    is_fake_of,
    lazy_graph_modules,
    library_tracing,
    module_tensor_slots,
    use_flat_codegen,
)
from ..ir import (
    BOUNDARY,
    BUFFER,
    CONSTANT,
    GRAD_TAG,
    INPUT,
    PARAM,
    TANGENT,
    Role,
    flat_outputs,
    info,
)
from . import stitch
from .common import (
    Captured,
    FnModule,
    check_control_flow,
    check_no_input_mutation,
    decomposition_table,
    drop_trace_checks,
    lift_constants,
    record,
    stand_in_ops,
    take_scalar_inputs,
    trace_error,
)
from .markers import Markers

log = logging.getLogger("fxshard.stitch")


def capture_joint(
    model: nn.Module | Callable,
    example_inputs: Sequence,
    boundaries: dict[str, tuple[int, int]] | None = None,
    input_kinds: Sequence[tuple[str, str | None]] | None = None,
    reuse_layers: bool = False,
) -> Captured:
    """The joint forward+backward ATen graph of ``model`` on ``example_inputs``.

    ``input_kinds``: (kind, FQN) per tensor input, when some inputs are really parameters or buffers
    (a dynamo graph takes its parameters as inputs); user inputs are then renumbered.

    ``reuse_layers``: trace each repeated layer once and stitch copies of its joint graph in
    (``fxshard.capture.stitch``: the model's own code is still traced, layers of equal state are
    assumed to compute the same function); falls back to the plain trace, with a log line, where
    that does not apply."""
    module = model if isinstance(model, nn.Module) else FnModule(model)
    gm, out_spec = _export(module, example_inputs, boundaries, reuse_layers)
    check_control_flow(gm, module)
    drop_trace_checks(gm)
    use_flat_codegen(gm)  # AOT's pytree codegen groups inputs/outputs as (primals, tangents)
    kinds = _placeholder_kinds(gm, input_kinds)
    mark_gradients(gm)
    n_inputs = record(gm, kinds)
    # tensor constants the trace made (a torch.tensor in the model's code: Gemma-2's normaliser,
    # HF's mask helpers) are placeholders of kind constant, as in the backend's graphs
    mode = fake_mode_of([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    constants = lift_constants(gm, mode, prefix="primals_")  # the partitioner's primals
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.target in constants:
            info(n).kind, info(n).fqn = CONSTANT, n.target
    scalars = take_scalar_inputs(gm, example_inputs)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    info(out).roles = tuple(_output_roles(out, input_kinds))
    _merge_tied(gm, module)
    check_no_input_mutation(gm)
    # every name a shared tensor goes by (AOT may name its placeholder by any of them)
    state = {f: t.detach() for f, t in module.named_parameters(remove_duplicate=False)}
    state.update({f: t.detach() for f, t in module.named_buffers(remove_duplicate=False)})
    state.update(constants)
    return Captured(
        gm,
        state,
        n_inputs,
        model if isinstance(model, nn.Module) else None,
        out_spec=out_spec,
        training=True,
        scalar_inputs=scalars,
    )


def _merge_tied(gm: fx.GraphModule, module: nn.Module) -> None:
    """AOT lifts a tied tensor once per name: make it one placeholder (its other names in
    ``aliases``) with one gradient, the sum of the per-name contributions, handed back under every
    name."""
    ident: dict[str, int] = {}
    for fqn, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        ident[fqn] = id(t)
    groups: dict[int, list[fx.Node]] = {}
    for p in gm.graph.nodes:
        rec = info(p)
        if p.op == "placeholder" and rec.kind in (PARAM, BUFFER) and rec.fqn in ident:
            groups.setdefault(ident[rec.fqn], []).append(p)
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    roles, flat = list(info(out).roles), flat_outputs(out)
    changed = False
    for group in groups.values():
        if len(group) < 2:
            continue
        keep, names = group[0], [info(p).fqn for p in group]
        for p in group[1:]:
            p.replace_all_uses_with(keep)
            gm.graph.erase_node(p)
        info(keep).aliases = tuple(names[1:])
        at = [i for i, r in enumerate(roles) if r.kind == "grad_param" and r.what in names]
        grads = [flat[i] for i in at if isinstance(flat[i], fx.Node)]
        total = grads[0] if grads else None
        for g in grads[1:]:
            with gm.graph.inserting_before(out):
                total = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, g))
            total.meta.update({k: v for k, v in g.meta.items() if k in ("val", "partitioner_tag")})
            info(total)
        for i in at:
            flat[i] = total
        changed = True
    if changed:
        out.args = (tuple(flat),)
        gm.graph.lint()
        gm.recompile()


def _export(module: nn.Module, example_inputs: Sequence, boundaries, reuse_layers: bool):
    """(joint GraphModule, pytree spec of the forward outputs) on fake copies of the inputs."""
    fm = fake_mode_of(example_inputs) or fake_mode(allow_non_fake_inputs=True)
    fakes = [
        fm.from_tensor(x) if isinstance(x, torch.Tensor) and not is_fake_of(fm, x) else x
        for x in example_inputs
    ]
    try:
        with (
            _restored_state(module),
            Markers(module, boundaries) as markers,
            warnings.catch_warnings(),
            lazy_graph_modules(),
            stand_in_ops(),
            library_tracing(),
        ):
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            # reuse_layers stops a trace from inside a layer's backward (a fallback): not an error
            warnings.filterwarnings("ignore", message="Error detected in .*fxshard_layer_fwd")
            if reuse_layers:
                gm, out_spec = _export_stitched(module, fm, fakes, markers)
                if gm is not None:
                    return gm, out_spec
            with fm:
                return export_joint(module, fakes, decomposition_table())
    except Exception as e:
        raise trace_error(module, e, "trace the forward+backward of") from e


@contextlib.contextmanager
def _restored_state(module: nn.Module):
    """AOT swaps parameters for traced ones and back; a module reachable by two paths (a ModuleList
    slice kept as an attribute) comes back holding the traced ones: put the originals back after."""
    slots = [
        (table, n, t)
        for m in module.modules()
        for table in module_tensor_slots(m)
        for n, t in table.items()
    ]
    try:
        yield
    finally:
        for table, n, t in slots:
            if table.get(n) is not t:
                table[n] = t


def _placeholder_kinds(gm: fx.GraphModule, input_kinds) -> list[tuple[str, object]]:
    """(kind, FQN or tangent's output index) of every placeholder, from AOT's descriptors."""
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
                mutated = _mutated_name(p.meta.get("desc"), input_kinds)
                if mutated is not None:  # the tangent of a state the forward updates in place
                    raise NotImplementedError(_updates_in_place([mutated]))
                raise NotImplementedError(
                    f"fxshard.capture: unsupported tangent {p.meta.get('desc')}"
                )
            kinds.append((TANGENT, what))
        else:
            raise NotImplementedError(
                f"fxshard.capture: unsupported joint-graph input {p.meta.get('desc')}"
            )
    return kinds


def _updates_in_place(updated: list) -> str:
    return (
        f"fxshard.capture: the model updates {sorted(set(updated))} in place during a training "
        f"step (BatchNorm running statistics in train mode, say); sharded training programs "
        f"do not apply in-place state updates yet: put such modules in eval() mode, or move "
        f"the update out of forward (forward-only programs apply them)"
    )


def _input_name(what, input_kinds) -> str:
    """A joint-graph input by its FQN (a dynamo graph's inputs are numbered)."""
    if isinstance(what, int) and input_kinds is not None and what < len(input_kinds):
        return input_kinds[what][1] or f"input {what}"
    return str(what)


def _mutated_name(desc, input_kinds) -> str | None:
    """The FQN (or "input i") of the state whose in-place update a tangent belongs to, or None."""
    output = getattr(desc, "output", None)
    kind, what = describe(output) if output is not None else ("", None)
    return _input_name(what, input_kinds) if kind.startswith("mutate_") else None


def _output_roles(out: fx.Node, input_kinds) -> list[Role]:
    """The role of every output; gradients of inputs that are really parameters become the
    parameters' gradients."""
    roles = [describe(d) for d in out.meta.get("desc", ())]
    updated = [_input_name(r[1], input_kinds) for r in roles if r[0].startswith("mutate_")]
    if updated:  # BatchNorm updating its running statistics in train mode, say
        raise NotImplementedError(_updates_in_place(updated))
    other = [r[0] for r in roles if r[0] not in ("output", "grad_param", "grad_input", "NoneType")]
    if other:
        raise NotImplementedError(
            f"fxshard.capture: the model's forward+backward has outputs of kind "
            f"{sorted(set(other))}, which sharded training programs do not support"
        )
    if input_kinds is not None:
        user_index = {}
        for i, (kind, _) in enumerate(input_kinds):
            if kind == INPUT:
                user_index[i] = len(user_index)
        roles = [
            (
                ("grad_param", input_kinds[r[1]][1])
                if input_kinds[r[1]][0] == PARAM
                else ("grad_input", user_index.get(r[1]))
            )
            if r[0] == "grad_input"
            else r
            for r in roles
        ]
    return [Role(*r) for r in roles]


def _export_stitched(module: nn.Module, fm, fakes, markers: Markers):
    """(joint graph, out spec) with each repeated layer traced once, or (None, None) where the
    model does not allow it (logged)."""
    try:
        with stitch.opaque_layers(module, fm, fakes, decomposition_table(), markers) as inline:
            with fm:
                gm, out_spec = export_joint(module, fakes, decomposition_table())
            return inline(gm), out_spec
    except Exception as e:  # anything in the way: the plain trace (which reports its own errors)
        cause = e
        while cause is not None and not isinstance(cause, stitch.Unsupported):
            cause = cause.__cause__ or cause.__context__
        why = cause if cause is not None else f"{type(e).__name__}: {e}"
        quiet = str(why).startswith("no repeated layers")  # nothing to reuse: not worth a line
        (log.debug if quiet else log.info)(
            "fxshard.capture: tracing every layer (reuse_layers does not apply: %s)", why
        )
        return None, None


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def mark_gradients(gm: fx.GraphModule) -> None:
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
    views = {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.permute.default,
        aten.transpose.int,
        aten.t.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.alias.default,
        aten.expand.default,
        aten.slice.Tensor,
        aten.select.int,
    }

    for b in list(gm.graph.nodes):
        if (
            b.op != "call_function"
            or b.meta.get("partitioner_tag") != "is_backward"
            or not _is_tensor(b)
        ):
            continue
        groups = {}
        for u in b.users:
            if (
                u.op == "call_function"
                and u.meta.get("seq_nr") != b.meta.get("seq_nr")
                and not is_accumulation(u)
            ):
                groups.setdefault(u.meta.get("seq_nr"), []).append(u)
        for seq, users in groups.items():
            shape = tuple(b.meta["val"].shape)
            match = [
                f
                for f in forward.get(seq, ())
                if _is_tensor(f) and tuple(f.meta["val"].shape) == shape and f.target not in views
            ]
            if not match:
                continue
            with gm.graph.inserting_after(b):
                m = gm.graph.call_function(BOUNDARY, (b, f"{GRAD_TAG}{match[-1].name}"))
            m.meta.update(
                {
                    k: v
                    for k, v in b.meta.items()
                    if k in ("val", "seq_nr", "partitioner_tag", "nn_module_stack", "stack_trace")
                }
            )
            for u in users:
                u.replace_input_with(b, m)
    gm.graph.lint()
    gm.recompile()
