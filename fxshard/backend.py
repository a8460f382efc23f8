"""The ``torch.compile`` backend and the Inductor hand-off.

    torch.compile(model, backend="fxshard", options={"mesh": device_mesh, "plan": plan})

Each dynamo graph is sharded on its own: its parameters (found by their dynamo sources) take the
plan's placements, its user inputs are the global values every rank holds (each rank slices its shard
locally, no communication), and its outputs are handed back replicated, i.e. as the global values, so
whatever runs between graphs (a graph break) sees exactly what the single-device program would.

Graphs are captured and compiled once per input signature (shapes, dtypes, int arguments) at their
first call, with the call's concrete shapes: recompiles on new shapes work, and dynamo's dynamic
shapes are specialised per signature rather than compiled symbolically.  Parameters are sliced to
local shards once and cached; a replaced parameter (new object, or new storage through ``p.data =``)
or one updated in place (its version counter moves: optimizers, ``p.mul_()`` under no_grad) is sliced
again.  In-place updates through ``p.data`` bypass the version counter and are not seen: shards that
are views (dim-0 shards, replicated parameters) see them, copies do not; update parameters in place
instead, or call ``torch._dynamo.reset()``.

Options (``options={...}``): ``mesh`` (a ``DeviceMesh``; a ``MeshSpec`` or shape with
``simulate=True``), ``plan`` (ParallelStyle / tp_plan dict, ``{}`` for none), ``tp_dim``, ``fuse``,
``bucket_bytes``, ``cost_model``, ``inductor`` (False: run the per-rank graph eagerly, for
debugging), ``simulate`` (True: run every rank in this process with exact collectives; outputs
are the global values; no process group needed).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from .adapter import Replicate, calling_modules, dynamo_frame_locals, inductor_compile, placeholder_source
from .cost import CostModel
from .mesh import MeshSpec
from .passes.capture import BUFFER, CONSTANT, INPUT, PARAM, capture_dynamo_graph, dynamo_sources, info
from .passes.lower import bind_groups, local_shape
from .planner.execute import group_names
from .plans import PlanConstraints, resolve_plan

log = logging.getLogger("fxshard")

OPTIONS = ("mesh", "plan", "tp_dim", "fuse", "bucket_bytes", "cost_model", "inductor", "simulate", "auto_options")


def device_of(device_mesh) -> torch.device:
    t = device_mesh.device_type
    if t == "cpu":
        return torch.device("cpu")
    return torch.device(t, torch.get_device_module(t).current_device())


def _check_mesh(program, device_mesh) -> tuple:
    """This rank's mesh coordinate, after checking there is a process group and the mesh fits."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("compiling a sharded program needs an initialised process group "
                           "(torch.distributed.init_process_group) and a DeviceMesh; to run every rank in "
                           "one process use simulate() instead")
    if tuple(device_mesh.shape) != tuple(program.mesh.shape):
        raise ValueError(f"the program was sharded for mesh {program.mesh.shape}, the DeviceMesh is "
                         f"{tuple(device_mesh.shape)}")
    coord = device_mesh.get_coordinate()
    if coord is None:
        raise RuntimeError("this rank is not part of the device mesh")
    return coord


