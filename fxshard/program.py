"""ShardedProgram: what ``fxshard.shard`` returns and users hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .cost import CostModel
from .mesh import MeshSpec
from .passes.capture import BUFFER, CONSTANT, INPUT, PARAM, TANGENT, Captured, info
from .passes.lower import bind_groups, lower_to_local
from .spec import placements_str


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather / reduce_scatter / all_reduce / all_to_all
    mesh_dims: tuple[int, ...]
    bytes: int  # per rank, the collective's local input
    cost: float  # modelled µs
    node: str  # the redistribute node
    provenance: str  # why it is there: the consumer and its module / plan entry
    transition: str  # e.g. "S(1)R -> S(1)P" on the mesh dims moved
    phase: str = "forward"  # "backward" for collectives that depend on an incoming gradient (training)


class ShardedProgram:
    def __init__(self, gm: fx.GraphModule, captured: Captured, mesh: MeshSpec, cost_model: CostModel,
                 warnings: list[str], device_mesh=None, after_lower=()):
        self.graph = gm
        self.captured = captured
        self.mesh = mesh
        self.cost_model = cost_model
        self.warnings = warnings
        self.device_mesh = device_mesh
        self._local: dict = {}  # device (None: where captured) -> per-rank graph
        self.after_lower = tuple(after_lower)
        self.bucketed = 0  # collectives removed by bucketing in the per-rank graph

    # ---- views ----------------------------------------------------------------------------------
    @property
    def local_graph(self) -> fx.GraphModule:
        """The per-rank graph (process groups named ``fxshard_mesh_dim_<m>`` until bound)."""
        return self.local_graph_on(None)

    def local_graph_on(self, device) -> fx.GraphModule:
        """The per-rank graph with its factory ops on ``device`` (None: where the program was captured)."""
        key = None if device is None else str(device)
        if key not in self._local:
            local = lower_to_local(self.graph, self.mesh.ndim, device=device)
            cap = getattr(self.captured, "bucket_bytes", 0)
            if cap:
                from .passes.fuse import bucket_collectives

                self.bucketed = bucket_collectives(local, cap)
            for fn in self.after_lower:
                fn(local, self)
                local.graph.lint()
                local.recompile()
            self._local[key] = local
        return self._local[key]

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.graph.nodes if n.op == "placeholder"]

    @property
    def output_specs(self) -> tuple:
        """The ShardingSpec of every output (what the per-rank program returns a shard of)."""
        return tuple(info(next(n for n in self.graph.graph.nodes if n.op == "output")).input_specs)

    def redistribute_nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.graph.nodes if info(n).kind == "redistribute"]

    def backward_nodes(self) -> set:
        """Nodes that depend on an incoming gradient (empty for forward-only programs)."""
        seen = set()
        for p in self.placeholders:
            if info(p).kind == TANGENT:
                stack = [p]
                while stack:
                    n = stack.pop()
                    for u in n.users:
                        if u not in seen:
                            seen.add(u)
                            stack.append(u)
        return seen

    def collectives(self) -> list[Collective]:
        out = []
        backward = self.backward_nodes() if self.training else set()
        for n in self.redistribute_nodes():
            rec = info(n)
            plan = rec.plan
            for step, nbytes in plan.collective_bytes():
                where = f"{rec.module}: " if rec.module else ""
                out.append(Collective(step.collective, step.mesh_dims, nbytes, step.cost, n.name,
                                      f"{where}{rec.provenance}",
                                      f"{placements_str((step.src,))}->{placements_str((step.dst,))}",
                                      "backward" if n in backward else "forward"))
        return out

    def modelled_cost(self) -> dict:
        """Modelled µs per step under the cost model: ``comm_us`` (every redistribution's plan),
        ``compute_us`` (every op on its local shards), ``total_us``; ``state_bytes``: parameters and
        buffers per rank.  The objective ``plan="auto"`` minimises, for any program."""
        from .passes.auto import modelled_cost

        return modelled_cost(self.graph, self.cost_model)

    def explain(self, verbose: bool = False, format: str = "text") -> str:
        """The plan as a table (``format="json"`` / ``"html"`` for tools and browsers)."""
        from .report import explain

        return explain(self, verbose=verbose, format=format)

    # ---- running ----------------------------------------------------------------------------------
    def placeholder_values(self, inputs, grad_outputs=None) -> list:
        """The global value of every placeholder: state, inputs and (training) incoming gradients."""
        vals = []
        for p in self.graph.graph.nodes:
            if p.op != "placeholder":
                continue
            rec = info(p)
            if rec.kind in (PARAM, BUFFER, CONSTANT):
                vals.append(self.captured.state[rec.fqn])
            elif rec.kind == TANGENT:
                vals.append(self.grad_output(rec.input_index, p.meta["val"], grad_outputs))
            else:
                assert rec.kind == INPUT
                vals.append(inputs[rec.input_index])
        return vals

    @staticmethod
    def grad_output(i: int, val, grad_outputs):
        if grad_outputs is not None:
            g = grad_outputs[i] if isinstance(grad_outputs, (tuple, list)) else grad_outputs
            if tuple(g.shape) != tuple(val.shape):
                raise ValueError(f"grad_outputs[{i}] has shape {tuple(g.shape)}, output {i} has {tuple(val.shape)}")
            return g
        if val.numel() != 1:
            raise ValueError(f"output {i} of shape {tuple(val.shape)} is not a scalar loss: pass grad_outputs=")
        return torch.ones((), dtype=val.dtype).reshape(val.shape)

    @property
    def training(self) -> bool:
        return bool(getattr(self.captured, "training", False))

    def output_roles(self) -> list[tuple]:
        """What each flat output is: ("output", i), ("grad_param", fqn) or ("grad_input", i)."""
        out = next(n for n in self.graph.graph.nodes if n.op == "output")
        return [tuple(r) for r in info(out).extra.get("outputs") or
                [("output", i) for i in range(len(self.output_specs))]]

    def simulate(self, *inputs, grad_outputs=None):
        """Run every rank in one process (exact collectives); returns the global outputs.

        Training programs return ``(outputs, grads)``: ``grads[fqn]`` is every parameter's global
        gradient (``grads["input:<i>"]`` for inputs that require grad).  A scalar output is seeded
        with 1; otherwise pass ``grad_outputs`` (one per differentiable output)."""
        if len(inputs) != self.captured.num_inputs:
            raise TypeError(f"this program takes {self.captured.num_inputs} inputs, got {len(inputs)}")
        if not self.training:
            return self.restructure(self.simulate_placeholders(self.placeholder_values(inputs)))
        flat = self.simulate_placeholders(self.placeholder_values(inputs, grad_outputs))
        return self.split_training_outputs(flat)

    def split_training_outputs(self, flat: list):
        outs, grads = [], {}
        for role, value in zip(self.output_roles(), flat):
            if role[0] == "output":
                outs.append(value)
            elif role[0] == "grad_param":
                grads[role[1]] = value
            elif role[0] == "grad_input":
                grads[f"input:{role[1]}"] = value
        spec = getattr(self.captured, "out_spec", None)
        if spec is not None and spec.num_leaves == len(outs):
            return torch.utils._pytree.tree_unflatten(outs, spec), grads
        structure = outs if len(outs) != 1 else outs[0]
        return (tuple(structure) if isinstance(structure, list) else structure), grads

    def simulate_placeholders(self, values) -> list:
        """Simulate on the global value of every placeholder (parameters included); flat outputs."""
        from .adapter import coordinate_tensor
        from .planner.execute import group_names
        from .simulate import SimulatedMesh

        unbound = self.local_graph  # lower outside the simulation (tracing must not see LocalTensorMode)
        with SimulatedMesh(self.mesh.shape, self.mesh.names) as sim:
            local = bind_groups(unbound, group_names(sim.device_mesh))
            args = [sim.distribute(v.detach(), info(p).spec) for p, v in zip(self.placeholders, values)]
            outs = local(coordinate_tensor(sim.device_mesh), *args)
            flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            return [sim.assemble(o, s) if s is not None else o for o, s in zip(flat, self.output_specs)]

    def restructure(self, flat: list):
        """Flat (forward) outputs in the structure the model returns (its pytree: dicts, tuples...)."""
        spec = getattr(self.captured, "out_spec", None)
        if spec is not None and spec.num_leaves == len(flat):
            return torch.utils._pytree.tree_unflatten(list(flat), spec)
        structure = next(n for n in self.graph.graph.nodes if n.op == "output").args[0]
        if isinstance(structure, (tuple, list)):
            return type(structure)(flat) if len(flat) > 1 else flat[0]
        return flat[0]

    def compile(self, device_mesh=None, *, inductor: bool = True):
        """This rank's program, compiled by Inductor (``inductor=False``: the per-rank graph run eagerly).

        Needs an initialised process group and a ``DeviceMesh`` of the program's shape (the one
        given to ``fxshard.shard``, or ``device_mesh``).  The result takes the global inputs (each
        rank slices its shard locally: no communication) and returns this rank's shard of every
        output (``.output_specs``); replicated outputs are the global values.  Parameters are sliced
        to local shards once, here."""
        from .backend import CompiledProgram, CompiledTraining

        dm = device_mesh if device_mesh is not None else self.device_mesh
        if dm is None:
            raise ValueError("ShardedProgram.compile needs a DeviceMesh: shard with one, or pass compile(device_mesh)")
        if self.training:  # fn(*inputs, grad_outputs=None) -> (outputs, {fqn: local gradient shard})
            return CompiledTraining(self, dm, inductor=inductor)
        return CompiledProgram(self, dm, inductor=inductor)

    def __repr__(self) -> str:
        kinds = {}
        for c in self.collectives():
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        return f"ShardedProgram(mesh={self.mesh.shape}, collectives={kinds})"
