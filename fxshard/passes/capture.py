"""capture: an nn.Module or callable + example inputs -> an ATen FX graph to shard.

``torch.export`` (non-strict) traces the model; we then decompose to ATen with Inductor-free core
decompositions, except scaled-dot-product attention, which stays one op (sharding it on batch and
heads is simple; its decomposition is a forest of masks and matmuls).  Every placeholder knows what
it is (parameter / buffer / constant / user input) and its FQN; every op node keeps the module it
came from (``nn_module_stack``), its source line and a fake-tensor ``meta["val"]``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn

from ..adapter import record_frames_of

PARAM, BUFFER, CONSTANT, INPUT = "param", "buffer", "constant", "input"


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


def _install_boundary_hooks(module: nn.Module, hooked: dict[str, tuple[int, int]]):
    handles = []
    modules = dict(module.named_modules())
    for fqn, (n_in, n_out) in hooked.items():
        mod = modules[fqn]

        def pre(_m, args, fqn=fqn, n_in=n_in):
            return tuple(boundary(a, f"{fqn}:in:{i}") if i < n_in and isinstance(a, torch.Tensor) else a
                         for i, a in enumerate(args))

        def post(_m, _args, out, fqn=fqn, n_out=n_out):
            if isinstance(out, torch.Tensor):
                return boundary(out, f"{fqn}:out:0") if n_out > 0 else out
            if isinstance(out, tuple):
                return tuple(boundary(o, f"{fqn}:out:{i}") if i < n_out and isinstance(o, torch.Tensor) else o
                             for i, o in enumerate(out))
            return out

        if n_in:
            handles.append(mod.register_forward_pre_hook(pre))
        if n_out:
            handles.append(mod.register_forward_hook(post))
    return handles


def _decomposition_table():
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
    n_inputs = 0
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder":
            kind, fqn = kinds[node.name]
            rec.kind, rec.fqn = kind, fqn
            if kind == INPUT:
                rec.input_index = n_inputs
                n_inputs += 1
        elif node.op == "output":
            rec.kind = "output"
        else:
            if node.target is BOUNDARY:
                rec.kind = "boundary"
                rec.extra["tag"] = node.args[1]
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                rec.module = _clean_fqn(list(stack.values())[-1][0])
            rec.source, rec.code = _source(node.meta.get("stack_trace"))
    for name, t in list(state.items()):
        if isinstance(t, nn.Parameter):
            state[name] = t.detach()
    return Captured(gm, state, n_inputs, model if isinstance(model, nn.Module) else None)


def _clean_fqn(path: str) -> str:
    # nn_module_stack paths look like "L['self'].layers[0].attention" in some versions; normalise
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")