class CompiledProgram:
    """One rank's compiled program (``ShardedProgram.compile``).

    ``fn(*inputs)`` takes the global inputs and returns this rank's shard of every output
    (``output_specs``; replicated outputs are global values).  ``run_local(local_args)`` runs on
    local shards of every placeholder (parameters included), in ``program.placeholders`` order."""

    def __init__(self, program, device_mesh, *, inductor: bool = True, own_state: bool = True):
        coord = _check_mesh(program, device_mesh)
        self.program = program
        self.device_mesh = device_mesh
        self.device = device_of(device_mesh)
        self.coord_ints = tuple(int(c) for c in coord)
        self.coord = torch.tensor(self.coord_ints, dtype=torch.long, device=self.device)
        self.specs = [info(p).spec for p in program.placeholders]
        self.output_specs = program.output_specs
        local = bind_groups(program.local_graph_on(self.device), group_names(device_mesh))
        example = [self.coord] + [torch.empty(local_shape(s), dtype=s.dtype, device=self.device) for s in self.specs]
        self.inductor = inductor
        self.fn = inductor_compile(local, example) if inductor else local
        self.local_graph = local
        # parameters, buffers and constants: the captured ones sliced once (``own_state``); callers
        # that hold their own shards (the backend, parallelize) pass them to run_local instead
        self.state: dict[str, torch.Tensor] = {}
        for p, spec in zip(program.placeholders, self.specs):
            rec = info(p)
            if own_state and rec.kind in (PARAM, BUFFER, CONSTANT):
                self.state[rec.fqn] = self.local_of(program.captured.state[rec.fqn], spec)

    def local_of(self, full: torch.Tensor, spec) -> torch.Tensor:
        """This rank's shard of a global tensor (a local slice, no communication)."""
        return spec.local_of(full.detach().to(self.device), self.coord_ints)

    def run_local(self, local_args) -> list:
        outs = self.fn(self.coord, *local_args)
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    def __call__(self, *inputs):
        prog = self.program
        if len(inputs) != prog.captured.num_inputs:
            raise TypeError(f"this program takes {prog.captured.num_inputs} inputs, got {len(inputs)}")
        args = []
        for p, spec in zip(prog.placeholders, self.specs):
            rec = info(p)
            if rec.kind in (PARAM, BUFFER, CONSTANT):
                args.append(self.state[rec.fqn])
            else:
                args.append(self.local_of(inputs[rec.input_index], spec))
        return prog.restructure(self.run_local(args))


class CompiledTraining:
    """One rank's training program: the per-rank joint graph split by the min-cut partitioner into a
    forward and a backward, each compiled by Inductor (or run eagerly), run as one autograd Function.

    ``apply(local_args)`` takes this rank's local shard of every primal placeholder (parameters,
    buffers, inputs: ``program.placeholders`` order without tangents) and returns the forward outputs;
    ``backward()`` through them gives every parameter (and input that requires grad) its local
    gradient shard, placed like the parameter."""

    def __init__(self, program, device_mesh, *, inductor: bool = True, localize=None):
        from .adapter import partition_joint
        from .passes.capture import TANGENT

        if not program.training:
            raise ValueError("CompiledTraining needs a training program (fxshard.shard(..., training=True))")
        coord = _check_mesh(program, device_mesh)
        self.program = program
        # localize(global args) -> local shards, inside the Function: the backend hands global
        # parameters in and gets global gradients back
        self.localize = localize
        self.device = device_of(device_mesh)
        self.coord_ints = tuple(int(c) for c in coord)
        self.coord = torch.tensor(self.coord_ints, dtype=torch.long, device=self.device)
        places = program.placeholders
        self.primal_specs = [info(p).spec for p in places if info(p).kind != TANGENT]
        # (forward output index, spec) per tangent, in placeholder order: only outputs that can have
        # a gradient get a tangent, so incoming gradients are matched by output index, not position
        self.tangents = [(info(p).input_index, info(p).spec) for p in places if info(p).kind == TANGENT]
        self.primal_kinds = _primal_kinds(program)
        roles = program.output_roles()
        self.num_fwd = sum(r[0] == "output" for r in roles)
        self.grad_roles = roles[self.num_fwd:]
        local = bind_groups(program.local_graph_on(self.device), group_names(device_mesh))
        for n in local.graph.nodes:  # the partitioner tells primals from tangents by name
            if n.op == "placeholder" and n.name == "mesh_coord":
                n.target = n.name = "primals_mesh_coord"
        local.recompile()
        fw, bw = partition_joint(local, self.num_fwd)
        self.forward_graph, self.backward_graph = fw, bw
        if inductor:
            self.fw = inductor_compile(fw, _examples(fw))
            self.bw = inductor_compile(bw, _examples(bw))
        else:
            self.fw = lambda *a: fw(*a)
            self.bw = lambda *a: bw(*a)

    def local_of(self, full: torch.Tensor, spec) -> torch.Tensor:
        return spec.local_of(full.detach().to(self.device), self.coord_ints)

    def apply(self, local_args):
        return _TrainingStep.apply(self, self.coord, *local_args)

    def __call__(self, *inputs, grad_outputs=None):
        """One forward+backward on the global ``inputs`` with the program's own (captured) parameters:
        ``(outputs, grads)``, ``grads[fqn]`` this rank's gradient shard (placed like the parameter)."""
        prog = self.program
        if getattr(self, "_state", None) is None:
            self._state = {}
            for (kind, fqn, _), spec in zip(self.primal_kinds, self.primal_specs):
                if kind in (PARAM, BUFFER, CONSTANT):
                    t = spec.local_of(prog.captured.state[fqn].detach().to(self.device), self.coord_ints)
                    self._state[fqn] = t.requires_grad_(kind == PARAM)
        args = []
        for (kind, fqn, index), spec in zip(self.primal_kinds, self.primal_specs):
            args.append(self._state[fqn] if kind in (PARAM, BUFFER, CONSTANT) else
                        spec.local_of(inputs[index].to(self.device), self.coord_ints))
        for t in self._state.values():
            t.grad = None
        outs = self.apply(args)
        flat = list(outs) if isinstance(outs, tuple) else [outs]
        gos = [prog.grad_output(i, o, grad_outputs).to(self.device) for i, o in enumerate(flat)]
        torch.autograd.backward(flat, gos)
        return outs, {f: t.grad for f, t in self._state.items() if t.grad is not None}

    def grads_for_inputs(self, grads) -> list:
        """Backward outputs mapped onto (mesh coordinate, *primal inputs); None where no gradient."""
        return [None, *_gradients_of(self.primal_kinds, dict(zip((tuple(r) for r in self.grad_roles), grads)))]


