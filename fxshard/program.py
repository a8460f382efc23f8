"""ShardedProgram: what ``fxshard.shard`` returns and users hold."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .cost import CostModel
from .mesh import MeshSpec
from .passes.capture import BUFFER, CONSTANT, INPUT, PARAM, Captured, info
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


class ShardedProgram:
    def __init__(self, gm: fx.GraphModule, captured: Captured, mesh: MeshSpec, cost_model: CostModel,
                 warnings: list[str], device_mesh=None, after_lower=()):
        self.graph = gm
        self.captured = captured
        self.mesh = mesh
        self.cost_model = cost_model
        self.warnings = warnings
        self.device_mesh = device_mesh
        self._local = None
        self.after_lower = tuple(after_lower)
        self.bucketed = 0  # collectives removed by bucketing in the per-rank graph

    # ---- views ----------------------------------------------------------------------------------
    @property
    def local_graph(self) -> fx.GraphModule:
        """The per-rank graph (process groups named ``fxshard_mesh_dim_<m>`` until bound)."""
        if self._local is None:
            local = lower_to_local(self.graph, self.mesh.ndim)
            cap = getattr(self.captured, "bucket_bytes", 0)
            if cap:
                from .passes.fuse import bucket_collectives

                self.bucketed = bucket_collectives(local, cap)
            for fn in self.after_lower:
                fn(local, self)
                local.graph.lint()
                local.recompile()
            self._local = local
        return self._local

    def redistribute_nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.graph.nodes if info(n).kind == "redistribute"]

    def collectives(self) -> list[Collective]:
        out = []
        for n in self.redistribute_nodes():
            rec = info(n)
            plan = rec.plan
            for step, nbytes in plan.collective_bytes():
                where = f"{rec.module}: " if rec.module else ""
                out.append(Collective(step.collective, step.mesh_dims, nbytes, step.cost, n.name,
                                      f"{where}{rec.provenance}",
                                      f"{placements_str((step.src,))}->{placements_str((step.dst,))}"))
        return out

    def explain(self, verbose: bool = False, format: str = "text") -> str:
        """The plan as a table (``format="json"`` / ``"html"`` for tools and browsers)."""
        from .report import explain

        return explain(self, verbose=verbose, format=format)

    # ---- running ----------------------------------------------------------------------------------
    def placeholder_values(self, inputs) -> list:
        vals = []
        for p in self.graph.graph.nodes:
            if p.op != "placeholder":
                continue
            rec = info(p)
            if rec.kind in (PARAM, BUFFER, CONSTANT):
                vals.append(self.captured.state[rec.fqn])
            else:
                assert rec.kind == INPUT
                vals.append(inputs[rec.input_index])
        return vals

    def simulate(self, *inputs):
        """Run every rank in one process (exact collectives); returns the global outputs."""
        from .adapter import coordinate_tensor
        from .planner.execute import group_names
        from .simulate import SimulatedMesh

        if len(inputs) != self.captured.num_inputs:
            raise TypeError(f"this program takes {self.captured.num_inputs} inputs, got {len(inputs)}")
        unbound = self.local_graph  # lower outside the simulation (tracing must not see LocalTensorMode)
        with SimulatedMesh(self.mesh.shape, self.mesh.names) as sim:
            local = bind_groups(unbound, group_names(sim.device_mesh))
            args = []
            for p, v in zip([n for n in self.graph.graph.nodes if n.op == "placeholder"],
                            self.placeholder_values(inputs)):
                args.append(sim.distribute(v.detach(), info(p).spec))
            coord = coordinate_tensor(sim.device_mesh)
            outs = local(coord, *args)
            out_node = next(n for n in self.graph.graph.nodes if n.op == "output")
            specs = info(out_node).input_specs
            flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            results = [sim.assemble(o, s) if s is not None else o for o, s in zip(flat, specs)]
        structure = out_node.args[0]
        if isinstance(structure, (tuple, list)):
            return type(structure)(results) if len(results) > 1 else results[0]
        return results[0]

    def compile(self):
        raise NotImplementedError("ShardedProgram.compile (Inductor, real process groups) is not built yet; "
                                  "use simulate() to check a program on simulated ranks")

    def __repr__(self) -> str:
        kinds = {}
        for c in self.collectives():
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        return f"ShardedProgram(mesh={self.mesh.shape}, collectives={kinds})"
