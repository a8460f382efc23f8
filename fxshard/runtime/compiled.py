"""One rank's compiled program: the per-rank graph bound to a real ``DeviceMesh`` and handed to
Inductor (``compile_fx_inner``; GPU codegen on CUDA, C++ on CPU), forward-only or training.

Training graphs are split by AOTAutograd's min-cut partitioner into a forward and a backward, both
compiled, run as one ``autograd.Function``; the simulated variant (``SimulatedTraining``) runs the
joint program on simulated ranks twice instead (a debugging mode).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._torch import inductor_compile, partition_joint
from ..core.spec import ShardingSpec
from ..ir import INPUT, PARAM, STATE_KINDS, TANGENT, info
from ..passes.lower import bind_groups, local_shape
from ..planner.execute import group_names
from .agree import (
    Agreement,
    AgreementOptions,
    fail_together,
    fingerprint,
    limit_timeouts,
    uses_random,
)

if TYPE_CHECKING:  # annotations only
    from .program import ShardedProgram


def device_of(device_mesh: DeviceMesh) -> torch.device:
    t = device_mesh.device_type
    if t == "cpu":
        return torch.device("cpu")
    return torch.device(t, torch.get_device_module(t).current_device())


def agreement_for(
    program: ShardedProgram,
    device_mesh: DeviceMesh,
    options: AgreementOptions | None,
    specs: Sequence[ShardingSpec],
) -> Agreement:
    """The ranks' check of ``program`` (``fxshard.runtime.agree``)."""
    # uneven programs: each rank's graph has its own shapes; symbolic ones (dynamic shapes): a
    # rank's trace of shape computations depends on what its ShapeEnv saw before (a rank that
    # printed the plan lowered it once more). The ranks compare the global program and every
    # value's placements instead.
    by_global = program.uneven or program.symbolic
    graph = program.global_graph if by_global else program.local_graph_on(device_of(device_mesh))
    placed = program.all_specs() if by_global else [*specs, *program.output_specs]
    return Agreement(
        device_mesh,
        fingerprint(graph, placed),
        options,
        random=uses_random(program.global_graph),
        what=f"the sharded program of {program.name}",
    )


def input_values(program: ShardedProgram, inputs: Sequence) -> dict[str, object]:
    """The user inputs a call passes, by name (what the ranks compare)."""
    return {f"input {i} ({program.input_name(i)})": v for i, v in enumerate(inputs)}