def _primal_kinds(program) -> list[tuple]:
    """(kind, fqn, input index) of every placeholder but the incoming gradients, in order."""
    from .passes.capture import TANGENT

    return [(info(p).kind, info(p).fqn, info(p).input_index) for p in program.placeholders
            if info(p).kind != TANGENT]


def _gradients_of(primal_kinds, by_role: dict) -> list:
    """The gradient of every primal input from ``{("grad_param", fqn) | ("grad_input", i): value}``."""
    return [by_role.get(("grad_param", fqn)) if kind == PARAM else
            by_role.get(("grad_input", index)) if kind == INPUT else None
            for kind, fqn, index in primal_kinds]


def _examples(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            out.append(torch.empty(v.shape, dtype=v.dtype, device=v.device) if isinstance(v, torch.Tensor) else v)
    return out


def _no_double_backward():
    # grad mode is on inside a Function's backward exactly when the caller asked for create_graph
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "fxshard: double backward (autograd.grad(..., create_graph=True), e.g. a gradient penalty) through a "
            "sharded graph is not supported: its backward is compiled once and not differentiable")


class _TrainingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, coord, *args):
        if runner.localize is not None:
            args = runner.localize(args)
        outs = list(runner.fw(coord, *args))
        n = runner.num_fwd
        saved = outs[n:]
        ctx.runner = runner
        tensors = [t for t in saved if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [isinstance(t, torch.Tensor) for t in saved]
        ctx.others = [t for t in saved if not isinstance(t, torch.Tensor)]
        differentiable = {i for i, _ in runner.tangents}
        ctx.mark_non_differentiable(*[o for i, o in enumerate(outs[:n])
                                      if i not in differentiable and isinstance(o, torch.Tensor)])
        return tuple(outs[:n]) if n > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        _no_double_backward()
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        # Inductor asserts the strides it compiled for: saved activations are handed over contiguous
        saved = [next(tensors).contiguous() if is_t else next(others) for is_t in ctx.layout]
        tangents = [grads[i].contiguous() if grads[i] is not None else
                    torch.zeros(local_shape(s), dtype=s.dtype, device=ctx.runner.device)
                    for i, s in ctx.runner.tangents]
        outs = ctx.runner.bw(*saved, *tangents)
        return (None, *ctx.runner.grads_for_inputs(list(outs)))


class _SimulatedTraining(torch.autograd.Function):
    """The backend's ``simulate`` mode under autograd: the forward runs the joint program's outputs
    on simulated ranks, the backward runs it again with the incoming gradients (a debugging mode:
    twice the forward work, exact collectives)."""

    @staticmethod
    def forward(ctx, prog, *args):
        ctx.prog, ctx.args = prog, [a.detach() for a in args]
        return tuple(_simulate_joint(prog, ctx.args, None)[0])

    @staticmethod
    def backward(ctx, *grads):
        _no_double_backward()
        _, by_role = _simulate_joint(ctx.prog, ctx.args, grads)
        return (None, *_gradients_of(_primal_kinds(ctx.prog), by_role))


def _simulate_joint(prog, primal_values, grads):
    from .passes.capture import TANGENT

    values, it = [], iter(primal_values)
    for p in prog.placeholders:
        if info(p).kind == TANGENT:
            i = info(p).input_index
            g = grads[i] if grads is not None and grads[i] is not None else None
            values.append(g if g is not None else torch.zeros(p.meta["val"].shape, dtype=p.meta["val"].dtype))
        else:
            values.append(next(it))
    flat = prog.simulate_placeholders(values)
    roles = prog.output_roles()
    outs = [v for r, v in zip(roles, flat) if r[0] == "output"]
    return outs, {tuple(r): v for r, v in zip(roles, flat) if r[0] != "output"}


# ---- the dynamo backend ---------------------------------------------------------------------------

@dataclass
class BackendOptions:
    mesh: object  # DeviceMesh, or MeshSpec when simulating
    plan: dict
    tp_dim: int | str | None = None
    fuse: bool = True
    bucket_bytes: int = 25 * 1024 * 1024
    cost_model: object = None
    inductor: bool = True
    simulate: bool = False
    auto_options: object = None  # fxshard.AutoOptions, with plan="auto" (or a "*": "auto" entry)

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"fxshard backend: unknown option(s) {unknown}; known: {list(OPTIONS)}")
        if "mesh" not in options or "plan" not in options:
            missing = [k for k in ("mesh", "plan") if k not in options]
            raise ValueError(
                f"fxshard backend: missing option(s) {missing}. Use torch.compile(model, backend=\"fxshard\", "
                f"options={{\"mesh\": device_mesh, \"plan\": plan}}) with a DeviceMesh (init_device_mesh) and a "
                f"plan mapping module FQNs to ParallelStyles, e.g. {{\"fc1\": ColwiseParallel(), \"fc2\": "
                f"RowwiseParallel()}} ({{}} for none); add \"simulate\": True with a MeshSpec to run every rank "
                f"in one process")
        opts = cls(**options)
        if not isinstance(opts.plan, dict) and opts.plan != "auto":
            raise TypeError(f"fxshard backend: plan must be a dict of module FQN -> ParallelStyle or \"auto\", got "
                            f"{opts.plan!r}")
        if isinstance(opts.mesh, (tuple, list)):
            opts.mesh = MeshSpec(tuple(opts.mesh))
        if isinstance(opts.mesh, MeshSpec) and not opts.simulate:
            raise ValueError("fxshard backend: running needs a DeviceMesh (init_process_group + init_device_mesh); "
                             "a MeshSpec only works with \"simulate\": True")
        return opts

    @property
    def mesh_spec(self) -> MeshSpec:
        return MeshSpec.from_device_mesh(self.mesh)


