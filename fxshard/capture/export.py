"""The forward graph of a model: ``torch.export`` (non-strict), decomposed to core ATen."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ..ir import BUFFER, CONSTANT, INPUT, PARAM
from .common import Captured, FnModule, decomposition_table, record, take_scalar_inputs
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
    except Exception as e:  # surface which model failed, keep torch's reason
        raise RuntimeError(
            f"fxshard.capture: torch.export could not trace {type(module).__name__}: {e}"
        ) from e
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
        ep = ep.run_decompositions(decomposition_table())
    sig = ep.graph_signature
    if sig.buffers_to_mutate or sig.user_inputs_to_mutate:
        raise NotImplementedError(
            "fxshard.capture: the model mutates buffers/inputs in forward "
            f"({dict(sig.buffers_to_mutate)}); "
            f"in-place state updates are not supported by the sharding pass yet"
        )
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
            raise NotImplementedError(
                f"fxshard.capture: unsupported graph input kind {k} for {name}"
            )
    n_inputs = record(gm, [kinds[p.name] for p in gm.graph.nodes if p.op == "placeholder"])
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
