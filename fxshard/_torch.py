"""Every private torch API fxshard uses, behind names of ours.

A torch upgrade that moves or renames something private breaks this file (and ``fxshard/rules/``,
the adapter to DTensor's op rules), nowhere else; ``tests/test_structure.py`` enforces it.  Public
torch API (``torch.distributed.tensor.Shard`` and friends, ``torch.export``, ``make_fx``) is used
directly elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as _pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import (  # noqa: F401  (re-exported)
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

StridedShard = _StridedShard

# pytree (torch has no public module for it)
tree_map = _pytree.tree_map
tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
register_pytree_node = _pytree.register_pytree_node
SequenceKey = _pytree.SequenceKey

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def record_aten_calls(fn: Callable, clone: Callable) -> list:
    """Run ``fn()`` and return every ATen call it made: ``[(op, clone(args), clone(kwargs))]``
    (``clone`` maps each argument, e.g. copying tensors; taken before the call runs)."""
    calls: list = []

    def before(func, args, kwargs, out):
        if isinstance(func, OpOverload):
            calls.append((func, tree_map(clone, tuple(args)), tree_map(clone, dict(kwargs))))

    run_observed(fn, before, before=True)
    return calls


def run_observed(fn: Callable, observe: Callable, before: bool = False) -> object:
    """``fn()``, with ``observe(op, args, kwargs, out)`` called after each ATen call it makes
    (``before``: ahead of it, ``out`` None), autograd's backward calls included (the mode travels
    with autograd's thread-local state)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Observer(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if before:
                observe(func, args, kwargs, None)
                return func(*args, **kwargs)
            out = func(*args, **kwargs)
            observe(func, args, kwargs, out)
            return out

    with Observer():
        return fn()


def opinfo_db() -> list:
    """torch's OpInfo database (``op_db``: every op's sample inputs), and its size constants made
    even so that samples shard on meshes of 2 (S=5 -> 4, M=10 -> 8, XS=3 -> 2)."""
    import sys

    from torch.testing._internal.common_methods_invocations import op_db

    for name, mod in list(sys.modules.items()):
        if name.startswith("torch.testing._internal") and mod is not None:
            for k, old, new in (("S", 5, 4), ("XS", 3, 2), ("M", 10, 8)):
                if getattr(mod, k, None) == old:
                    setattr(mod, k, new)
    return list(op_db)


_KINDS = {Shard: "S", Replicate: "R", Partial: "P", _StridedShard: "SS"}


def placement_kind(p: Placement) -> str | None:
    """ "S", "SS" (strided), "R", "P" or None.  Exact-type lookup first: isinstance on torch's
    placements goes through a slow metaclass hook, and planning asks this millions of times."""
    k = _KINDS.get(type(p))
    if k is not None:
        return k
    if isinstance(p, _StridedShard):
        return "SS"
    if isinstance(p, Shard):
        return "S"
    if isinstance(p, Partial):
        return "P"
    if isinstance(p, Replicate):
        return "R"
    return None


def is_strided_shard(p: Placement) -> bool:
    return placement_kind(p) == "SS"


def strided_split_factor(p: Placement) -> int:
    # 2.13+: split_factor may be a SymInt, which _split_factor_int guards; 2.11/2.12: a plain int
    f = getattr(p, "_split_factor_int", None)
    return int(f()) if f is not None else int(p.split_factor)


def per_rank(fn: Callable) -> Callable:
    """Run ``fn`` once per simulated rank under ``LocalTensorMode`` (plain call otherwise).

    Used for the rank-dependent index arithmetic of the executor: arguments that are per-rank
    (LocalTensor, per-rank SymInt coordinates) arrive as that rank's tensor / int.
    """
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)


def simulating() -> bool:
    """Whether ops run on simulated ranks (``LocalTensorMode`` is active)."""
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode() is not None


def local_tensor_mode(world_size: int):
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def make_local_tensor(per_rank_tensors: dict):
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank_tensors)


def local_tensor_values(t: torch.Tensor, world_size: int | None = None) -> dict:
    """{rank: tensor} of a LocalTensor (or an AsyncCollectiveTensor wrapping one).  A plain tensor
    (what simulation gives for a value identical on every rank) maps to every rank."""
    from torch.distributed._local_tensor import LocalTensor

    if hasattr(t, "wait") and not isinstance(t, LocalTensor):
        t = t.wait()
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    if world_size is None:
        raise TypeError("a plain tensor holds no per-rank values; pass world_size")
    return {r: t for r in range(world_size)}