class _PlanScope:
    """The plan resolved against the top module of a compile (per options dict).  Graphs traced after
    a graph break see submodules as frame locals (``L['layer']``): their FQNs get the submodule's
    prefix in the top module (``layers.1.``)."""

    def __init__(self):
        self.tops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def resolve(self, opts: BackendOptions, frame_modules: dict[str, nn.Module]) -> tuple[PlanConstraints, dict]:
        mesh = opts.mesh_spec
        if not frame_modules:
            if opts.plan == "auto":
                return resolve_plan("auto", None, mesh, opts.tp_dim), {}
            if opts.plan:
                raise ValueError("fxshard backend: a module plan needs torch.compile of an nn.Module (this graph "
                                 "has no module parameters); pass plan={} for plain functions")
            return resolve_plan(None, None, mesh, opts.tp_dim), {}
        for top, cons in self.tops.items():
            roots = _prefixes(top, frame_modules)
            if roots is not None:
                return cons, roots
        # a new top: the outermost module running (a graph break may have left the model's own frame
        # to eager Python), else the frame module that contains the others
        for top in [*calling_modules(), *frame_modules.values()]:
            roots = _prefixes(top, frame_modules)
            if roots is not None:
                cons = resolve_plan(opts.plan, top, mesh, opts.tp_dim)
                self.tops[top] = cons
                return cons, roots
        raise ValueError(f"fxshard backend: the graph uses modules {sorted(frame_modules)} that are not parts of one "
                         f"module; compile the top-level module")


