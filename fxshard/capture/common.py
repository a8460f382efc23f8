"""What every capture path shares: the capture result, the decompositions, the node records.

Every placeholder knows what it is (parameter / buffer / constant / user input / tangent) and its
FQN; every op node keeps the module it came from (``nn_module_stack``), its source line and a
fake-tensor ``meta["val"]``.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .._torch import (
    control_flow_op,
    is_data_dependent_error,
    module_children_slot,
    module_tensor_slots,
    record_frames_of,
    torch_decomposition,
    tree_flatten,
    tree_unflatten,
)
from ..ir import BOUNDARY, INPUT, TANGENT, NodeKind, info
from ..rules import stand_ins


@dataclass
class Captured:
    """A captured program: the graph and the state it runs on, then what the stages decide.

    Made once by ``fxshard.capture`` (graph, state, config, constraints); ``annotate`` and the
    stages after it record their results here (``stage``, ``warnings``, ``auto``)."""

    gm: fx.GraphModule
    # parameters, buffers and constants by FQN (every alias of a tied one)
    state: dict[str, torch.Tensor]
    num_inputs: int
    model: nn.Module | None
    out_spec: object = None  # pytree spec of the model's outputs (None: a flat tuple or one value)
    # a joint forward+backward graph (outputs: forward outputs, then gradients)
    training: bool = False
    scalar_inputs: dict = field(default_factory=dict)  # input position -> the Python value baked in
    # what of the model the trace baked in (plain attributes, train / eval, which tensors)
    snapshot: ModelSnapshot | None = None
    # ShardConfig: mesh, cost model, collective options (fxshard.capture sets it)
    config: object = None
    constraints: object = None  # PlanConstraints of the user's plan (fxshard.capture sets it)
    stage: str = "captured"  # captured -> annotated -> redistributed
    warnings: list[str] = field(default_factory=list)  # annotate's fallbacks
    auto: object = None  # plan="auto": the solver's AutoReport
    # dynamic shapes: the symbolic graph the (hinted) ``gm`` stands for (``capture.symbolic``)
    symbolic: object = None
    # per forward output: eager torch would return it as a DTensor (``ir.eager_dtensor_outputs``)
    dtensor_outputs: tuple = ()

    @property
    def mesh(self):
        """The mesh (``config.mesh``)."""
        return self.config.mesh

    @property
    def cost_model(self):
        """The cost model (``config.cost_model``)."""
        return self.config.cost_model


class FnModule(nn.Module):
    """A plain callable as a module (what export and AOT trace)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn
        record_frames_of(fn)

    def forward(self, *args):
        return self.fn(*args)


class _StandIns(TorchFunctionMode):
    """Calls of library ops replaced by fxshard's traceable stand-ins (``rules.ops``)."""

    def __init__(self, table: dict):
        super().__init__()
        self.table = table

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.table.get(func, func)(*args, **(kwargs or {}))


def stand_in_ops():
    """Context of a training capture: library ops whose autograd cannot be traced run as
    fxshard's stand-ins (transformers' grouped_mm_fallback as ``fxshard::grouped_mm``)."""
    table = stand_ins()
    return _StandIns(table) if table else contextlib.nullcontext()


def decomposition_table() -> dict:
    """torch.export's default decompositions but scaled-dot-product attention (sharding it on
    batch and heads is simple; its decomposition is a forest of masks and matmuls).  A fresh dict
    each call, from one built once: building it costs ~70 ms."""
    return dict(_decompositions())


@functools.lru_cache(maxsize=1)
def _decompositions():
    table = torch.export.default_decompositions()
    for op in list(table.keys()):
        if "scaled_dot_product" in str(op):
            del table[op]
    # functionalised slice writes (`buf[..., :k].copy_(x)`: DeepSeek's MLA keys) leave aten.copy,
    # which has no sharding rule: it is its source, cast and broadcast to the destination
    table[torch.ops.aten.copy.default] = _copy
    # log_softmax as max, exp, sum and log (its backward is decomposed already): over a split dim
    # (vocab-sharded logits) these are partial reductions of a value per row, so a cross-entropy
    # is computed on the shards (loss parallel) instead of moving the logits
    log_softmax = torch.ops.aten._log_softmax.default
    table[log_softmax] = torch_decomposition(log_softmax)
    return table


