"""Local-shard modules: ``fxshard.parallelize(model, device_mesh, plan)``.

The returned module's parameters and buffers are DTensors: this rank's shard plus its placements
(replicated ones included), so ``state_dict()`` is a DTensor state dict that
``torch.distributed.checkpoint`` saves and loads (also into / from a torch ``parallelize_module``
model with the same plan: the keys are the model's own FQNs), and torch optimizers and
``clip_grad_norm_`` run on them as on any DTensor model.  A model built on the ``meta`` device is
materialised one parameter at a time, so a model too large for one rank fits; its values then come
from ``load_full_state_dict`` (streamed: one global tensor at a time), DCP, or an ``init_fn``.

Calling the module captures the model (on fake tensors: no memory) for the input shapes at hand,
shards it with the same plan, compiles the per-rank program with Inductor and runs it on the local
shards. It is called as the model is (keywords, ``None`` and flags included: each distinct set of
constants is its own program). Inputs are the global values (every rank passes the same); outputs
are the global values (the program replicates them, with or without autograd), or, with
``outputs="dtensor"``, DTensors of the placements the program produced (``output_specs``; no
gather): a KV cache handed back and in stays sharded across calls (``zoo.CachedLlama``).  Buffers
the forward updates in place are updated in their own shards (placed as the plan says, replicated
where it names none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import api
from ._torch import Replicate, dtensor_local, fake_mode, is_dtensor, set_module_tensor
from .capture.common import CallArgs
from .capture.objects import held, released
from .core.config import DEFAULT_BUCKET_BYTES, DEFAULT_SEARCH
from .core.cost import CostModel, CostModelLike
from .core.mesh import MeshSpec
from .core.spec import ShardingSpec
from .ir import INPUT, OWN_PLACEMENT, STATE_KINDS, info, output_roles
from .placement.constraints import resolve_plan
from .placement.greedy import state_placement
from .placement.problem import PlacementProblem
from .planner import plan_between
from .planner.execute import execute_plan, group_names
from .runtime.agree import Agreement, AgreementOptions, fail_together
from .runtime.boundary import (
    OUTPUTS,
    as_program_arg,
    check_mesh,
    local_arg,
    output_keeper,
    output_wrapper,
    spec_of,
    wrap_output,
)
from .runtime.compiled import CompiledProgram, CompiledTraining, device_of, input_values


def _drop_wrapper_prefix(module, state_dict, prefix, local_metadata) -> None:
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + k[len(inner) :]] = state_dict.pop(k)


def _add_wrapper_prefix(module, state_dict, prefix, *args) -> None:
    inner = prefix + "module."
    for k in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + k[len(prefix) :]] = state_dict.pop(k)


def _owner(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return (model.get_submodule(path) if path else model), name


class ParallelModule(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh,
        plan: dict,
        *,
        tp_dim: int | str | None = None,
        multi_dim_collectives: bool = True,
        fuse: bool | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        cost_model: CostModelLike | None = None,
        inductor: bool = True,
        init_fn: Callable | None = None,
        agreement: AgreementOptions | None = None,
        search: str = DEFAULT_SEARCH,
        outputs: str = "global",
    ):
        super().__init__()
        if outputs not in OUTPUTS:
            raise ValueError(f"fxshard.parallelize: outputs must be one of {list(OUTPUTS)}")
        self.outputs = outputs
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "fxshard.parallelize needs an initialised process group and a DeviceMesh"
            )
        if plan == "auto" or (
            isinstance(plan, dict) and "auto" in [s for s in plan.values() if isinstance(s, str)]
        ):
            raise ValueError(
                "fxshard.parallelize shards the parameters when it is built, before any input is "
                "seen, "
                'so it needs a plan that places them; for plan="auto" use torch.compile(model, '
                'backend="fxshard", options={"mesh": ..., "plan": "auto"}) or fxshard.shard'
            )
        self.module = model
        # the state dict has the model's own FQNs, no "module." (as torch's parallelize_module
        # model: checkpoints of either load into the other), here and nested in another module
        self.register_state_dict_post_hook(_drop_wrapper_prefix)
        self.register_load_state_dict_pre_hook(_add_wrapper_prefix)
        self.device_mesh = device_mesh
        self.mesh = MeshSpec.from_device_mesh(device_mesh)
        self.plan = plan
        self.tp_dim = tp_dim
        self.options = dict(
            multi_dim_collectives=api._multi_dim(multi_dim_collectives, fuse),
            bucket_bytes=bucket_bytes,
            cost_model=cost_model or CostModel(self.mesh),
            search=search,
        )
        self.inductor = inductor
        self.agreement = agreement
        self.device = device_of(device_mesh)
        coord = device_mesh.get_coordinate()
        if coord is None:
            raise RuntimeError("this rank is not part of the device mesh")
        self.coord = tuple(int(c) for c in coord)
        self.constraints = resolve_plan(plan, model, self.mesh, tp_dim)
        self.specs: dict = {}  # fqn -> global ShardingSpec of every parameter and buffer
        self._owners: dict = {}  # fqn -> (owning module, attribute name)
        self._wrappers: dict = {}  # program -> its outputs' DTensor wrapping
        self._keepers: dict = {}  # program -> its state outputs as KeptTensors
        self._kept: dict = {}  # program -> its outputs kept as placed (objects' tensors)
        self.warnings: list[str] = []
        self.uninitialised: set[str] = set()
        self._materialise(init_fn)
        self._programs: dict = {}
        self._constants: dict = {}  # (program, name) -> this rank's part of a lifted constant

    # ---- the model's own names, as torch's state-dict helpers read them -----------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        """The model's parameters under its own FQNs (no ``module.``), as in ``state_dict()``:
        optimizers' named parameters and torch.distributed.checkpoint's ``get_state_dict(pm,
        opt)`` see one set of names."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's protocol for wrappers whose state dict drops
        their own attribute: every top-level name of the model lives under ``module``."""
        names = [n for n, _ in self.module.named_children()]
        names += [n for n, _ in self.module.named_parameters(recurse=False)]
        names += [n for n, _ in self.module.named_buffers(recurse=False)]
        return {n: "module" for n in names}

    # ---- sharding the state ----------------------------------------------------------------------
    def _materialise(self, init_fn):
        model = self.module
        entries = [(f, t, True) for f, t in model.named_parameters(remove_duplicate=False)] + [
            (f, t, False) for f, t in model.named_buffers(remove_duplicate=False)
        ]
        self._agree_on_state(entries)
        shared: dict[int, tuple] = {}  # tied tensors: every alias gets the first FQN's shard
        problem = PlacementProblem(self.mesh, self.options["cost_model"], self.constraints)
        for fqn, t, is_param in entries:
            if id(t) in shared:
                first, local = shared[id(t)]
                self.specs[fqn] = self.specs[first]
                owner, name = _owner(model, fqn)
                set_module_tensor(owner, name, local, parameter=is_param)
                continue
            spec, _prov = state_placement(problem, fqn, t)
            self.specs[fqn] = spec
            with torch.no_grad():
                if t.device.type == "meta":
                    shape = spec.local_shape(self.coord)
                    local = torch.empty(shape, dtype=t.dtype, device=self.device)
                    if init_fn is not None:
                        init_fn(fqn, local, spec)
                    else:
                        self.uninitialised.add(fqn)
                else:
                    local = spec.local_of(t.detach().to(self.device), self.coord).clone()
            owner, name = _owner(model, fqn)
            local = wrap_output(local, self.device_mesh, spec)  # the shard as a DTensor
            if is_param:
                local = nn.Parameter(local, requires_grad=t.requires_grad)
                setattr(owner, name, local)
            else:
                set_module_tensor(owner, name, local, parameter=False)
            shared[id(t)] = (fqn, local)
            del (
                t,
                local,
            )  # a global tensor is freed as soon as its shard replaces it (and its aliases')

    def _agree_on_state(self, entries) -> None:
        """Every rank shards the same global values: where the ranks' models differ (another seed),
        rank ``src_data_rank``'s are taken (``AgreementOptions``), before any shard is cut."""
        real = {f: t for f, t, _ in entries if t.device.type != "meta"}
        layout = repr([(f, tuple(t.shape), str(t.dtype)) for f, t, _ in entries])
        what = f"fxshard.parallelize({type(self.module).__name__})"
        check = Agreement(self.device_mesh, layout, self.agreement, what=what)
        with fail_together(what):
            check.check({}, real)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer as its global tensor (gathered; on every rank)."""
        groups = group_names(self.device_mesh)
        persistent = set(self.module.state_dict(keep_vars=True))
        out = {}
        for fqn, spec in self.specs.items():
            if fqn not in persistent:
                continue
            local = self._local(fqn).detach()
            if all(not lv for lv in spec.levels):
                out[fqn] = local.clone()
                continue
            full = ShardingSpec.make(
                spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype
            )
            plan = plan_between(spec, full, self.options["cost_model"])
            out[fqn] = execute_plan(plan, local.contiguous(), groups, self.coord)
        return out

    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor], strict: bool = True
    ) -> None:
        """Load global tensors: each rank copies its own shard (non-persistent buffers may be given
        too)."""
        unexpected = sorted(set(state_dict) - set(self.specs))
        missing = sorted(set(self.module.state_dict(keep_vars=True)) - set(state_dict))
        if strict and (unexpected or missing):
            raise KeyError(
                f"load_full_state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        with torch.no_grad():
            for fqn, full in state_dict.items():
                if fqn not in self.specs:
                    continue
                spec = self.specs[fqn]
                if tuple(full.shape) != spec.shape:
                    raise ValueError(
                        f"load_full_state_dict: {fqn} has shape {tuple(full.shape)}, the model's "
                        "is "
                        f"{spec.shape}"
                    )
                self._local(fqn).copy_(spec.local_of(full.to(self.device), self.coord))
                self.uninitialised.discard(fqn)

    def _local(self, fqn: str) -> torch.Tensor:
        """This rank's shard of a parameter / buffer (``to_local()``: under autograd its gradient
        flows back to the DTensor parameter, placed like it)."""
        hit = self._owners.get(fqn)
        if hit is None:
            hit = self._owners[fqn] = _owner(self.module, fqn)
        t = getattr(*hit)
        return dtensor_local(t) if is_dtensor(t) else t

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        out = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.uninitialised -= set(state_dict)
        return out

    def local_bytes(self) -> int:
        """Bytes of parameters and buffers this rank holds."""
        return sum(self._local(f).numel() * self._local(f).element_size() for f in self.specs)

    # ---- running ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _global_meta_state(self, mode):
        """Swap every local shard for a fake tensor of the global shape while capturing (fake, not
        meta: ops pick their kernels by device, e.g. CPU/CUDA attention, and the graph must be the
        one that will run)."""
        saved = []
        for fqn, spec in self.specs.items():
            owner, name = _owner(self.module, fqn)
            local = getattr(owner, name)
            with mode:
                meta = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            is_param = isinstance(local, nn.Parameter)
            set_module_tensor(
                owner,
                name,
                nn.Parameter(meta, requires_grad=local.requires_grad) if is_param else meta,
                parameter=is_param,
            )
            saved.append((owner, name, local, is_param))
        try:
            yield
        finally:
            for owner, name, local, is_param in saved:
                set_module_tensor(owner, name, local, parameter=is_param)

    def program_for(self, *inputs, training: bool = False, call: CallArgs | None = None):
        """The ShardedProgram (and its compiled form) for inputs of these shapes.  ``call``: how
        the forward is called when not with these tensors alone (keywords, ``None``, flags: see
        ``forward``); ``inputs`` are then its tensors in order."""
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"fxshard.parallelize: program_for takes the call's tensors (got "
                    f"{type(x).__name__}); pass the rest as call=CallArgs(args, kwargs)"
                )
        # what the captured program depends on besides shapes: which parameters train, and each
        # submodule's train/eval mode (dropout, norms); DTensor inputs: their specs
        given = [
            spec_of(x, self.mesh, f"input {i}") if is_dtensor(x) else None
            for i, x in enumerate(inputs)
        ]
        key = (
            training,
            call.key() if call is not None else None,
            tuple(p.requires_grad for p in self.module.parameters()),
            tuple(m.training for m in self.module.modules()),
            *((tuple(x.shape), x.dtype, x.requires_grad, g) for x, g in zip(inputs, given)),
        )
        hit = self._programs.get(key)
        if hit is not None:
            return hit
        fm = fake_mode(allow_non_fake_inputs=True)
        with fm:
            meta_inputs = [
                torch.empty(x.shape, dtype=x.dtype, device=self.device).requires_grad_(
                    x.requires_grad
                )
                if isinstance(x, torch.Tensor)
                else x
                for x in inputs
            ]
        returned = _Returned()
        with self._global_meta_state(fm), _called_with(self.module, call, returned):
            prog = api.shard(
                self.module,
                self.mesh,
                self.plan,
                example_inputs=meta_inputs,
                input_placements=given if any(g is not None for g in given) else None,
                # outputs="global": the global values, with or without autograd (a vocab-sharded
                # head's shards are gathered in the program, where the planner prices it), but for
                # the tensors of objects the forward returns (a cache): state, kept as placed
                output_placements=returned.placements(self.mesh.ndim)
                if self.outputs == "global"
                else None,
                tp_dim=self.tp_dim,
                training=training,
                **self.options,
            )
        for p in prog.placeholders:
            rec = info(p)
            if (
                rec.kind in STATE_KINDS
                and rec.fqn in self.specs
                and rec.spec != self.specs[rec.fqn]
            ):
                raise AssertionError(
                    f"fxshard.parallelize: {rec.fqn} was sharded as {self.specs[rec.fqn]} but the "
                    f"program wants {rec.spec}"
                )
        if training:
            compiled = CompiledTraining(
                prog, self.device_mesh, inductor=self.inductor, agreement=self.agreement
            )
        else:
            compiled = CompiledProgram(
                prog,
                self.device_mesh,
                inductor=self.inductor,
                own_state=False,
                agreement=self.agreement,
            )
        self._programs[key] = (prog, compiled)
        self._kept[prog] = [k for k, h in enumerate(returned.mask or ()) if h]
        return prog, compiled

    @property
    def output_specs(self):
        """The output specs of the last program built (training programs: the forward outputs)."""
        if not self._programs:
            return None
        prog = list(self._programs.values())[-1][0]
        return prog.forward_output_specs

    # compiled already (per input shapes, with Inductor): torch.compile of it, or of a model that
    # calls it, runs it as it is (a graph break around it) rather than tracing its machinery
    @torch.compiler.disable
    def forward(self, *args, **kwargs):
        """The model's forward on the shards, called as the model is: positional and keyword
        arguments, tensors (global values or DTensors) in any pytree container, and constants
        (``None``, numbers, strings, flags), which the program bakes in: each distinct call
        signature gets its own program (``model(input_ids=x, labels=y)`` as transformers models
        are called)."""
        call = None
        if kwargs or not all(isinstance(x, torch.Tensor) for x in args):
            call = CallArgs(args, kwargs)
            if call.unsupported:
                raise TypeError(
                    f"fxshard.parallelize({type(self.module).__name__}): the forward is called "
                    f"with a {call.unsupported[0]}; a sharded program takes tensors, containers "
                    "of them and constants (None, numbers, strings). Pass its tensors instead "
                    "(for a transformers cache: use_cache=False, or torch.compile(model, "
                    'backend="fxshard", options=...), which keeps a cache sharded between calls)'
                )
            inputs = tuple(call.tensors)
        else:
            inputs = args
        if self.uninitialised:
            raise RuntimeError(
                f"fxshard.parallelize: {len(self.uninitialised)} tensors of the meta-built model "
                "have "
                f"no values yet (e.g. {sorted(self.uninitialised)[:3]}); call "
                "load_full_state_dict(...), or load_state_dict(sd) after "
                "torch.distributed.checkpoint.load(sd := pm.state_dict(), ...), or pass init_fn= "
                "to parallelize"
            )
        training = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
        )
        inputs = tuple(self._program_input(i, x) for i, x in enumerate(inputs))
        prog, compiled = self.program_for(*inputs, training=training, call=call)
        with fail_together(f"the sharded program of {prog.name}"):
            # the shards differ across ranks by design: the ranks compare the (global) inputs only
            compiled.agreement.check(
                {k: v for k, v in input_values(prog, inputs).items() if not is_dtensor(v)}
            )
            args = []
            for p in prog.placeholders:
                rec = info(p)
                if rec.kind in STATE_KINDS:
                    args.append(
                        self._local(rec.fqn) if rec.fqn in self.specs else self._constant(prog, rec)
                    )
                elif rec.kind == INPUT:
                    x = inputs[rec.input_index]
                    if is_dtensor(x):  # its shard as it is (to_local: differentiable)
                        args.append(local_arg(x, rec.spec, self.coord, f"input {rec.input_index}"))
                    else:
                        args.append(rec.spec.local_of(x.to(self.device), self.coord))
            if training:
                side: dict = {}  # gradients reaching the KeptTensors handed back (global)
                outs = compiled.apply(args, side=side)
                return self._released(
                    prog,
                    prog.restructure(
                        self._wrap(prog, list(outs) if isinstance(outs, tuple) else [outs], side)
                    ),
                )
            local = {r.what: self._local(r.what) for r in prog.output_roles() if r.kind == "mutate"}
            return self._released(
                prog,
                prog.restructure(
                    self._wrap(prog, prog.apply_updates(compiled.run_local(args), local))
                ),
            )

    def _wrap(self, prog, flat: list, side: dict | None = None) -> list:
        """With outputs="dtensor": the outputs as DTensors of the program's specs; else the
        tensors of objects the forward returns (a cache) as KeptTensors where sharded (a training
        call's keep their autograd history: their gradients reach the backward through ``side``)."""
        wrap = self._wrappers.get(prog)
        if wrap is None:
            specs = prog.forward_output_specs
            as_dtensor = [self.outputs == "dtensor"] * len(specs)
            wrap = self._wrappers[prog] = output_wrapper(specs, self.device_mesh, as_dtensor)
        flat = wrap(flat)
        if self.outputs == "global":
            keep = self._keepers.get(prog)
            if keep is None:
                specs = prog.forward_output_specs
                sharded = [
                    k
                    for k in self._kept.get(prog, ())
                    if any(not isinstance(p, Replicate) for p in specs[k].placements)
                ]
                timeout = (self.agreement or AgreementOptions()).timeout_s
                keep = output_keeper(specs, sharded, self.device_mesh, timeout)
                self._keepers[prog] = keep
            flat = keep(flat, side)
        return flat

    def _released(self, prog, out):
        """The objects the forward returns rebuilt (only programs that return any: no walk of
        every call's outputs otherwise)."""
        return released(out) if self._kept.get(prog) else out

    def _constant(self, prog, rec) -> torch.Tensor:
        """This rank's part of a tensor the model makes from Python values as it runs (Gemma's
        ``torch.tensor(hidden_size**0.5)``): the capture lifts it out of the graph as a constant,
        which no parameter or buffer holds."""
        key = (id(prog), rec.fqn)
        hit = self._constants.get(key)
        if hit is None:
            value = prog.captured.state[rec.fqn].detach().to(self.device)
            hit = self._constants[key] = rec.spec.local_of(value, self.coord)
        return hit

    def _program_input(self, i: int, x):
        if not is_dtensor(x):
            return x
        check_mesh(x, self.device_mesh, f"input {i}")
        return as_program_arg(x, self.mesh, f"input {i}")


class _Returned:
    """What a captured forward returned: per flat output, whether it is a tensor of an object the
    forward returns (``capture.objects``: a transformers cache), which the program leaves as it
    places it (state: gathered only where eager code reads it)."""

    def __init__(self):
        self.mask: list[bool] | None = None

    def hold(self, out):
        out, self.mask = held(out)
        return out

    def placements(self, ndim: int):
        def decide(captured) -> list:
            output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
            count = sum(r.kind == "output" for r in output_roles(output))
            mask = self.mask if self.mask is not None and len(self.mask) == count else []
            replicated = (Replicate(),) * ndim
            return [
                OWN_PLACEMENT if k < len(mask) and mask[k] else replicated for k in range(count)
            ]

        return decide


@contextlib.contextmanager
def _called_with(module: nn.Module, call: CallArgs | None, returned: _Returned):
    """While capturing: ``module``'s forward takes the call's tensors alone (the program's inputs)
    and calls the model's own forward with the call's keywords and constants rebuilt around them;
    objects it returns that pytree does not know are handed back as their tensors (``returned``)."""
    own = module.__dict__.get("forward")  # an instance's own forward (patched), else the class's
    original = module.forward

    def forward(*tensors):
        args, kwargs = call.rebuild(tensors) if call is not None else (tensors, {})
        return returned.hold(original(*args, **kwargs))

    module.forward = forward
    try:
        yield
    finally:
        if own is not None:
            module.forward = own
        else:
            del module.forward


def parallelize(model: nn.Module, device_mesh: DeviceMesh, plan: dict, **kwargs) -> ParallelModule:
    """``model`` with every parameter replaced by this rank's shard (see the module docstring).

    ``kwargs``: ``tp_dim``, ``multi_dim_collectives``, ``bucket_bytes``, ``cost_model``, ``search``,
    ``outputs`` (``"dtensor"``: outputs are DTensors of the program's placements, not gathered),
    ``inductor`` (False: run the per-rank graph eagerly), ``init_fn(fqn, local_tensor, spec)``
    (fills shards of a meta-built model), ``agreement`` (``fxshard.AgreementOptions``: where the
    ranks' models differ, rank ``src_data_rank``'s values are sharded; the first calls of each
    program check that every rank passes the same inputs)."""
    return ParallelModule(model, device_mesh, plan, **kwargs)