def _prefixes(top: nn.Module, frame_modules: dict[str, nn.Module]) -> dict[str, str] | None:
    """{frame local: its FQN prefix in ``top``}, or None if some frame module is not inside ``top``."""
    where = {id(m): name for name, m in top.named_modules()}
    out = {}
    for local, mod in frame_modules.items():
        if id(mod) not in where:
            return None
        out[local] = where[id(mod)] + "." if where[id(mod)] else ""
    return out


_SCOPES: dict[int, tuple[dict, _PlanScope]] = {}
_GRAPHS: list[weakref.ref] = []  # every ShardedGraph handed to dynamo (for compiled_programs)


def compiled_programs() -> list:
    """The ShardedPrograms the backend has built (oldest first), for ``explain()`` and tests."""
    live = [g() for g in _GRAPHS]
    return [p for g in live if g is not None for p in g.programs]


def _frame_modules(gm: fx.GraphModule) -> dict[str, nn.Module]:
    """The frame locals that are modules and own this graph's parameters / buffers."""
    import re

    names = set()
    for p in gm.graph.nodes:
        if p.op == "placeholder":
            m = re.match(r"^L\['([^']+)'\]\._(modules|parameters|buffers)\[", placeholder_source(p) or "")
            if m:
                names.add(m.group(1))
    frame = dynamo_frame_locals()
    return {n: frame[n] for n in sorted(names) if isinstance(frame.get(n), nn.Module)}