def _copy(self, src, non_blocking=False):
    return src.to(dtype=self.dtype, device=self.device).expand(self.shape).clone()


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


@functools.lru_cache(maxsize=1)
def _package_dirs() -> tuple[str, str, str]:
    """The resolved directories of the imported torch and fxshard packages, and fxshard's capture
    machinery: frames are told apart by these, never by path text (a user's clone of this project
    lands in a folder named ``fxshard``; their own code may live under one named ``torch``)."""
    import os

    def where(module_file: str) -> str:
        return os.path.join(os.path.dirname(os.path.realpath(module_file)), "")

    capture = where(__file__)  # this file is fxshard/capture/common.py
    ours = os.path.join(os.path.dirname(os.path.dirname(capture)), "")
    return where(torch.__file__), ours, capture


@functools.lru_cache(maxsize=4096)
def frame_kind(path: str) -> str:
    """What a frame's file is: ``torch``, ``capture`` (fxshard's capture machinery: its hooks and
    opaque layers), ``fxshard`` (the rest of the package), ``internal`` (``<string>``,
    ``<eval_with_key>``) or ``user``."""
    import os

    if path.startswith("<"):
        return "internal"
    real = os.path.realpath(path)
    torch_dir, ours, capture = _package_dirs()
    if real.startswith(torch_dir):
        return "torch"
    if real.startswith(capture) or real == os.path.join(ours, "ir.py"):
        return "capture"
    return "fxshard" if real.startswith(ours) else "user"


def source_line(stack_trace: str | None) -> tuple[str, str]:
    """(file:line, code) of the innermost user frame of a stack trace."""
    if not stack_trace:
        return "", ""
    lines = stack_trace.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.search(lines[i])
        path = m.group(1) if m else ""
        if m and frame_kind(path) in ("user", "fxshard"):  # fxshard's zoo models are a user's
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}", code
    return "", ""


def module_name(module: nn.Module) -> str:
    """What the user calls the traced thing: the model's class, or the function's name."""
    if isinstance(module, FnModule):
        return getattr(module.fn, "__qualname__", None) or type(module.fn).__name__
    return type(module).__name__


def _user_frame(e: BaseException) -> tuple[str, str]:
    """(file:line, code) of the innermost frame outside torch and fxshard in ``e``'s chain."""
    import linecache
    import traceback

    best = ("", "")
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for fr in traceback.extract_tb(e.__traceback__):
            path = fr.filename
            if frame_kind(path) != "user":
                continue
            code = (fr.line or linecache.getline(path, fr.lineno or 0)).strip()
            best = (f"{path.rsplit('/', 1)[-1]}:{fr.lineno}", code)
        e = e.__cause__ or e.__context__
    return best


def trace_error(module: nn.Module, e: BaseException, what: str = "trace") -> RuntimeError:
    """The error to raise when tracing ``module`` failed: what, where in the user's code, and
    what to do for the failures users meet (value-dependent shapes and branches)."""
    name = module_name(module)
    where, code = _user_frame(e)
    at = f" at {where}" + (f" (`{code}`)" if code else "") if where else ""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
    if is_data_dependent_error(e):
        return RuntimeError(
            f"fxshard.capture: {name} has a shape or a branch that depends on tensor values{at}. "
            "A sharded program is traced once, with every shape and branch fixed: compute the "
            "value outside the model and pass it in (a Python number is baked in), or use masking "
            f"(torch.where) instead of boolean indexing, nonzero or `if` on a tensor. "
            f"(torch: {first})"
        )
    returned = _UNKNOWN_OUTPUT.search(str(e))
    if returned:
        kind = returned.group(1).rsplit(".", 1)[-1]
        cache = "Cache" in kind
        return RuntimeError(
            f"fxshard.capture: {name} returns a {kind}, which holds tensors fxshard cannot hand "
            "back from a program of fxshard.shard (it returns tensors and containers of them; "
            "fxshard.parallelize hands such objects back, their tensors kept sharded). "
            + (
                "transformers makes and returns this cache by default (use_cache=True): call the "
                "model with use_cache=False (or set model.config.use_cache = False) where the "
                "cache is not needed (training, scoring); to generate with it kept sharded "
                'between calls use torch.compile(model, backend="fxshard", options=...) or '
                'model.compile(backend="fxshard", options=...).'
                if cache
                else "Return its tensors (a tuple, dict or dataclass of tensors), or register "
                "the type with torch.utils._pytree."
            )
            + f" (torch: {first})"
        )
    return RuntimeError(f"fxshard.capture: could not {what} {name}{at}: {type(e).__name__}: {e}")