def coordinate_tensor(device_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's mesh coordinate as an int64 tensor (a per-rank LocalTensor when simulating)."""
    import torch
    import torch.distributed._local_tensor as lt

    mesh = device_mesh.mesh
    mode = lt.enabled_local_tensor_mode()
    if mode is not None:
        # torch 2.12+: a module function; 2.11: only the LocalTensorMode method
        rank_map = getattr(lt, "rank_map", None) or mode.rank_map
        return rank_map(lambda r: (mesh == r).nonzero()[0].clone())
    return torch.tensor(device_mesh.get_coordinate(), dtype=torch.long)


# ---- torch's own redistribution planners, for comparisons (benchmarks, tests) -------------------


def torch_planning_mesh(shape: Sequence[int]) -> DeviceMesh:
    """A DeviceMesh of ``shape`` without any process group (enough for torch's planners)."""
    import math

    import torch
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(
        "cpu", torch.arange(math.prod(shape)).view(tuple(shape)), _init_backend=False, _rank=0
    )


def torch_topology(device_mesh: DeviceMesh) -> tuple[tuple, tuple]:
    """(bandwidth, latency) per mesh dim as torch's cost model sees this mesh."""
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    info = MeshTopoInfo.build_from_mesh(device_mesh)
    return tuple(info.mesh_dim_bandwidth), tuple(info.mesh_dim_latency)


def _torch_spec(device_mesh, placements, shape, dtype, shard_order):
    import torch
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

    t = torch.empty(shape, dtype=dtype, device="meta")
    tm = TensorMeta(t.shape, t.stride(), t.dtype)
    order = None
    if shard_order is not None:
        order = tuple(
            ShardOrderEntry(d, tuple(ms)) for d, ms in sorted(dict(shard_order).items()) if ms
        )
    return DTensorSpec(device_mesh, tuple(placements), tensor_meta=tm, shard_order=order)


def torch_plan(
    device_mesh: DeviceMesh,
    src: Sequence[Placement],
    dst: Sequence[Placement],
    shape: Sequence[int],
    dtype: torch.dtype,
    src_order: dict | None = None,
    dst_order: dict | None = None,
    *,
    graph: bool = True,
) -> tuple:
    """torch's plan as [(mesh_dim, src_placement, dst_placement)], uncached (a fresh planner)."""
    import torch.distributed.tensor._redistribute as R

    s = _torch_spec(device_mesh, src, shape, dtype, src_order)
    d = _torch_spec(device_mesh, dst, shape, dtype, dst_order)
    planner = R.DTensorRedistributePlanner(device_mesh, s.tensor_meta)
    if graph:
        infos = planner.generate_graph_based_transform_infos(s, d, s.shape)
    else:
        infos = planner.generate_greedy_transform_infos(s, d)
    return s, [(ti.mesh_dim, *ti.src_dst_placements) for ti in infos]


def torch_score(src_spec, steps: Sequence[tuple]) -> float:
    """Sum of torch's ``one_step_redistribute_cost`` over a plan, replayed step by step from
    ``src_spec`` (a torch DTensorSpec).  inf if a step is impossible (e.g. Shard -> Partial)."""
    from torch.distributed.tensor._collective_utils import one_step_redistribute_cost
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    placements = list(src_spec.placements)
    total = 0.0
    cur = DTensorSpec(
        src_spec.mesh,
        tuple(placements),
        tensor_meta=src_spec.tensor_meta,
        use_strided_shard_as_shard_order=False,
    )
    for m, _, dst in steps:
        placements[m] = dst
        nxt = DTensorSpec(
            src_spec.mesh,
            tuple(placements),
            tensor_meta=src_spec.tensor_meta,
            use_strided_shard_as_shard_order=False,
        )
        total += one_step_redistribute_cost(cur, nxt)
        cur = nxt
    return total


# (co_filename, co_name) of the functions whose frames export keeps, on torch releases without
# torch.fx.proxy._register_stack_trace_anchor (before 2.13); a registry, like torch's own
_ANCHORS: set[tuple[str, str]] = set()


def record_frames_of(fn: Callable) -> None:
    """Make export keep ``fn``'s frames in node stack traces (it keeps only ``forward`` frames).

    torch 2.13+ has a registry for this; before, the same filter is installed once over
    ``TracerBase._filter_traceback_frames`` (torch 2.13's body: ``forward`` frames, frames of
    ``torch/__init__.py`` and registered ones, minus torch's uninteresting files)."""
    import traceback

    import torch.fx.proxy as proxy

    register = getattr(proxy, "_register_stack_trace_anchor", None)
    if register is not None:
        register(fn)
        return
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    _ANCHORS.add((code.co_filename, code.co_name))
    tracer = proxy.TracerBase
    if getattr(tracer, "_fxshard_anchors", False):
        return
    original = tracer._filter_traceback_frames

    def _filter_traceback_frames(self, user_stack_summary):
        if not getattr(self, "_record_forward_stack_traces_only", False):
            return original(self, user_stack_summary)
        from torch.fx.experimental.symbolic_shapes import uninteresting_files

        skip = uninteresting_files()
        return traceback.StackSummary.from_list(
            [
                f
                for f in user_stack_summary
                if (
                    f.name == "forward"
                    or f.filename.endswith("torch/__init__.py")
                    or (f.filename, f.name) in _ANCHORS
                )
                and f.filename not in skip
            ]
        )

    tracer._filter_traceback_frames = _filter_traceback_frames
    tracer._fxshard_anchors = True


def register_torch_logs() -> None:
    """Make ``TORCH_LOGS="fxshard"`` (and ``torch._logging.set_logs(fxshard=...)``) control our
    logger."""
    import os

    from torch._logging import _internal

    if "fxshard" not in _internal.log_registry.log_alias_to_log_qnames:
        _internal.register_log("fxshard", "fxshard")
        if "fxshard" in os.environ.get("TORCH_LOGS", ""):
            _internal._init_logs()


def trace_artifact(name: str, payload_fn: Callable[[], str]) -> None:
    """A structured-trace artifact (shown by tlparse for TORCH_TRACE runs); free when tracing is
    off."""
    from torch._logging import trace_structured

    trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": "string"}, payload_fn=payload_fn
    )


# ---- torch.compile / Inductor -------------------------------------------------------------------