class ShardedGraph:
    """What the backend hands dynamo for one graph: captures, shards and compiles per input signature."""

    def __init__(self, gm: fx.GraphModule, opts: BackendOptions, constraints: PlanConstraints, roots: dict):
        self.gm = gm
        self.opts = opts
        self.constraints = constraints
        self.roots = roots
        self.sources = dynamo_sources(gm)
        # Python numbers dynamo lifted to 0-d tensors are baked into the capture as constants: their
        # values are part of the signature a capture is reused for
        self.baked = {i for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
                      if any(u.op == "call_method" and u.target == "item" for u in p.users)}
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.returns_sequence = isinstance(out, (tuple, list))
        self.num_outputs = len(out) if self.returns_sequence else 1
        self.entries: dict = {}
        self._shards: dict[int, tuple] = {}  # arg index -> (weakref to the global tensor, version, local shard)
        self.programs: list = []  # every ShardedProgram built (debugging: explain())

    def _key(self, args):
        return tuple(((tuple(a.shape), a.dtype, a.device, a.item() if i in self.baked else None)
                      if isinstance(a, torch.Tensor) else
                      (int(a) if isinstance(a, (int, torch.SymInt)) else (type(a), a)))
                     for i, a in enumerate(args))

    def __call__(self, *args):
        # under autograd (a parameter or input requires grad) the joint forward+backward is sharded
        training = torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
        key = (training, *self._key(args))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = self._build(args, training)
        flat = entry(args)
        return tuple(flat) if self.returns_sequence else flat[0]

    def _build(self, args, training=False):
        from . import api

        opts = self.opts
        mesh = opts.mesh_spec
        cm = opts.cost_model or CostModel(mesh)
        c = capture_dynamo_graph(self.gm, args, self.constraints.hooked, self.roots, self.sources, training=training)
        c.replicate_grads = training  # gradients go back to the global parameters and inputs
        c.mesh, c.device_mesh, c.constraints, c.cost_model = mesh, None if opts.simulate else opts.mesh, \
            self.constraints, cm
        c.fuse, c.bucket_bytes = opts.fuse, opts.bucket_bytes
        # the batch is the leading dim of the first user input; other inputs (rope tables handed to a
        # layer's frame after a graph break, masks) stay replicated on the data-parallel dims
        first = next((p.meta["val"] for p in c.gm.graph.nodes if p.op == "placeholder" and info(p).kind == INPUT), None)
        c.batch_size = first.shape[0] if first is not None and first.ndim else None
        replicated = tuple(Replicate() for _ in range(mesh.ndim))
        api.annotate(c, output_placements=[replicated] * self.num_outputs,
                     auto_options=opts.auto_options if self.constraints.auto else None)
        api.redistribute(c)
        prog = api.program(c)
        self.programs.append(prog)
        if training:
            return self._training_entry(prog, args)
        arg_index = [p.meta["fxshard_arg_index"] for p in prog.placeholders]
        if opts.simulate:
            return lambda a: prog.simulate_placeholders([a[i] for i in arg_index])
        compiled = CompiledProgram(prog, opts.mesh, inductor=opts.inductor, own_state=False)
        kinds = [info(p).kind for p in prog.placeholders]

        def run(a):
            local = []
            for i, kind, spec in zip(arg_index, kinds, compiled.specs):
                t = a[i]
                if kind in (PARAM, BUFFER, CONSTANT):
                    local.append(self._cached_shard(i, t, spec, compiled))
                else:
                    local.append(compiled.local_of(t, spec))
            return compiled.run_local(local)

        return run

    def _training_entry(self, prog, args):
        """An autograd-aware runner: the arguments that require grad get global gradients."""
        from .passes.capture import TANGENT

        primals = [p for p in prog.placeholders if info(p).kind != TANGENT]
        index = [p.meta["fxshard_arg_index"] for p in primals]
        if self.opts.simulate:
            def run(a):
                return list(_SimulatedTraining.apply(prog, *[a[i] for i in index]))
            return run
        kinds = [info(p).kind for p in primals]

        def localize(global_args):
            out = []
            for i, kind, spec, t in zip(index, kinds, compiled.primal_specs, global_args):
                if kind in (PARAM, BUFFER, CONSTANT):
                    out.append(self._cached_shard(i, t, spec, compiled))
                else:
                    out.append(compiled.local_of(t, spec))
            return out

        compiled = CompiledTraining(prog, self.opts.mesh, inductor=self.opts.inductor, localize=localize)

        def run(a):
            outs = compiled.apply([a[i] for i in index])
            return list(outs) if isinstance(outs, tuple) else [outs]

        return run

    def _cached_shard(self, i, t, spec, compiled):
        hit = self._shards.get(i)
        if hit is not None and hit[0]() is t and hit[1] == (t._version, t.data_ptr()) \
                and hit[2].shape == local_shape(spec):
            return hit[2]
        local = compiled.local_of(t, spec)
        self._shards[i] = (weakref.ref(t), (t._version, t.data_ptr()), local)
        return local



def fxshard_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """``torch.compile(..., backend="fxshard", options={"mesh": ..., "plan": ...})``."""
    if kwargs:
        raise ValueError(f"fxshard backend: unexpected arguments {sorted(kwargs)}; pass settings in options={{...}}")
    opts = BackendOptions.parse(options)
    key = id(options)
    if key not in _SCOPES or _SCOPES[key][0] is not options:
        while len(_SCOPES) >= 64:  # keep the newest compiles' scopes, not every options dict ever seen
            _SCOPES.pop(next(iter(_SCOPES)))
        _SCOPES[key] = (options, _PlanScope())
    constraints, roots = _SCOPES[key][1].resolve(opts, _frame_modules(gm))
    graph = ShardedGraph(gm, opts, constraints, roots)
    _GRAPHS[:] = [g for g in _GRAPHS if g() is not None] + [weakref.ref(graph)]
    log.info("fxshard backend: graph with %d nodes (frame modules %s)", len(gm.graph.nodes), roots)
    return graph


__all__ = ["fxshard_backend", "compiled_programs", "CompiledProgram", "BackendOptions", "ShardedGraph"]
