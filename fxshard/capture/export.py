"""The forward graph of a model: ``torch.export`` (non-strict), decomposed to core ATen."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ..ir import BUFFER, CONSTANT, INPUT, PARAM, Role, info
from .common import (
    Captured,
    FnModule,
    check_control_flow,
    decomposition_table,
    drop_trace_checks,
    module_name,
    record,
    take_scalar_inputs,
    trace_error,
)
from .markers import Markers


def capture_forward(
    model: nn.Module | Callable,
    example_inputs: Sequence,
    boundaries: dict[str, tuple[int, int]] | None = None,
) -> Captured:
    """Trace ``model`` on ``example_inputs``.  ``boundaries`` names modules whose first inputs /
    outputs get ``fxshard::boundary`` marker nodes (the plan constrains placements there)."""
    module = model if isinstance(model, nn.Module) else FnModule(model)
    try:
        with Markers(module, boundaries), warnings.catch_warnings():
            # torch's own pytree deprecation noise during export
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            ep = torch.export.export(module, tuple(example_inputs), strict=False)
    except Exception as e:  # surface which model failed and where, keep torch's reason
        raise trace_error(module, e, "trace (torch.export)") from e
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        ep = ep.run_decompositions(decomposition_table())
    sig = ep.graph_signature
    if sig.user_inputs_to_mutate:
        names = sorted(sig.user_inputs_to_mutate.values())
        raise NotImplementedError(
            f"fxshard.capture: {module_name(module)} updates its input(s) {names} in place; a "
            f"sharded program takes its inputs as values, so the update would be lost: return the "
            f"new value instead"
        )
    gm = ep.graph_module
    check_control_flow(gm, module)
    drop_trace_checks(gm)
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
            raise NotImplementedError(
                f"fxshard.capture: unsupported graph input kind {k} for {name}"
            )
    n_inputs = record(gm, [kinds[p.name] for p in gm.graph.nodes if p.op == "placeholder"])
    _state_updates(gm, sig)
    scalars = take_scalar_inputs(gm, example_inputs)
    for name, t in list(state.items()):
        if isinstance(t, nn.Parameter):
            state[name] = t.detach()
    return Captured(
        gm,
        state,
        n_inputs,
        model if isinstance(model, nn.Module) else None,
        out_spec=ep.call_spec.out_spec,
        scalar_inputs=scalars,
    )


def _state_updates(gm, sig) -> None:
    """A forward that updates a parameter or buffer in place returns its new value first: the
    output node's roles say so (``("mutate", fqn)``), and the program writes it back."""
    roles, k = [], 0
    for spec in sig.output_specs:
        kind = spec.kind.name
        if kind == "USER_OUTPUT":
            roles.append(Role("output", k))
            k += 1
        elif kind in ("BUFFER_MUTATION", "PARAMETER_MUTATION"):
            roles.append(Role("mutate", spec.target))
        else:
            raise NotImplementedError(f"fxshard.capture: unsupported graph output of kind {kind}")
    if len(roles) != k:
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        info(out).roles = tuple(roles)