def _check_mesh(program, device_mesh) -> tuple:
    """This rank's mesh coordinate, after checking there is a process group and the mesh fits."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "compiling a sharded program needs an initialised process group "
            "(torch.distributed.init_process_group) and a DeviceMesh; to run every rank in "
            "one process use simulate() instead"
        )
    if tuple(device_mesh.shape) != tuple(program.mesh.shape):
        raise ValueError(
            f"the program was sharded for mesh {program.mesh.shape}, the DeviceMesh is "
            f"{tuple(device_mesh.shape)}"
        )
    coord = device_mesh.get_coordinate()
    if coord is None:
        raise RuntimeError("this rank is not part of the device mesh")
    return coord


class CompiledProgram:
    """One rank's compiled program (``ShardedProgram.compile``).

    ``fn(*inputs)`` takes the global inputs and returns this rank's shard of every output
    (``output_specs``; replicated outputs are global values).  ``run_local(local_args)`` runs on
    local shards of every placeholder (parameters included), in ``program.placeholders`` order."""

    def __init__(
        self,
        program: ShardedProgram,
        device_mesh: DeviceMesh,
        *,
        inductor: bool = True,
        own_state: bool = True,
        agreement: AgreementOptions | None = None,
    ):
        coord = _check_mesh(program, device_mesh)
        self.program = program
        self.device_mesh = device_mesh
        self.device = device_of(device_mesh)
        self.coord_ints = tuple(int(c) for c in coord)
        self.coord = torch.tensor(self.coord_ints, dtype=torch.long, device=self.device)
        self.specs = [info(p).spec for p in program.placeholders]
        self.output_specs = program.output_specs
        local = bind_groups(
            program.local_graph_on(self.device, self.coord_ints), group_names(device_mesh)
        )
        example = [self.coord] + [
            torch.empty(local_shape(s, self.coord_ints), dtype=s.dtype, device=self.device)
            for s in self.specs
        ]
        self.inductor = inductor
        self.fn = inductor_compile(local, example) if inductor else local
        self.local_graph = local
        self.agreement = agreement_for(program, device_mesh, agreement, self.specs)
        limit_timeouts(local, device_mesh.device_type, self.agreement.options)
        # parameters, buffers and constants: the captured ones sliced on the first call, after the
        # ranks agreed on them (``own_state``); callers that hold their own shards (the backend,
        # parallelize) pass them to run_local instead
        self.own_state = own_state
        self.state: dict[str, torch.Tensor] = {}

    def local_of(self, full: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
        """This rank's shard of a global tensor (a local slice, no communication)."""
        return spec.local_of(full.detach().to(self.device), self.coord_ints)

    def run_local(self, local_args: Sequence[torch.Tensor]) -> list:
        outs = self.fn(self.coord, *local_args)
        return list(outs) if isinstance(outs, (tuple, list)) else [outs]

    def __call__(self, *inputs):
        prog = self.program
        with fail_together(f"the sharded program of {prog.name}"):
            prog.check_inputs(inputs)
            if self.own_state and not self.state:
                self._own_state(inputs)
            else:
                self.agreement.check(input_values(prog, inputs))
            args = []
            for p, spec in zip(prog.placeholders, self.specs):
                rec = info(p)
                if rec.kind in STATE_KINDS:
                    args.append(self.state[rec.fqn])
                else:
                    args.append(self.local_of(inputs[rec.input_index], spec))
            return prog.restructure(prog.apply_updates(self.run_local(args), self.state, inputs))

    def _own_state(self, inputs: Sequence = ()) -> None:
        state = self.program.captured.state
        self.agreement.check(input_values(self.program, inputs), state)
        for p, spec in zip(self.program.placeholders, self.specs):
            rec = info(p)
            if rec.kind in STATE_KINDS:
                self.state[rec.fqn] = self.local_of(state[rec.fqn], spec)


