"""ShardedProgram: what ``fxshard.shard`` returns and users hold."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from .. import report
from .._torch import coordinate_tensor, dtensor_local, is_dtensor, tree_unflatten
from ..capture import Captured
from ..capture.symbolic import restore
from ..ir import STATE_KINDS, Collective, NodeKind, Role, info, output_roles
from ..passes.bucket import bucket_collectives
from ..passes.lower import (
    bind_groups,
    collective_nodes,
    is_uneven,
    local_shape_classes,
    lower_to_local,
    planned_collectives,
    run_per_rank,
)
from ..placement.problem import modelled_cost
from ..planner.execute import group_names, mesh_coordinate
from ..rules.experts import (
    MOE_EXPERTS_DISPATCH,
    MOE_EXPERTS_DISPATCH_BACKWARD,
    dispatch_steps,
)
from .agree import AgreementOptions
from .simulate import SimulatedMesh


class ShardedProgram:
    """A sharded program: the annotated global graph (``global_graph``, with its redistribute
    nodes), the per-rank graph it lowers to (``local_graph``: local ops and functional collectives,
    bucketed), and the ways to look at and run it (``explain``, ``collectives``, ``simulate``,
    ``compile``)."""

    def __init__(
        self,
        captured: Captured,
        *,
        after_lower: Sequence[Callable] = (),
        after_bucket: Sequence[Callable] = (),
    ):
        self.captured = captured
        self.config = captured.config
        self.global_graph = captured.gm
        self.mesh = captured.config.mesh
        self.cost_model = captured.config.cost_model
        self.device_mesh = captured.config.device_mesh
        self.warnings = captured.warnings
        self.after_lower = tuple(after_lower)
        self.after_bucket = tuple(after_bucket)
        self._local: dict = {}  # (device (None: where captured), coordinate) -> per-rank graph
        self.bucketed = 0  # collectives merged into others by bucketing in the per-rank graph
        self._uneven: bool | None = None
        self._symbolic: fx.GraphModule | None = None

    @property
    def graph(self) -> fx.GraphModule:
        """Deprecated name of ``global_graph`` (a GraphModule, like ``local_graph``)."""
        warnings.warn(
            "ShardedProgram.graph is deprecated: use global_graph (the GraphModule)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.global_graph

    # ---- views ----------------------------------------------------------------------------------
    @property
    def local_graph(self) -> fx.GraphModule:
        """The per-rank graph (process groups named ``fxshard_mesh_dim_<m>`` until bound); where
        shards are uneven, the mesh's first rank's (``local_graph_on(device, coord)`` for
        another's)."""
        return self.local_graph_on(None)

    @property
    def uneven(self) -> bool:
        """Some value is sharded unevenly (torch.chunk's layout): local shapes differ by rank, and
        the per-rank graph is lowered for one rank at a time (``local_graph_on(coord=)``)."""
        if self._uneven is None:
            self._uneven = is_uneven(self.global_graph)
        return self._uneven

    @property
    def symbolic(self) -> bool:
        """One program for every size of some dims (dynamic shapes): the per-rank graph is lowered
        from ``lowered_graph``, the annotated graph with symbolic sizes."""
        return self.captured.symbolic is not None

    @property
    def lowered_graph(self) -> fx.GraphModule:
        """The annotated graph lowering traces: ``global_graph``, or for a symbolic program the
        same with its symbolic values and shape arguments put back (``capture.symbolic``)."""
        if not self.symbolic:
            return self.global_graph
        if self._symbolic is None:
            self._symbolic = restore(self.global_graph, self.captured.symbolic.gm)
        return self._symbolic

    def all_specs(self) -> list:
        """Every node's placement, in graph order (what the ranks compare for an uneven program)."""
        return [info(n).spec for n in self.global_graph.graph.nodes]

    def local_shape_classes(self) -> list[list[tuple]]:
        """Mesh coordinates grouped by their local shapes: one per-rank graph per group (a single
        group when every shard is even)."""
        return local_shape_classes(self.global_graph, self.mesh.shape)

    def local_graph_on(
        self, device: torch.device | str | None, coord: Sequence[int] | None = None
    ) -> fx.GraphModule:
        """The per-rank graph with its factory ops on ``device`` (None: where the program was
        captured), for the rank at ``coord`` where shards are uneven (default: the mesh's first
        rank; ignored where every shard is even: one graph serves every rank).  Built on first use:
        lowered, then ``after_lower`` passes, bucketed (up to the config's ``bucket_bytes``; even
        programs only), then ``after_bucket`` passes."""
        at = None
        if self.uneven:
            at = tuple(int(c) for c in coord) if coord is not None else (0,) * self.mesh.ndim
        key = (None if device is None else str(device), at)
        if key not in self._local:
            local = lower_to_local(self.lowered_graph, self.mesh.ndim, device=device, coord=at)
            self._run(self.after_lower, local)
            # uneven programs are not bucketed: bucketing decides from local sizes and node order,
            # which differ by rank there, and every rank must run the same collectives
            if self.config.bucket_bytes and not self.uneven:
                self.bucketed = bucket_collectives(local, self.config.bucket_bytes)
            self._run(self.after_bucket, local)
            self._local[key] = local
        return self._local[key]

    def _run(self, passes, local: fx.GraphModule) -> None:
        for fn in passes:
            fn(local, self)
            local.graph.lint()
            local.recompile()

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.global_graph.graph.nodes if n.op == "placeholder"]

    @property
    def output_specs(self) -> tuple:
        """The ShardingSpec of every output (what the per-rank program returns a shard of)."""
        return tuple(info(self._output_node()).input_specs)

    @property
    def forward_output_specs(self) -> tuple:
        """The specs of the model's own outputs (no gradients, no in-place state updates), in
        order."""
        return tuple(
            s for r, s in zip(self.output_roles(), self.output_specs) if r.kind == "output"
        )

    def _output_node(self) -> fx.Node:
        return next(n for n in reversed(self.global_graph.graph.nodes) if n.op == "output")

    def redistribute_nodes(self) -> list[fx.Node]:
        return [n for n in self.global_graph.graph.nodes if info(n).kind == NodeKind.REDISTRIBUTE]

    def planned_collectives(self) -> list[Collective]:
        """Every collective step the redistributions plan, in graph order (before bucketing)."""
        return planned_collectives(self.global_graph)

    def collectives(self) -> list[Collective]:
        """What the per-rank graph runs, in order: one entry per collective node, listing the
        planned collectives it ``carries`` (several where bucketing merged them; their bytes add up,
        its cost is one collective of that size).  An experts region that dispatches tokens
        (``rules.experts``) lists its three all-to-alls, with a rank's whole routed rows as their
        input (how many leave the rank is known only when it runs)."""
        out = []
        local = self.local_graph
        ours = set(collective_nodes(local))
        for n in local.graph.nodes:
            if n.op == "call_function" and n.target in (
                MOE_EXPERTS_DISPATCH,
                MOE_EXPERTS_DISPATCH_BACKWARD,
            ):
                out.extend(_dispatch_collectives(n, self.cost_model))
            if n not in ours:
                continue
            planned = info(n).carries
            if len(planned) == 1:
                out.append(
                    Collective(*_fields(planned[0]), carries=planned, padding=planned[0].padding)
                )
                continue
            first = planned[0]
            nbytes = sum(c.bytes for c in planned)
            cost = float(self.cost_model.collective(first.kind, first.mesh_dims, nbytes))
            out.append(
                Collective(
                    first.kind,
                    first.mesh_dims,
                    nbytes,
                    cost,
                    n.name,
                    f"bucket of {len(planned)}: " + "; ".join(c.node for c in planned),
                    first.transition,
                    first.phase,
                    planned,
                    sum(c.padding for c in planned),
                )
            )
        return out

    def modelled_cost(self) -> dict:
        """Modelled µs per step under the cost model: ``comm_us`` (every redistribution's plan),
        ``compute_us`` (every op on its local shards), ``total_us``; ``state_bytes``: parameters and
        buffers per rank.  The objective ``plan="auto"`` minimises, for any program."""
        return modelled_cost(self.global_graph, self.cost_model)

    def explain(self, verbose: bool = False, format: str = "text") -> str:
        """The plan as a table (``format="json"`` / ``"html"`` for tools and browsers)."""
        return report.explain(self, verbose=verbose, format=format)

    # ---- running ---------------------------------------------------------------------------------
    def placeholder_values(self, inputs: Sequence, grad_outputs: Sequence | None = None) -> list:
        """The global value of every placeholder: state, inputs and (training) incoming
        gradients."""
        vals = []
        for p in self.placeholders:
            rec = info(p)
            if rec.kind in STATE_KINDS:
                vals.append(self.captured.state[rec.fqn])
            elif rec.kind == NodeKind.TANGENT:
                vals.append(self.grad_output(rec.output_index, p.meta["val"], grad_outputs))
            else:
                assert rec.kind == NodeKind.INPUT
                vals.append(inputs[rec.input_index])
        return vals

    @staticmethod
    def grad_output(i: int, val: torch.Tensor, grad_outputs: Sequence | None) -> torch.Tensor:
        if grad_outputs is not None:
            g = grad_outputs[i] if isinstance(grad_outputs, (tuple, list)) else grad_outputs
            if tuple(g.shape) != tuple(val.shape):
                raise ValueError(
                    f"grad_outputs[{i}] has shape {tuple(g.shape)}, output {i} has "
                    f"{tuple(val.shape)}"
                )
            return g
        if val.numel() != 1:
            raise ValueError(
                f"output {i} of shape {tuple(val.shape)} is not a scalar loss: pass grad_outputs="
            )
        return torch.ones((), dtype=val.dtype).reshape(val.shape)

    @property
    def training(self) -> bool:
        return self.captured.training

    def output_roles(self) -> list[Role]:
        """What each flat output is: ("output", i), ("grad_param", fqn) or ("grad_input", i)."""
        return output_roles(self._output_node())

    def simulate(self, *inputs, grad_outputs: Sequence | None = None):
        """Run every rank in one process (exact collectives); returns the global outputs.

        Training programs return ``(outputs, grads)``: ``grads[fqn]`` is every parameter's global
        gradient (``grads["input:<i>"]`` for inputs that require grad).  A scalar output is seeded
        with 1; otherwise pass ``grad_outputs`` (one per differentiable output)."""
        self.check_inputs(inputs)
        if not self.training:
            flat = self.simulate_placeholders(self.placeholder_values(inputs))
            return self.restructure(self.apply_updates(flat, self.captured.state, inputs))
        flat = self.simulate_placeholders(self.placeholder_values(inputs, grad_outputs))
        return self.split_training_outputs(flat)

    def apply_updates(self, flat: list, state: dict, inputs: Sequence = ()) -> list:
        """Write the new value of every parameter / buffer the forward updated in place into
        ``state[fqn]`` (global tensors, or a rank's shards), and of every user input it updated
        into ``inputs[i]`` (a DTensor's local shard, or the global tensor), as eager PyTorch would;
        returns the other outputs."""
        outs = []
        with torch.no_grad():
            for role, value in zip(self.output_roles(), flat):
                if role.kind == "mutate":
                    state[role.what].copy_(value)
                elif role.kind == "mutate_input":
                    target = inputs[role.what]
                    (dtensor_local(target) if is_dtensor(target) else target).copy_(value)
                else:
                    outs.append(value)
        return outs

    def check_inputs(self, inputs: Sequence) -> None:
        """Raise unless ``inputs`` are what the program was traced for: as many, each tensor of its
        traced shape and dtype, each Python number its traced value (baked into the program)."""
        n = self.captured.num_inputs
        if len(inputs) != n:
            raise TypeError(f"this program takes {n} inputs, got {len(inputs)}")
        redo = (
            "shard again with example inputs like these (fxshard.shard(..., example_inputs=...)), "
            'or use torch.compile(model, backend="fxshard", ...), which builds a program per '
            "input signature"
        )
        for p in self.placeholders:
            rec = info(p)
            if rec.kind != NodeKind.INPUT:
                continue
            i, val, given = rec.input_index, p.meta["val"], inputs[rec.input_index]
            if not isinstance(given, torch.Tensor):
                raise TypeError(
                    f"input {i} ({p.name}) was traced as a tensor of shape {tuple(val.shape)}; "
                    f"got {type(given).__name__}"
                )
            if tuple(given.shape) != tuple(val.shape) or given.dtype != val.dtype:
                raise ValueError(
                    f"input {i} ({p.name}) has shape {tuple(given.shape)} and dtype {given.dtype}, "
                    f"but the program was traced for shape {tuple(val.shape)} and dtype "
                    f"{val.dtype}: {redo}"
                )
        model, snap = self.captured.model, self.captured.snapshot
        changed = snap.changes(model) if model is not None and snap is not None else []
        if changed:
            raise ValueError(
                f"the model changed since it was sharded: {'; '.join(changed)}. fxshard.shard "
                f"traces the model once, with these baked in: shard again (torch.compile(model, "
                f'backend="fxshard", ...) guards on them and recompiles)'
            )
        for i, traced in self.captured.scalar_inputs.items():
            given = inputs[i]
            if type(given) is not type(traced) or given != traced:
                raise ValueError(
                    f"input {i} is {given!r}, but the program was traced with {traced!r}, which is "
                    f"baked into it: {redo} (or pass the value as a tensor)"
                )

    def split_training_outputs(self, flat: list):
        outs, grads = [], {}
        for role, value in zip(self.output_roles(), flat):
            if role[0] == "output":
                outs.append(value)
            elif role[0] == "grad_param":
                grads[role[1]] = value
            elif role[0] == "grad_input":
                grads[f"input:{role[1]}"] = value
        spec = self.captured.out_spec
        if spec is not None and spec.num_leaves == len(outs):
            return tree_unflatten(outs, spec), grads
        structure = outs if len(outs) != 1 else outs[0]
        return (tuple(structure) if isinstance(structure, list) else structure), grads

    def simulate_placeholders(self, values: Sequence) -> list:
        """Simulate on the global value of every placeholder (parameters included); flat outputs.

        Even programs run their per-rank graph; uneven ones (local shapes differ by rank) run the
        lowering's interpreter eagerly, every rank's shapes at once (the per-rank graphs are that
        interpreter traced for one rank; ``after_lower`` passes and bucketing are not applied)."""
        # lower outside the simulation (tracing must not see LocalTensorMode)
        unbound = None if self.uneven else self.local_graph
        with SimulatedMesh(self.mesh.shape, self.mesh.names) as sim:
            groups = group_names(sim.device_mesh)
            # (a symbolic program's specs are for the hinted sizes: here, for this call's)
            args = [
                sim.distribute(v.detach(), info(p).spec.at_sizes(v.shape))
                for p, v in zip(self.placeholders, values)
            ]
            if unbound is None:
                outs = run_per_rank(
                    self.lowered_graph, groups, mesh_coordinate(sim.device_mesh), args
                )
            else:
                outs = bind_groups(unbound, groups)(coordinate_tensor(sim.device_mesh), *args)
            flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            return [
                sim.assemble(o, s.at_sizes(s.global_shape(o.shape))) if s is not None else o
                for o, s in zip(flat, self.output_specs)
            ]

    def restructure(self, flat: list):
        """Flat (forward) outputs in the structure the model returns (its pytree: dicts,
        tuples...)."""
        spec = self.captured.out_spec
        if spec is not None and spec.num_leaves == len(flat):
            return tree_unflatten(list(flat), spec)
        structure = self._output_node().args[0]
        if isinstance(structure, (tuple, list)) and len(structure) > 1:
            return type(structure)(flat) if len(flat) > 1 else flat[0]
        return flat[0]

    @property
    def name(self) -> str:
        """What was sharded: the model's class or the function's name."""
        model = self.captured.model
        fn = getattr(model, "fn", None) if type(model).__name__ == "FnModule" else None
        if fn is not None:
            return getattr(fn, "__qualname__", None) or type(fn).__name__
        return type(model).__name__ if model is not None else "a graph"

    def input_name(self, i: int) -> str:
        """The name of user input ``i`` in the captured graph."""
        for p in self.placeholders:
            if info(p).kind == NodeKind.INPUT and info(p).input_index == i:
                return p.name
        return f"input {i}"

    def compile(
        self,
        device_mesh: DeviceMesh | None = None,
        *,
        inductor: bool = True,
        agreement: AgreementOptions | None = None,
    ):
        """This rank's program, compiled by Inductor (``inductor=False``: the per-rank graph run
        eagerly).

        Needs an initialised process group and a ``DeviceMesh`` of the program's shape (the one
        given to ``fxshard.shard``, or ``device_mesh``).  The result takes the global inputs (each
        rank slices its shard locally: no communication) and returns this rank's shard of every
        output (``.output_specs``); replicated outputs are the global values.  Parameters are sliced
        to local shards once, on the first call, after the ranks agreed on them; ``agreement``
        (``fxshard.AgreementOptions``) sets how the ranks check that they run one program on
        the same inputs (``fxshard.runtime.agree``)."""
        from .compiled import CompiledProgram, CompiledTraining

        dm = device_mesh if device_mesh is not None else self.device_mesh
        if dm is None:
            raise ValueError(
                "ShardedProgram.compile needs a DeviceMesh: shard with one, or pass "
                "compile(device_mesh)"
            )
        # fn(*inputs, grad_outputs=None) -> (outputs, {fqn: local gradient shard})
        if self.training:
            return CompiledTraining(self, dm, inductor=inductor, agreement=agreement)
        return CompiledProgram(self, dm, inductor=inductor, agreement=agreement)

    def __repr__(self) -> str:
        kinds: dict[str, int] = {}
        for c in self.planned_collectives():
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        return f"ShardedProgram(mesh={self.mesh.shape}, collectives={kinds})"


def _dispatch_collectives(n: fx.Node, cost_model) -> list[Collective]:
    """The all-to-alls of a token-dispatching experts region (forward or backward)."""
    backward = n.target is MOE_EXPERTS_DISPATCH_BACKWARD
    x, idx, w = (a.meta["val"] for a in n.args[int(backward) : int(backward) + 3])
    starts, group = n.args[-2], n.args[-1]
    m = int(group.rsplit("_", 1)[1]) if group.startswith("fxshard_mesh_dim_") else 0
    out = []
    for what, b in dispatch_steps(backward, x, idx, w, int(starts[-1])):
        cost = float(cost_model.collective("all_to_all", (m,), b))
        why = f"experts region {n.name}: token dispatch ({what}; rows leaving: data dependent)"
        out.append(Collective("all_to_all", (m,), b, cost, n.name, why, "dispatch",
                              "backward" if backward else "forward"))  # fmt: skip
    return out


def _fields(c: Collective) -> tuple:
    return (c.kind, c.mesh_dims, c.bytes, c.cost, c.node, c.provenance, c.transition, c.phase)