def _compiling_backend() -> object:
    """The backend function of the dynamo compile running on this thread (unwrapped from dynamo's
    debug wrapper and ``torch.compile``'s options wrapper), or None outside a dynamo compile."""
    import sys

    from torch._dynamo.eval_frame import innermost_backend

    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "_compile" and "compiler_fn" in f.f_locals:
            fn = innermost_backend(f.f_locals["compiler_fn"])
            fn = getattr(fn, "compiler_fn", fn)
            return getattr(fn, "func", fn)  # functools.partial
        f = f.f_back
    return None


def _replicating_fallback(prop, propagate: Callable) -> Callable:
    """DTensor's sharding propagation (while dynamo traces, it only tells dynamo the metadata of
    each value: the backend plans the graph itself), made total: where DTensor's rule refuses an
    op on its inputs' placements (an unevenly sharded dim flattened, a ``_StridedShard`` with a
    symbolic split factor) or has no rule for the op, the op runs on replicated inputs (the
    global values) and gives replicated outputs."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

    def replicated(x):
        if not isinstance(x, DTensorSpec) or all(p.is_replicate() for p in x.placements):
            return x
        # redistributed to replicated, the local tensor is a gather's: contiguous (the op's
        # output metadata must be what the local op gives, or a later view of it fails)
        meta = x.tensor_meta
        if meta is not None:
            meta = TensorMeta(meta.shape, contiguous_strides(meta.shape), meta.dtype)
        return DTensorSpec(x.mesh, (Replicate(),) * x.mesh.ndim, tensor_meta=meta)

    def on_global_values(rep: OpSchema) -> OutputSharding:
        try:
            out = propagate(rep)
        except Exception:  # noqa: BLE001 - no rule even on replicated inputs: derive the shapes
            meshes = [
                x.mesh for x in _pytree.tree_leaves(rep.args_schema) if isinstance(x, DTensorSpec)
            ]
            meta = prop._propagate_tensor_meta_non_cached(rep)

            def spec(m):
                return (
                    None
                    if m is None
                    else DTensorSpec(meshes[0], (Replicate(),) * meshes[0].ndim, tensor_meta=m)
                )

            multi = isinstance(meta, (tuple, list))
            out = OutputSharding(tuple(spec(m) for m in meta) if multi else spec(meta))
        if not out.needs_redistribute:
            out.redistribute_schema, out.needs_redistribute = rep, True
        return out

    def total(op_schema):
        try:
            return propagate(op_schema)
        except NotImplementedError as e:
            # no rule but a decomposition: DTensor runs the decomposition's ops on their rules
            if torch._C._dispatch_has_kernel_for_dispatch_key(
                op_schema.op.name(), torch._C.DispatchKey.CompositeImplicitAutograd
            ):
                raise
            refused = e
        except Exception as e:  # noqa: BLE001 - a rule that refuses these placements
            refused = e
        rep = OpSchema(
            op_schema.op,
            _pytree.tree_map(replicated, op_schema.args_schema),
            _pytree.tree_map(replicated, op_schema.kwargs_schema),
            schema_info=op_schema.schema_info,
        )
        try:
            return on_global_values(rep)
        except Exception:  # noqa: BLE001 - DTensor's own error says more
            raise refused from None

    return total


_COMPILE_HOOKS: list = []


def on_dynamo_compiles(backend: Callable, explain: Callable[[BaseException], str | None]) -> None:
    """While dynamo traces a frame for ``backend``, DTensor treats plain tensors as replicated
    (torch's ``implicit_replication()``: a plain tensor is the global value, which is what
    fxshard's backend takes it for), and an exception that compile raises gets
    ``explain(exception)`` as a note (where it says something).  Dynamo runs DTensor's own
    propagation on DTensor arguments while it traces, before any backend sees the graph: these
    compile callbacks are the one place a backend can act there."""
    if _COMPILE_HOOKS:
        return
    import logging
    import sys

    from torch.distributed.tensor import DTensor

    try:  # private torch internals: where a release moved them, DTensor's own rules stand
        dispatcher = DTensor._op_dispatcher
        prop = dispatcher.sharding_propagator
        type(prop).propagate_op_sharding_non_cached  # noqa: B018
        handler = torch._dynamo.callback_handler
        handler.start_callbacks, handler.end_callbacks  # noqa: B018
    except AttributeError as e:
        logging.getLogger("fxshard").debug("DTensor tracing hooks not installed: %s", e)
        return
    state: list = []

    def start(args) -> None:
        try:
            ours = _compiling_backend() is backend
        except Exception:  # noqa: BLE001 - dynamo's internals moved: not recognised as ours
            ours = False
        state.append((ours, dispatcher._allow_implicit_replication))
        if ours:
            dispatcher._allow_implicit_replication = True
            prop.propagate_op_sharding_non_cached = _replicating_fallback(
                prop, type(prop).propagate_op_sharding_non_cached.__get__(prop)
            )

    def end(args) -> None:
        if not state:
            return
        ours, before = state.pop()
        if not ours:
            return
        dispatcher._allow_implicit_replication = before
        prop.__dict__.pop("propagate_op_sharding_non_cached", None)
        exc = sys.exc_info()[1]
        note = explain(exc) if exc is not None else None
        if note and note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)

    _COMPILE_HOOKS[:] = [start, end]
    # torch._dynamo.reset() clears every compile callback; these are part of the backend, so they
    # stay (the lists keep ours on clear())
    handler.start_callbacks = _KeepOurs([*handler.start_callbacks, start])
    handler.end_callbacks = _KeepOurs([*handler.end_callbacks, end])


class _KeepOurs(list):
    """A list of dynamo's compile callbacks whose ``clear()`` keeps fxshard's."""

    def clear(self) -> None:
        ours = [f for f in self if any(f is h for h in _COMPILE_HOOKS)]
        super().clear()
        self.extend(ours)


def dynamo_frame_locals() -> dict:
    """The local variables of the frame dynamo is compiling (valid inside a backend call)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    tx = InstructionTranslator.current_tx()
    return dict(tx.output.root_tx.f_locals) if tx is not None else {}


def calling_modules() -> list:
    """Modules whose ``forward`` is running on the Python stack, outermost first
    (``torch.compile``'d wrappers unwrapped), up to the module that was compiled (a block compiled
    on its own and called from an eager parent: the block).  After a graph break in a loop dynamo
    compiles submodule frames on their own; the outermost module on the stack is then the model
    the plan names FQNs in."""
    import sys

    import torch.nn as nn

    out, seen = [], set()
    f = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, nn.Module):
            # the module torch.compile was given (an OptimizedModule's, or one compiled in place
            # by Module.compile) is the top: modules that call it eagerly are not in its program
            root = hasattr(obj, "_orig_mod") or getattr(obj, "_compiled_call_impl", None)
            obj = getattr(obj, "_orig_mod", obj)
            if id(obj) not in seen:
                seen.add(id(obj))
                out.append(obj)
            if root:
                break
        f = f.f_back
    return out[::-1]