class CompiledTraining:
    """One rank's training program: the per-rank joint graph split by the min-cut partitioner into a
    forward and a backward, each compiled by Inductor (or run eagerly), run as one autograd
    Function.

    ``apply(local_args)`` takes this rank's local shard of every primal placeholder (parameters,
    buffers, inputs: ``program.placeholders`` order without tangents) and returns the forward
    outputs;
    ``backward()`` through them gives every parameter (and input that requires grad) its local
    gradient shard, placed like the parameter."""

    def __init__(
        self,
        program: ShardedProgram,
        device_mesh: DeviceMesh,
        *,
        inductor: bool = True,
        localize: Callable | None = None,
        agreement: AgreementOptions | None = None,
    ):
        if not program.training:
            raise ValueError(
                "CompiledTraining needs a training program (fxshard.shard(..., training=True))"
            )
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
        self.tangents = [
            (info(p).output_index, info(p).spec) for p in places if info(p).kind == TANGENT
        ]
        self.primal_kinds = primal_kinds(program)
        roles = program.output_roles()
        self.num_fwd = sum(r[0] == "output" for r in roles)
        self.grad_roles = roles[self.num_fwd :]
        local = bind_groups(
            program.local_graph_on(self.device, self.coord_ints), group_names(device_mesh)
        )
        for n in local.graph.nodes:  # the partitioner tells primals from tangents by name
            if n.op == "placeholder" and n.name == "mesh_coord":
                n.target = n.name = "primals_mesh_coord"
        local.recompile()
        self._state: dict | None = None  # the captured state's local shards (made on first call)
        self.agreement = agreement_for(program, device_mesh, agreement, self.primal_specs)
        limit_timeouts(local, device_mesh.device_type, self.agreement.options)
        fw, bw = partition_joint(local, self.num_fwd)
        self.forward_graph, self.backward_graph = fw, bw
        if inductor:
            self.fw = inductor_compile(fw, _examples(fw))
            self.bw = inductor_compile(_views_as_reshapes(bw), _examples(bw))
        else:
            self.fw = lambda *a: fw(*a)
            self.bw = lambda *a: bw(*a)

    def local_of(self, full: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
        return spec.local_of(full.detach().to(self.device), self.coord_ints)

    def apply(self, local_args: Sequence[torch.Tensor], side: dict | None = None):
        """The forward outputs (local), differentiable; ``side``: {output index: global gradient}
        that reaches the backward another way than through the output (a KeptTensor's)."""
        return _TrainingStep.apply(self, self.coord, side, *local_args)

    def __call__(self, *inputs, grad_outputs=None):
        """One forward+backward on the global ``inputs`` with the program's own (captured)
        parameters:
        ``(outputs, grads)``, ``grads[fqn]`` this rank's gradient shard (placed like the
        parameter)."""
        prog = self.program
        with fail_together(f"the sharded program of {prog.name}"):
            prog.check_inputs(inputs)
            first = self._state is None
            self.agreement.check(input_values(prog, inputs), prog.captured.state if first else None)
            if first:
                self._state = {}
                for (kind, fqn, _), spec in zip(self.primal_kinds, self.primal_specs):
                    if kind in STATE_KINDS:
                        t = spec.local_of(
                            prog.captured.state[fqn].detach().to(self.device), self.coord_ints
                        )
                        self._state[fqn] = t.requires_grad_(kind == PARAM)
            args = []
            for (kind, fqn, index), spec in zip(self.primal_kinds, self.primal_specs):
                args.append(
                    self._state[fqn]
                    if kind in STATE_KINDS
                    else spec.local_of(inputs[index].to(self.device), self.coord_ints)
                )
            for t in self._state.values():
                t.grad = None
            outs = self.apply(args)
            flat = list(outs) if isinstance(outs, tuple) else [outs]
            gos = [prog.grad_output(i, o, grad_outputs).to(self.device) for i, o in enumerate(flat)]
            torch.autograd.backward(flat, gos)
            return outs, {f: t.grad for f, t in self._state.items() if t.grad is not None}

    def grads_for_inputs(self, grads: Sequence) -> list:
        """Backward outputs mapped onto (mesh coordinate, *primal inputs); None where no
        gradient."""
        return [
            None,
            *gradients_of(self.primal_kinds, dict(zip((tuple(r) for r in self.grad_roles), grads))),
        ]


def primal_kinds(program: ShardedProgram) -> list[tuple]:
    """(kind, fqn, input index) of every placeholder but the incoming gradients, in order."""
    return [
        (info(p).kind, info(p).fqn, info(p).input_index)
        for p in program.placeholders
        if info(p).kind != TANGENT
    ]


def gradients_of(kinds: Sequence[tuple], by_role: dict) -> list:
    """The gradient of every primal input from ``{("grad_param", fqn) | ("grad_input", i):
    value}``."""
    return [
        by_role.get(("grad_param", fqn))
        if kind == PARAM
        else by_role.get(("grad_input", index))
        if kind == INPUT
        else None
        for kind, fqn, index in kinds
    ]


def _examples(gm):
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            out.append(
                torch.empty(v.shape, dtype=v.dtype, device=v.device)
                if isinstance(v, torch.Tensor)
                else v
            )
    return out


def _views_as_reshapes(gm):
    """The backward takes its saved activations contiguous (``_Run.backward``), while the joint
    trace may have viewed them in the layout the forward made (a transposed one): each view
    becomes a reshape, which copies only where the layout it is given needs it."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.view.default:
            n.target = torch.ops.aten.reshape.default
    gm.recompile()
    return gm


def _no_double_backward():
    # grad mode is on inside a Function's backward exactly when the caller asked for create_graph
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "fxshard: double backward (autograd.grad(..., create_graph=True), e.g. a gradient "
            "penalty) through a "
            "sharded graph is not supported: its backward is compiled once and not differentiable"
        )


class _TrainingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner, coord, side, *args):
        if runner.localize is not None:
            args = runner.localize(args)
        outs = list(runner.fw(coord, *args))
        n = runner.num_fwd
        saved = outs[n:]
        ctx.runner, ctx.side = runner, side
        # an output no gradient reaches comes back as None (zeros made below, in the shape of the
        # program's incoming gradient, which need not be the output's: a KeptTensor's)
        ctx.set_materialize_grads(False)
        tensors = [t for t in saved if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.layout = [isinstance(t, torch.Tensor) for t in saved]
        ctx.others = [t for t in saved if not isinstance(t, torch.Tensor)]
        differentiable = {i for i, _ in runner.tangents}
        ctx.mark_non_differentiable(
            *[
                o
                for i, o in enumerate(outs[:n])
                if i not in differentiable and isinstance(o, torch.Tensor)
            ]
        )
        return tuple(outs[:n]) if n > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        _no_double_backward()
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        # Inductor asserts the strides it compiled for: saved activations are handed over contiguous
        saved = [next(tensors).contiguous() if is_t else next(others) for is_t in ctx.layout]
        coord = ctx.runner.coord_ints
        side = ctx.side or {}
        tangents = [
            grads[i].contiguous()
            if grads[i] is not None
            else s.local_of(side[i].to(ctx.runner.device), coord)
            if side.get(i) is not None
            else torch.zeros(local_shape(s, coord), dtype=s.dtype, device=ctx.runner.device)
            for i, s in ctx.runner.tangents
        ]
        with fail_together(f"the backward of the sharded program of {ctx.runner.program.name}"):
            outs = ctx.runner.bw(*saved, *tangents)
        return (None, None, *ctx.runner.grads_for_inputs(list(outs)))


class SimulatedTraining(torch.autograd.Function):
    """The backend's ``simulate`` mode under autograd: the forward runs the joint program's outputs
    on simulated ranks, the backward runs it again with the incoming gradients (a debugging mode:
    twice the forward work, exact collectives).  The backward's run starts from the random
    generator state the forward's did, so it draws the forward's masks again."""

    @staticmethod
    def forward(ctx, prog, *args):
        ctx.prog, ctx.args = prog, [a.detach() for a in args]
        ctx.rng = torch.get_rng_state()
        return tuple(_simulate_joint(prog, ctx.args, None)[0])

    @staticmethod
    def backward(ctx, *grads):
        _no_double_backward()
        now = torch.get_rng_state()
        torch.set_rng_state(ctx.rng)
        try:
            _, by_role = _simulate_joint(ctx.prog, ctx.args, grads)
        finally:
            torch.set_rng_state(now)
        return (None, *gradients_of(primal_kinds(ctx.prog), by_role))


def _simulate_joint(prog, primal_values, grads):
    values, it = [], iter(primal_values)
    for p in prog.placeholders:
        if info(p).kind == TANGENT:
            i = info(p).output_index
            g = grads[i] if grads is not None and grads[i] is not None else None
            values.append(
                g if g is not None else torch.zeros(p.meta["val"].shape, dtype=p.meta["val"].dtype)
            )
        else:
            values.append(next(it))
    flat = prog.simulate_placeholders(values)
    roles = prog.output_roles()
    outs = [v for r, v in zip(roles, flat) if r[0] == "output"]
    return outs, {tuple(r): v for r, v in zip(roles, flat) if r[0] != "output"}