# pytree's words for an output it cannot flatten (torch.export and AOTAutograd say the same)
_UNKNOWN_OUTPUT = re.compile(r"Found <class '([\w.]+)'> in output, which is not a known type")


def _at(node: fx.Node) -> str:
    """`` at file:line (`code`)`` of the user's line that made ``node``, or nothing."""
    where, code = source_line(node.meta.get("stack_trace"))
    return f" at {where}" + (f" (`{code}`)" if code else "") if where else ""


def check_control_flow(gm: fx.GraphModule, module: nn.Module) -> None:
    """torch.cond / while_loop / ... are not sharded, nor are shapes that depend on tensor values
    (``x[mask]``, ``nonzero``): a clear error naming where they are."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        vals = val if isinstance(val, (tuple, list)) else (val,)
        if any(
            isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape)
            for v in vals
        ):
            at = _at(node)
            raise RuntimeError(
                f"fxshard.capture: {module_name(module)} makes a tensor whose shape depends on "
                f"tensor values{at} (node {node.name}: {node.target}). A sharded program is traced "
                "once, with every shape fixed: use masking (torch.where, multiplying by the mask) "
                "instead of boolean indexing, nonzero, masked_select or unique"
            )
        if node.target is torch.ops.aten._local_scalar_dense.default:
            at = _at(node)
            raise RuntimeError(
                f"fxshard.capture: {module_name(module)} reads a tensor's value into Python{at} "
                f"(node {node.name}: aten._local_scalar_dense, from .item() / float() / int()). "
                "The per-rank program is traced once and cannot carry a Python number computed "
                "from a sharded value: "
                "keep it a tensor (x * x.sum() instead of x * x.sum().item())"
            )
        op = control_flow_op(node)
        if op is None:
            continue
        at = _at(node)
        raise NotImplementedError(
            f"fxshard.capture: {module_name(module)} uses torch.{op}{at} (node {node.name}); "
            "fxshard does not shard control-flow operators yet: compute both branches and pick "
            "with torch.where, or run the loop in Python outside the compiled region"
        )


# Checks of trace-time metadata (``.to(dtype)`` emits one per call): the per-rank program's dtypes,
# devices and shapes are fixed by the trace (and its inputs' by the signature check), and a check
# of global sizes would fail on a shard; they are dropped, so they never hold up a placement.
TRACE_CHECKS = frozenset({torch.ops.aten._assert_tensor_metadata.default})


def drop_trace_checks(gm: fx.GraphModule) -> int:
    """Remove the metadata checks a trace left (no outputs, no effect on data); how many."""
    gone = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target in TRACE_CHECKS and not n.users
    ]
    for n in gone:
        gm.graph.erase_node(n)
    if gone:
        gm.recompile()
    return len(gone)


def record(gm: fx.GraphModule, kinds: list[tuple[str, object]], roots: dict | None = None) -> int:
    """Fill every node's NodeInfo (kind, FQN, module, source line) from ``kinds``, one (kind, FQN)
    per placeholder (a tangent's "FQN" is the index of its forward output); returns the number of
    user inputs."""
    n_inputs = 0
    placeholders = iter(kinds)
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder":
            kind, fqn = next(placeholders)
            rec.kind = NodeKind(kind)
            if kind == INPUT:
                rec.input_index = n_inputs
                n_inputs += 1
            elif kind == TANGENT:
                rec.output_index = fqn
            else:
                rec.fqn = fqn
        elif node.op == "output":
            rec.kind = NodeKind.OUTPUT
        else:
            if node.target is BOUNDARY:
                rec.kind = NodeKind.BOUNDARY
                rec.tag = node.args[1]
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                rec.module = path_fqn(list(stack.values())[-1][0], roots)
            rec.source, rec.code = source_line(node.meta.get("stack_trace"))
    return n_inputs


def take_scalar_inputs(gm: fx.GraphModule, example_inputs: Sequence) -> dict[int, object]:
    """Python numbers among the inputs are baked into the traced graph as constants: drop their
    (unused) placeholders; ``{input position: value}``, for the call-time check that a program is
    called with the values it was traced with."""
    out = {}
    for p in list(gm.graph.nodes):
        rec = info(p)
        if p.op == "placeholder" and rec.kind == NodeKind.INPUT:
            v = example_inputs[rec.input_index] if rec.input_index < len(example_inputs) else None
            if not isinstance(v, torch.Tensor) and not p.users:
                out[rec.input_index] = v
                gm.graph.erase_node(p)
    if out:
        gm.graph.lint()
        gm.recompile()
    return out


# a dynamo source's frame root: a local (``L['self']``), or an item of one (``L['args'][0]``: the
# module of a forward wrapped in ``def inner(*args, **kwargs)``, as transformers' decorators do)
# (globals, G[...], are not roots: their parameters are inputs, their module paths stay qualified)
_ROOT = re.compile(r"^L\['([^']+)'\]((?:\[\d+\])*)")


def normalize_source(source: str) -> str:
    """A dynamo source with ``.__dict__['_modules']`` (how dynamo reads some wrapped modules)
    spelled ``._modules`` (likewise parameters and buffers)."""
    return re.sub(r"\.__dict__\['(_modules|_parameters|_buffers)'\]", r".\1", source)


def source_root(source: str) -> tuple[str, str, tuple[int, ...], int] | None:
    """(root key, frame local, item indices, end) of a source's frame root: ``L['args'][0]...``
    -> ("args[0]", "args", (0,), 12); None for a source not rooted in a frame local."""
    m = _ROOT.match(source)
    if m is None:
        return None
    idx = tuple(int(i) for i in re.findall(r"\d+", m.group(2)))
    return m.group(1) + m.group(2), m.group(1), idx, m.end()


def path_fqn(path: str, roots: dict | None) -> str:
    """FQN of a module path such as ``L['layer'].attention.wq``: the frame local's FQN (``roots``,
    e.g. {"layer": "layers.1."}) + the rest."""
    path = normalize_source(path)
    root = source_root(path)
    prefix = (roots or {}).get(root[0], "") if root else ""
    fqn = _clean_fqn(path)
    return (prefix + fqn if fqn else prefix.rstrip(".")) if prefix else fqn


def _clean_fqn(path: str) -> str:
    # nn_module_stack paths look like "L['self'].layers[0].attention" in some versions; normalise
    root = source_root(path)
    if root is not None:
        path = path[root[3] :].lstrip(".")
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def check_no_input_mutation(gm: fx.GraphModule) -> None:
    for n in gm.graph.nodes:
        if (
            n.op == "call_function"
            and n.target is torch.ops.aten.copy_.default
            and n.args[0].op == "placeholder"
        ):
            raise NotImplementedError(
                f"fxshard: the compiled code mutates its input {n.args[0].name} in place; in-place "
                "updates of "
                f"parameters, buffers or inputs inside a sharded graph are not supported yet"
            )


_PLAIN = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class ModelSnapshot:
    """What a trace bakes into the program besides the tensors' values: every module's plain
    Python attributes (numbers, strings, flags; train / eval mode) and which tensor each parameter
    and buffer name holds.  ``changes(model)`` lists what differs now; a program traced once does
    not see such a change (``torch.compile`` guards on them and recompiles)."""

    attrs: tuple  # ((module fqn, attribute, value), ...)
    tensors: tuple  # ((fqn, id of the tensor), ...)
    # the same, as (dict, key, value or id) of the live modules: what every call compares (walking
    # the module tree again and naming everything cost ~1.6 ms a call on a 32-layer Llama)
    watch: tuple = field(default=(), compare=False, repr=False)

    @classmethod
    def of(cls, model: nn.Module) -> ModelSnapshot:
        attrs, watch = [], []
        for fqn, m in model.named_modules(remove_duplicate=False):
            d = vars(m)
            for k, v in d.items():
                if isinstance(v, _PLAIN) or (
                    isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)
                ):
                    attrs.append((fqn, k, v))
                    watch.append((d, k, v, False))
            for table in (*module_tensor_slots(m), module_children_slot(m)):
                watch += [(table, k, id(t), True) for k, t in table.items()]
        tensors = [(f, id(t)) for f, t in model.named_parameters(remove_duplicate=False)]
        tensors += [(f, id(t)) for f, t in model.named_buffers(remove_duplicate=False)]
        return cls(tuple(attrs), tuple(tensors), tuple(watch))

    def _unchanged(self) -> bool:
        missing = object()
        for d, k, v, by_id in self.watch:
            now = d.get(k, missing)
            if now is missing or (id(now) != v if by_id else not (now is v or now == v)):
                return False
        return bool(self.watch)

    def changes(self, model: nn.Module) -> list[str]:
        if self._unchanged():
            return []
        now = ModelSnapshot.of(model)
        if now == self:
            return []
        out = []
        was = {(f, k): v for f, k, v in self.attrs}
        for f, k, v in now.attrs:
            if (f, k) in was and was[(f, k)] != v:
                out.append(
                    f"{f + '.' if f else ''}{k} was {was[(f, k)]!r} when traced, is {v!r} now"
                )
        ids = dict(self.tensors)
        for f, i in now.tensors:
            if f in ids and ids[f] != i:
                out.append(
                    f"{f} is another tensor than when traced (the program holds the old one)"
                )
        return out


def lift_constants(gm: fx.GraphModule, mode, prefix: str = "") -> dict[str, torch.Tensor]:
    """Tensor constants the trace made (``get_attr`` of ``_tensor_constant0``: a ``torch.tensor``
    in the model's code, e.g. HF's cache and mask helpers) become placeholders of kind constant,
    after the others: placed like any state (replicated unless a search shards them, sliced
    locally), their values in the program's state under their attribute names."""
    graph = gm.graph
    found: dict[str, list[fx.Node]] = {}  # one placeholder per constant, however many read it
    for n in graph.nodes:
        if n.op == "get_attr" and isinstance(getattr(gm, n.target, None), torch.Tensor):
            found.setdefault(n.target, []).append(n)
    if not found:
        return {}
    # after the last placeholder that is no incoming gradient (a joint graph's tangents stay last)
    last = [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")][
        -1
    ]
    out = {}
    for target, nodes in found.items():
        value = getattr(gm, target).detach()
        with graph.inserting_after(last):
            p = graph.placeholder(prefix + target)
        p.meta.update(nodes[0].meta)
        p.meta["val"] = mode.from_tensor(value, static_shapes=True)  # a constant's shape is fixed
        for n in nodes:
            n.replace_all_uses_with(p)
            graph.erase_node(n)
        delattr(gm, target)
        out[p.target] = value
        last = p
    return out


CONSTANT_LEAVES = (type(None), bool, int, float, str, torch.dtype, torch.device)


class CallArgs:
    """How a module is called: its tensors (a trace's inputs, in pytree order of ``(args,
    kwargs)``) and everything else (``None``, numbers, strings, flags), which the trace bakes in:
    part of the call's signature (``key``).  ``unsupported``: the type names of leaves that are
    neither (an object pytree does not know, e.g. a cache)."""

    def __init__(self, args: tuple, kwargs: dict):
        leaves, self.spec = tree_flatten((tuple(args), dict(kwargs)))
        self.tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        self.unsupported = [
            type(x).__name__ for x in leaves if not isinstance(x, (torch.Tensor, *CONSTANT_LEAVES))
        ]
        self.constants = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
        self.is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)

    def key(self) -> tuple:
        return (str(self.spec), self.constants, self.is_tensor)

    def rebuild(self, tensors: Sequence) -> tuple[tuple, dict]:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        return tree_unflatten(leaves, self.spec)
