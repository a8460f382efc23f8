"""``fxshard.shard``: capture -> annotate -> redistribute, returning a ShardedProgram."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn as nn

from .cost import CostModel
from .mesh import MeshSpec
from .passes.annotate import annotate
from .passes.capture import capture
from .passes.redistribute import insert_redistributes
from .plans import PlanConstraints, plan_dim, resolve_plan
from .program import ShardedProgram
from .report import log_program


def shard(model: nn.Module | Callable, mesh, plan: dict | None = None, *, example_inputs: Sequence,
          input_placements: Sequence | None = None, output_placements: Sequence | None = None,
          tp_dim: int | str | None = None, training: bool = False,
          cost_model: CostModel | None = None) -> ShardedProgram:
    """Shard ``model`` (an nn.Module or a plain callable) over ``mesh`` (MeshSpec or DeviceMesh).

    ``plan`` maps module FQNs (``*`` globs) to torch ParallelStyles or HF tp_plan strings and applies
    to the mesh dim named ``tp`` (or ``tp_dim``); other mesh dims are data parallel.  Plain callables
    take ``input_placements`` / ``output_placements``: one placements tuple per input / output.
    """
    if training:
        raise NotImplementedError("fxshard.shard(training=True): joint forward+backward sharding is not built "
                                  "yet; shard the forward (training=False)")
    device_mesh = None if isinstance(mesh, MeshSpec) else mesh
    mesh = MeshSpec.from_device_mesh(mesh)
    cm = cost_model or CostModel(mesh)
    if cm.mesh.shape != mesh.shape:
        raise ValueError(f"the cost model is for mesh {cm.mesh.shape}, the program for {mesh.shape}")
    if plan:
        constraints = resolve_plan(plan, model if isinstance(model, nn.Module) else None, mesh, tp_dim)
    else:
        constraints = PlanConstraints(dim=plan_dim(mesh, tp_dim) if (tp_dim is not None or mesh.ndim == 1
                                                                     or (mesh.names and "tp" in mesh.names))
                                      else None)
    for what, pls in (("input_placements", input_placements), ("output_placements", output_placements)):
        if pls is not None:
            for i, p in enumerate(pls):
                if p is not None and len(tuple(p)) != mesh.ndim:
                    raise ValueError(f"{what}[{i}] has {len(tuple(p))} placements for a {mesh.ndim}-D mesh "
                                     f"{mesh.shape}; give one placement per mesh dim")
    captured = capture(model, example_inputs, boundaries=constraints.hooked)
    warnings = annotate(captured.gm, mesh, constraints, cost_model=cm, input_placements=input_placements,
                        output_placements=output_placements)
    insert_redistributes(captured.gm, cm)
    prog = ShardedProgram(captured.gm, captured, mesh, cm, warnings, device_mesh)
    log_program(prog)
    return prog