def placeholder_source(node: fx.Node) -> str | None:
    """A dynamo graph placeholder's source, e.g.
    ``L['self']._modules['fc1']._parameters['weight']``."""
    arg = node.meta.get("grapharg")
    src = getattr(arg, "source", None)
    name = getattr(src, "name", None)
    return name() if callable(name) else name


def inductor_compile(gm: fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
    """Compile an ATen graph with Inductor: decompose with Inductor's table, then
    ``compile_fx_inner``.

    Returns ``fn(*args) -> tuple``.  ``example_inputs`` are real or fake tensors of the right
    shapes, dtypes and devices (contiguous).  Random ops keep torch's own kernels
    (``fallback_random``): the program draws what the eager program draws for the same seed."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    # a symbolic per-rank graph (dynamic shapes): compiled for every size its ShapeEnv allows, from
    # its own placeholders' fakes (their symbols); its guards are the caller's to check
    vals = [p.meta.get("val") for p in gm.graph.nodes if p.op == "placeholder"]
    symbolic = all(isinstance(v, torch.Tensor) for v in vals) and any(
        is_symbolic(n) for v in vals for n in v.shape
    )
    if symbolic:
        fm, fakes = detect_fake_mode(vals), vals
    else:
        fm = FakeTensorMode(allow_non_fake_inputs=False)
        fakes = [
            fm.from_tensor(torch.empty(t.shape, dtype=t.dtype, device=t.device))
            for t in example_inputs
        ]
    with inductor_config.patch(fallback_random=True):
        with fm:
            table = select_decomp_table()
            decomposed = make_fx(gm, decomposition_table=table, tracing_mode="fake")(*fakes)
        # torch.compile runs both under the graph's fake mode (AOTAutograd enters it): the
        # joint-graph patterns retrace their replacements in "real" mode, and a replacement that
        # makes a tensor (scatter_upon_const_tensor's arange, hit by every cross-entropy backward)
        # must make it in that mode, next to the graph's fake values
        with tracing(TracingContext(fm)), fm:
            # what torch.compile runs on an inference graph before compile_fx_inner: Inductor's
            # joint-graph passes (no-op removal, uniform-value folding, its early patterns)
            device = next((t.device for t in fakes if isinstance(t, torch.Tensor)), None)
            decomposed = joint_graph_passes(decomposed, device)
            compiled = compile_fx_inner(decomposed, fakes)

    def run(*args):
        return compiled(list(args))

    run.graph = decomposed
    return run


def torch_decomposition(op):
    """torch's own decomposition of ``op`` (``torch._decomp``'s table)."""
    from torch._decomp import decomposition_table

    return decomposition_table[op]


# ---- joint forward+backward graphs (AOTAutograd) -------------------------------------------------


def lazy_graph_modules():
    """Context in which new GraphModules regenerate their Python code only when it is first needed
    (called, or ``.code`` read), not on every ``recompile()``: the stages edit a captured graph of
    ~12k nodes several times and nobody runs it in between (FX's ``_LazyGraphModule``)."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


@contextlib.contextmanager
def library_tracing():
    """Inside: ``torch.compiler.is_compiling()`` is True, as under dynamo.  AOTAutograd's joint
    trace runs the model's Python without dynamo, and libraries take their eager-only paths there
    (transformers' ``is_tracing()`` gates value-dependent checks such as ``masking_utils``'s
    ``(mask[:, -1] == 0).all()``): a trace must see what dynamo sees."""
    import torch.compiler as compiler

    before = compiler._is_compiling_flag
    compiler._is_compiling_flag = True
    try:
        yield
    finally:
        compiler._is_compiling_flag = before


def export_joint(
    module: torch.nn.Module, fake_args: Sequence, decompositions: dict
) -> tuple[fx.GraphModule, object]:
    """``aot_export_joint_with_descriptors``: (joint GraphModule, pytree spec of the forward
    outputs).  Placeholders are
    ``primals_*`` / ``tangents_*`` with ``meta["desc"]``; the output node's ``meta["desc"]`` lists
    what each output is (see ``describe``)."""
    import contextlib

    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack:
        jd = aot_export_joint_with_descriptors(
            stack,
            module,
            tuple(fake_args),
            decompositions=decompositions,
            _record_nn_module_stack=True,
        )
    return jd.graph_module, jd.out_spec


def describe(desc: object) -> tuple[str, object]:
    """A joint-graph descriptor as (kind, payload): ("param", fqn), ("buffer", fqn), ("input",
    index), ("tangent", output index), ("output", index), ("grad_param", fqn), ("grad_input",
    index)."""
    from torch._functorch._aot_autograd import descriptors as d

    if isinstance(desc, d.ParamAOTInput):
        return "param", desc.target
    if isinstance(desc, d.BufferAOTInput):
        return "buffer", desc.target
    if isinstance(desc, d.PlainAOTInput):
        return "input", desc.idx
    if isinstance(desc, d.TangentAOTInput):
        out = desc.output
        return "tangent", out.idx if isinstance(out, d.PlainAOTOutput) else None
    if isinstance(desc, d.PlainAOTOutput):
        return "output", desc.idx
    if isinstance(desc, d.InputMutationAOTOutput):
        kind, what = describe(desc.mutated_input)
        return "mutate_" + kind, what
    if isinstance(desc, d.GradAOTOutput):
        kind, what = describe(desc.grad_of)
        return (
            "grad_param" if kind == "param" else "grad_input" if kind == "input" else "grad_" + kind
        ), what
    return type(desc).__name__, None


def partition_joint(
    joint: fx.GraphModule, num_fwd_outputs: int
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """(forward, backward) GraphModules of a joint graph: AOTAutograd's min-cut partitioner (it
    saves collectives' results rather than recomputing them).  Placeholders must be ``primals_*`` /
    ``tangents_*``; outputs: the ``num_fwd_outputs`` forward outputs, then the gradients."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return min_cut_rematerialization_partition(joint, None, num_fwd_outputs=num_fwd_outputs)


def flop_count(node: fx.Node) -> float:
    """Floating-point operations of an ATen node (torch's flop formulas; attention on the CPU
    kernels counted like the CUDA ones); 0 for ops without a formula (memory-bound ones)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    def val(a):
        return a.meta.get("val") if hasattr(a, "meta") else a

    args = torch.utils._pytree.tree_map(val, tuple(node.args))
    kwargs = torch.utils._pytree.tree_map(val, dict(node.kwargs))
    op = node.target
    name = str(op)
    if "_scaled_dot_product_flash_attention_for_cpu" in name or name.startswith(
        "aten.scaled_dot_product_attention"
    ):
        backward = name.endswith("backward.default")
        q, k = (args[1], args[2]) if backward else (args[0], args[1])
        b, h, sq, d = q.shape
        sk = k.shape[-2]
        return float(4 * b * h * sq * sk * d * (2.5 if backward else 1.0))
    fn = flop_registry.get(getattr(op, "overloadpacket", None))
    if fn is None:
        return 0.0
    try:
        return float(fn(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that does not accept these arguments: count none
        return 0.0


# ---- fake tensors, graphs, modules ---------------------------------------------------------------


def fake_mode(allow_non_fake_inputs: bool = True):
    """A new ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=allow_non_fake_inputs)


def fake_mode_of(values: Sequence) -> object | None:
    """The fake mode ``values`` (a sequence) are fake tensors of, if any (dynamo's, in a
    backend)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(tuple(values))


def no_fake_mode():
    """Context without the active fake mode (real tensors compute for real inside)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def is_fake_of(mode: object, value: object) -> bool:
    """``value`` is a fake tensor of ``mode``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor) and value.fake_mode is mode


def is_fake(value: object) -> bool:
    """``value`` is a fake tensor (of any mode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def is_functional(value: object) -> bool:
    """``value`` is a tensor of functionalization (AOTAutograd's trace of another backend)."""
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(value, FunctionalTensor) or (
        isinstance(value, torch.Tensor) and torch._is_functional_tensor(value)
    )


def use_flat_codegen(gm: fx.GraphModule) -> None:
    """Make ``gm`` take and return flat arguments (AOT's pytree codegen groups them)."""
    gm.graph._codegen = fx.graph.CodeGen()
    gm.recompile()


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (moves on every in-place update)."""
    return t._version


def module_children_slot(module: torch.nn.Module) -> dict:
    """The module's own dict of submodules (``_modules``)."""
    return module._modules


def module_tensor_slots(module: torch.nn.Module) -> tuple[dict, dict]:
    """(parameters, buffers) registered directly on ``module``, None entries included."""
    return module._parameters, module._buffers


def set_module_tensor(
    module: torch.nn.Module, name: str, value: torch.Tensor | None, *, parameter: bool
) -> None:
    """Put ``value`` in ``module``'s parameter or buffer slot ``name`` as it is (no Parameter
    wrapping or checks, unlike ``setattr``)."""
    (module._parameters if parameter else module._buffers)[name] = value


def is_op_overload(op: object) -> bool:
    return isinstance(op, torch._ops.OpOverload)


# ---- functional collectives ----------------------------------------------------------------------

c10d = torch.ops._c10d_functional  # the functional collective ops (traceable, Inductor lowers them)
COLLECTIVE_OPS = frozenset(
    {
        c10d.all_gather_into_tensor.default,
        c10d.reduce_scatter_tensor.default,
        c10d.all_reduce.default,
        c10d.all_to_all_single.default,
    }
)


def abort_process_groups() -> None:
    """Abort every process group of this process (peers waiting in a collective then fail fast)."""
    import torch.distributed as dist

    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # not available, or not for this backend: tear the groups down instead
        if dist.is_initialized():
            dist.destroy_process_group()


def limit_group_timeout(group_name: str, device_type: str, seconds: float) -> bool:
    """Lower the timeout of the process group ``group_name`` to ``seconds`` (never raise it);
    True if it was lowered."""
    import datetime

    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        backend = _resolve_process_group(group_name)._get_backend(torch.device(device_type))
        current = backend.options._timeout
    except Exception:  # a backend without options (fake, custom): leave it
        return False
    limit = datetime.timedelta(seconds=seconds)
    if current <= limit:
        return False
    backend._set_default_timeout(limit)
    return True


def flattened_group_name(device_mesh: DeviceMesh, mesh_dim_names: Sequence[str]) -> str:
    """The process group of the flattened sub-mesh over ``mesh_dim_names`` (created once per
    mesh)."""
    return device_mesh[tuple(mesh_dim_names)]._flatten().get_group(0).group_name


def is_data_dependent_error(e: BaseException) -> bool:
    """A trace that stopped at a value-dependent shape or branch (``if x.sum() > 0``,
    ``x[mask]``, ``nonzero``), anywhere in the exception's chain."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    while e is not None:
        if isinstance(e, kinds) or "data-dependent" in str(e)[:300]:
            return True
        e = e.__cause__ or e.__context__
    return False


_CONTROL_FLOW = ("cond", "while_loop", "map_impl", "scan", "associative_scan", "invoke_subgraph")


def control_flow_op(node) -> str | None:
    """The name of a control-flow operator (``torch.cond``, ``while_loop`` ...) a node calls."""
    target = getattr(node, "target", None)
    if node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator):
        name = getattr(target, "__name__", str(target))
        return name if name in _CONTROL_FLOW else None
    return None


# ---- DTensor at program boundaries --------------------------------------------------------------
_DTENSOR: list = []  # the DTensor class, imported on first use (every call asks, per argument)


def is_dtensor(x: object) -> bool:
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(x, _DTENSOR[0])


def dtensor_layout(dt) -> tuple[tuple, dict | None]:
    """(placements, shard order ``{tensor dim: mesh dims}`` or None for the default) of a DTensor.
    ``_StridedShard`` placements that only encode a shard order (DTensor's default reading) come
    back as plain ``Shard`` + that order; genuinely strided ones (a view's) stay strided."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    spec = dt._spec
    plc = tuple(spec.placements)
    if any(isinstance(p, _StridedShard) for p in plc):
        if spec.use_strided_shard_as_shard_order:
            order = DTensorSpec._maybe_convert_StridedShard_to_shard_order(plc, spec.mesh)
            if order is not None:
                plain = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in plc)
                return plain, {e.tensor_dim: tuple(e.mesh_dims) for e in order}
        return plc, None
    order = spec.shard_order
    return plc, ({e.tensor_dim: tuple(e.mesh_dims) for e in order} if order else None)


def dtensor_local(dt) -> torch.Tensor:
    """A DTensor's local tensor: ``to_local()`` (differentiable) where autograd records, else the
    tensor itself (``to_local`` is an autograd Function: ~20 us a call on a decode step's path)."""
    if torch.is_grad_enabled() and dt.requires_grad:
        return dt.to_local()
    return dt._local_tensor


def make_dtensor(
    local: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    shard_order: dict | None,
    shape: Sequence[int],
):
    """A DTensor of global ``shape`` (contiguous strides) over this rank's ``local`` shard, no
    communication.  A non-default shard order is spelled as DTensor's own encoding of it
    (``_StridedShard`` placements): torch's ops and its to_local/from_local backward keep that,
    where they drop a ``shard_order`` field.  Where autograd records (``local`` requires grad)
    through ``DTensor.from_local``, its gradient asked for in exactly these placements (Partial
    ones included: each rank's share of the incoming gradient); otherwise through DTensor's
    constructor with a cached spec.  Genuinely strided shards (a view's) have no differentiable
    spelling: refused under autograd."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry

    plc = tuple(placements)
    strided = any(isinstance(p, _StridedShard) for p in plc)
    order = tuple(sorted((d, tuple(ms)) for d, ms in (shard_order or {}).items() if ms))
    if order and not strided:
        entries = tuple(ShardOrderEntry(d, ms) for d, ms in order)
        if not DTensorSpec.is_default_device_order(entries):
            plc = tuple(DTensorSpec._convert_shard_order_to_StridedShard(entries, plc, device_mesh))
    if torch.is_grad_enabled() and local.requires_grad:
        if strided:
            raise NotImplementedError(
                f"a DTensor output with genuinely strided placements {plc} under autograd: "
                "DTensor.from_local reads _StridedShard as a shard order; ask for other "
                "placements (output_placements) or run under torch.no_grad()"
            )
        stride = torch.empty(tuple(shape), device="meta").stride()
        kw = {}
        if from_local_takes_grad_placements():
            kw["grad_placements"] = plc
        elif any(isinstance(p, Partial) for p in plc):
            # torch 2.11's from_local hands a Partial input's gradient back Replicate
            raise NotImplementedError(
                f"a DTensor output in {plc} under autograd needs DTensor.from_local's "
                f"grad_placements (torch >= 2.12; this is {torch.__version__}): ask for other "
                "placements (output_placements), reduce it first, or run under torch.no_grad()"
            )
        return DTensor.from_local(
            local,
            device_mesh,
            plc,
            run_check=False,
            shape=torch.Size(shape),
            stride=stride,
            **kw,
        )
    spec = _dtensor_spec(device_mesh, plc, strided, tuple(shape), local.dtype)
    return DTensor(local, spec, requires_grad=False)


_SPECS: dict = {}


@functools.cache
def from_local_takes_grad_placements() -> bool:
    """Whether ``DTensor.from_local`` takes ``grad_placements`` (torch 2.12 on)."""
    from torch.distributed.tensor import DTensor

    return "grad_placements" in inspect.signature(DTensor.from_local).parameters


def _dtensor_spec(device_mesh, plc, strided, shape, dtype):
    """DTensor's spec for ``plc`` (``strided``: genuinely strided shards; otherwise any
    ``_StridedShard`` in ``plc`` encodes a shard order), cached per mesh (a small cache: a
    decode step wraps the same few specs every call)."""
    key = (id(device_mesh), plc, strided, shape, dtype)
    hit = _SPECS.get(key)
    if hit is not None and hit[0] is device_mesh:
        return hit[1]
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    stride = torch.empty(shape, device="meta").stride()
    tm = TensorMeta(torch.Size(shape), stride, dtype)
    if strided:
        spec = DTensorSpec(device_mesh, plc, tm, use_strided_shard_as_shard_order=False)
    else:
        spec = DTensorSpec(device_mesh, plc, tm)
    if len(_SPECS) > 1024:
        _SPECS.clear()
    _SPECS[key] = (device_mesh, spec)
    return spec


# ---- symbolic shapes (dynamic dims: one program for every size) ----------------------------------


def symbolic_fake_mode():
    """A ``FakeTensorMode`` with a ShapeEnv of its own: dims made symbolic in it become SymInts
    whose guards (what the trace assumed of them) the mode's ShapeEnv collects."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)


def symbolic_fake(mode, t: torch.Tensor, dims: Sequence[int], name: str) -> torch.Tensor:
    """A fake of ``t`` in ``mode`` whose ``dims`` are symbolic (the others fixed), named ``name``
    in guards."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx = StatelessSymbolicContext(
        dynamic_sizes=[
            DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.ndim)
        ],
        constraint_sizes=[None] * t.ndim,
    )
    return mode.from_tensor(t, symbolic_context=ctx, source=LocalSource(name))


def symbolic_empty(
    mode, shape: Sequence[int], dims: Sequence[int], dtype, device, name: str
) -> torch.Tensor:
    """A contiguous fake of ``shape`` in ``mode`` whose ``dims`` are symbolic (a DTensor's global
    value, which is never allocated)."""
    with no_fake_mode():
        meta = torch.empty(tuple(shape), dtype=dtype, device="meta")
    fake = symbolic_fake(mode, meta, dims, name)
    with mode:
        return torch.empty_strided(fake.shape, fake.stride(), dtype=dtype, device=device)


def is_symbolic(x: object) -> bool:
    """A SymInt / SymBool / SymFloat whose value is not a known constant."""
    if not isinstance(x, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return False
    return bool(x.node.expr.free_symbols)


def is_sym_value(x: object) -> bool:
    """A SymInt / SymBool / SymFloat (what a shape computation node of a symbolic trace makes)."""
    return isinstance(x, (torch.SymInt, torch.SymBool, torch.SymFloat))


def size_hint(x: object):
    """The value a symbolic size had when traced (plain numbers as they are); None where it has
    none (a size that depends on tensor values)."""
    if not is_sym_value(x):
        return x
    hint = x.node.hint
    if hint is None:
        return None
    return type(hint)(hint) if not isinstance(x, torch.SymBool) else bool(hint)


def same_symbol(a: object, b: object) -> bool:
    """Two symbolic sizes with one expression."""
    return is_sym_value(a) and is_sym_value(b) and a.node.expr == b.node.expr


def shape_guards(mode, placeholders: Sequence) -> Callable:
    """``check(args) -> bool``: whether concrete arguments meet every guard ``mode``'s ShapeEnv
    recorded while tracing and compiling for ``placeholders`` (fakes and SymInts, in argument
    order; None entries are skipped), on the symbolic sizes and strides (static sizes are checked
    by the caller's signature)."""
    keep = [i for i, p in enumerate(placeholders) if p is not None]
    env = mode.shape_env
    # (static sizes are the caller's signature; static strides do not matter: a program's inputs
    # are made contiguous shards before it runs, and a guard no rank needs could make one rank
    # rebuild a program while another runs the old one)
    code = env.produce_guards_expression([placeholders[i] for i in keep], ignore_static=True)
    if not code:
        return lambda args: True
    compiled = compile(code, "<fxshard shape guards>", "eval")
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    def check(args) -> bool:
        names = {f"t{k}": args[i] for k, i in enumerate(keep)}
        return bool(eval(compiled, SYMPY_INTERP, {"L": names}))

    check.code = code
    return check


SHAPE_ASSERT_OPS = frozenset(
    op
    for op in (
        getattr(torch.ops.aten, "_assert_scalar", None),
        getattr(torch.ops.aten, "sym_constrain_range_for_size", None),
        getattr(torch.ops.aten, "sym_constrain_range", None),
    )
    if op is not None
    for op in [op.default]
)


class WrapperTensor(torch.Tensor):
    """Base of fxshard's tensor subclasses that wrap another tensor (torch's wrapper-subclass
    protocol: no storage of their own, ``__torch_dispatch__`` sees every op, dynamo traces them
    through ``__tensor_flatten__`` / ``__tensor_unflatten__``)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def wrapper(cls, shape, stride, dtype, device) -> torch.Tensor:
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=stride, dtype=dtype, device=device, requires_grad=False
        )


def contiguous_strides(shape: Sequence) -> tuple:
    """Row-major strides of ``shape`` (SymInt sizes too)."""
    if all(type(d) is int for d in shape):  # every KeptTensor a call hands back: plain Python
        strides, step = [], 1
        for d in reversed(tuple(shape)):
            strides.append(step)
            step *= max(d, 1)  # (torch's rule: a 0-size dim counts as 1)
        return tuple(reversed(strides))
    from torch._prims_common import make_contiguous_strides_for

    return tuple(make_contiguous_strides_for(tuple(shape)))


def attribute_outputs(gm: fx.GraphModule) -> dict[int, str]:
    """{flat output index: "Class.attribute"} of the graph's outputs that dynamo's code stores into
    an attribute of a plain Python object: one that existed before the call (a cache layer's
    ``self.keys = torch.cat(...)``) or one the call creates and returns (the ``DynamicCache`` of a
    transformers model called the default way, a user's cache or dataclass of outputs); not
    modules, not dict-like model outputs (``ModelOutput``), lists or tuples.  Valid inside a
    backend call (dynamo's side effects of the frame being compiled); empty elsewhere."""
    from torch._dynamo.symbolic_convert import InstructionTranslator
    from torch._dynamo.variables import TensorVariable, UserDefinedObjectVariable

    tx = InstructionTranslator.current_tx()
    if tx is None:
        return {}
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    index = {n: k for k, n in enumerate(outs) if isinstance(n, fx.Node)}
    found = {}
    from torch._dynamo.variables.base import AttributeMutation

    for obj, attrs in tx.output.side_effects.store_attr_mutations.items():
        value = getattr(obj, "value", None)
        if not isinstance(obj, UserDefinedObjectVariable) or isinstance(
            value, (torch.nn.Module, dict, list, tuple)
        ):
            continue
        # objects that existed before the call (state), and objects the call makes (its result:
        # the cache a default call creates); not a mutation dynamo only tracks
        if not isinstance(getattr(obj, "mutation_type", None), AttributeMutation):
            continue
        for name, v in attrs.items():
            if not isinstance(v, TensorVariable):
                continue
            try:
                node = v.as_proxy().node
            except Exception:  # noqa: BLE001 (a value with no node in this graph)
                continue
            if node in index:
                found[index[node]] = f"{type(value).__name__}.{name}"
    return found


def functionalized(fn: Callable) -> Callable:
    """``fn`` functionalized at the Python dispatch level (AOTAutograd's FunctionalTensorMode): its
    in-place ops become functional ones, an input it updates is written back with ``copy_`` at
    the end.  Unlike ``torch.func.functionalize`` it reads sizes symbolically (the C++ path asks
    a linear with bias for concrete sizes, which specialises every dynamic dim)."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def unwrap(t):
        if not isinstance(t, FunctionalTensor):
            return t
        torch._sync(t)
        return torch._from_functional_tensor(t.elem)

    def inner(*args):
        exclude = torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        )
        updates = []
        with exclude, FunctionalTensorMode():
            wrapped = [
                FunctionalTensor.to_functional(a) if isinstance(a, torch.Tensor) else a
                for a in args
            ]
            outs = _pytree.tree_map_only(FunctionalTensor, unwrap, fn(*wrapped))
            for a, w in zip(args, wrapped):
                if isinstance(w, FunctionalTensor):
                    torch._sync(w)
                    if torch._functionalize_has_data_mutation(w.elem):
                        updates.append((a, unwrap(w)))
        for a, new in updates:  # the updated inputs, written back last
            a.copy_(new)
        return outs

    return inner


def process_group(group_name: str):
    """The ProcessGroup of a functional-collective group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def simulated_groups(group_name: str) -> list[list[int]]:
    """The global ranks of every group of a process group's layout under ``LocalTensorMode`` (one
    mesh dim's group name stands for all groups along that dim): ``[[ranks of group 0], ...]``,
    each in group-rank order."""
    from torch.distributed._local_tensor._c10d import _prepare_collective_groups

    # (ranks, group offsets[, offset]): torch 2.15 dropped the third value
    ranks, offsets = _prepare_collective_groups(process_group(group_name))[:2]
    return [[o + r for r in ranks] for o in offsets]


def local_tensor_mode_class():
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode


def autograd_vjp(fn: Callable, primals: Sequence[torch.Tensor], cotangent: torch.Tensor) -> tuple:
    """(``fn(*primals)``, the primals' gradients for ``cotangent``) by autograd, also inside a
    custom op's kernel (which runs with the autograd dispatch keys excluded: they are let back in
    here).  A primal the output does not depend on gets zeros."""
    D = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in (D.AutogradFunctionality, D.ADInplaceOrView):
        exclude = exclude.remove(k)
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        leaves = [p.detach().requires_grad_() for p in primals]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, leaves, cotangent, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(primals, grads)]
    return out.detach(), grads


def global_module_hooks() -> list:
    """The forward (pre-)hooks registered for every module (``register_module_forward_hook``)."""
    from torch.nn.modules import module as m

    return [*m._global_forward_pre_hooks.values(), *m._global_forward_hooks.values()]
