"""The pipeline as public stages, and ``fxshard.shard`` as their composition.

    c = fxshard.capture(model, example_inputs, mesh=mesh, plan=plan)   # ATen graph + boundary markers
    fxshard.annotate(c)                                                # placements in node.meta["fxshard"]
    fxshard.set_placement(node, (Shard(0), Replicate()))               # optional hand edits
    fxshard.redistribute(c)                                            # explicit redistribute nodes
    prog = fxshard.program(c)                                          # ShardedProgram (lowers lazily)

Each stage reads and writes ``node.meta["fxshard"]`` (``fxshard.passes.capture.NodeInfo``: ``spec``,
``input_specs``, ``provenance``, ``plan`` ...).  User passes run at named points:
``after_annotate``, ``after_redistribute``, ``after_fuse`` (there is no fusion stage yet: it follows
``after_redistribute``) with ``fn(gm, captured)``, and ``after_lower`` with ``fn(local_gm, program)``.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Sequence

import torch.fx as fx
import torch.nn as nn

from .cost import CostModel
from .mesh import MeshSpec
from .passes import annotate as _annotate
from .passes.auto import AutoOptions, annotate_auto
from .passes.capture import Captured, capture_joint, info
from .passes.capture import capture as _capture
from .passes.redistribute import insert_redistributes
from .plans import PlanConstraints, resolve_plan
from .program import ShardedProgram
from .report import log_program
from .spec import ShardingSpec

PASS_POINTS = ("after_annotate", "after_redistribute", "after_fuse", "after_lower")


def _gc_paused(stage):
    """Run a stage with Python's cyclic garbage collector paused (restored after, no forced collect).

    The stages allocate hundreds of thousands of small objects (FX nodes, fake tensors, specs) next
    to long-lived ones (the model, earlier graphs); every gen-2 collection triggered meanwhile walks
    them all.  On the 32-layer LLaMA-3-8B capture + auto plan that is 0.6-0.7 s of ~5 s.  The garbage
    a stage leaves is collected by the next collection after it."""
    @functools.wraps(stage)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return stage(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return run


@_gc_paused
def capture(model: nn.Module | Callable, example_inputs: Sequence, *, mesh, plan: dict | None = None,
            tp_dim: int | str | None = None, cost_model=None, fuse: bool = True, training: bool = False,
            reuse_layers: bool | None = None) -> Captured:
    """Stage 1: trace to an ATen graph; module boundaries the plan names are marked.  ``training``:
    the joint forward+backward graph (outputs: the forward outputs, then the gradients).

    ``reuse_layers`` (training; default on): trace each repeated layer (equal-state children of a
    ModuleList) once and stitch copies of its joint graph in; the model's own code is still traced,
    and the result is the plain trace node for node.  ~7x faster capture of deep models; falls back
    to the plain trace where it does not apply (logged on ``fxshard.stitch``).  Layers of equal
    state are assumed to compute the same function of their tensors (``fxshard.passes.stitch``);
    ``False`` traces every layer."""
    device_mesh = None if isinstance(mesh, MeshSpec) else mesh
    mesh = MeshSpec.from_device_mesh(mesh)
    cm = cost_model or CostModel(mesh)
    if cm.mesh.shape != mesh.shape:
        raise ValueError(f"the cost model is for mesh {cm.mesh.shape}, the program for {mesh.shape}")
    constraints = resolve_plan(plan, model if isinstance(model, nn.Module) else None, mesh, tp_dim)
    if training:
        c = capture_joint(model, example_inputs, boundaries=constraints.hooked,
                          reuse_layers=reuse_layers is not False)
    else:
        c = _capture(model, example_inputs, boundaries=constraints.hooked)
    c.mesh, c.device_mesh, c.constraints, c.cost_model, c.fuse = mesh, device_mesh, constraints, cm, fuse
    return c


@_gc_paused
def annotate(captured: Captured, *, input_placements: Sequence | None = None,
             output_placements: Sequence | None = None, auto_options: AutoOptions | None = None) -> Captured:
    """Stage 2: a placement for every node (``node.meta["fxshard"].spec``) and its provenance.

    With ``plan="auto"`` (or a plan entry ``"*": "auto"``) every placement the plan does not fix is
    chosen by one global solve (``fxshard.passes.auto``); ``auto_options`` sets its memory budget.
    ``captured.auto`` then holds the solver's report."""
    mesh = captured.mesh
    for what, pls in (("input_placements", input_placements), ("output_placements", output_placements)):
        if pls is not None:
            for i, p in enumerate(pls):
                if p is not None and len(tuple(p)) != mesh.ndim:
                    raise ValueError(f"{what}[{i}] has {len(tuple(p))} placements for a {mesh.ndim}-D mesh "
                                     f"{mesh.shape}; give one placement per mesh dim")
    if captured.constraints.auto:
        captured.warnings, captured.auto = annotate_auto(
            captured.gm, mesh, captured.constraints, cost_model=captured.cost_model,
            options=auto_options or AutoOptions(), input_placements=input_placements,
            output_placements=output_placements, fuse=captured.fuse, blocks=captured.constraints.blocks,
            training=captured.training, replicate_grads=getattr(captured, "replicate_grads", False))
        captured.stage = "annotated"
        return captured
    if auto_options is not None:
        raise ValueError("auto_options applies to plan='auto' (or a plan with a '*': 'auto' entry)")
    captured.warnings = _annotate.annotate(captured.gm, mesh, captured.constraints, cost_model=captured.cost_model,
                                           input_placements=input_placements, output_placements=output_placements,
                                           batch_size=getattr(captured, "batch_size", None),
                                           replicate_grads=getattr(captured, "replicate_grads", False))
    # Placements are chosen with unfused costs and fusion is applied when the redistributions are
    # planned: each planned redistribution then costs at most its unfused plan, so a fused program is
    # never worse than the unfused one (greedy choices made on fused costs can be).
    captured.stage = "annotated"
    return captured


def set_placement(node: fx.Node, placements: Sequence, *, cost_model=None) -> None:
    """Force a node's output placements between ``annotate`` and ``redistribute``.

    The node takes the cheapest strategy its sharding rule allows with exactly that output (its
    inputs are redistributed as needed); consumers keep what they asked for, so ``redistribute``
    inserts whatever the change costs.  Raises if the rule allows no such strategy."""
    rec = info(node)
    if rec.spec is None:
        raise ValueError(f"set_placement({node.name}): annotate the graph first")
    if rec.kind == "redistribute":
        raise ValueError(f"set_placement({node.name}): redistribute nodes are placed by their plan; edit the "
                         f"producer or consumer instead (or set placements before redistribute)")
    mesh = (rec.spec[0] if isinstance(rec.spec, tuple) else rec.spec).mesh
    want = ShardingSpec.make(mesh, placements, tuple(node.meta["val"].shape), node.meta["val"].dtype,
                             what=f"set_placement({node.name})")
    if node.op == "placeholder" or rec.kind == "boundary":
        rec.spec = want
        if rec.kind == "boundary":
            rec.input_specs = (want,)
        rec.provenance = "set_placement"
        return
    ann = _annotate.Annotator(mesh, cost_model or CostModel(mesh), PlanConstraints(dim=None), None, None)
    targs = _annotate.tensor_args(node)
    cur = [info(a).spec for a in targs]
    best = None
    for ins, outs in ann.candidates(node, cur) or []:
        if not outs or outs[0] is None or tuple(_annotate._normalize(p, len(want.shape)) for p in outs[0]) \
                != want.placements:
            continue
        specs = ann._specs_for(ins, targs, cur)
        if specs is None:
            continue
        c = sum(ann.cost(a, b) for a, b in zip(cur, specs))
        if best is None or c < best[0]:
            best = (c, specs)
    if best is None:
        raise ValueError(f"set_placement({node.name}): the sharding rule of {node.target} allows no strategy with "
                         f"output {want}")
    rec.input_specs, rec.spec, rec.provenance = best[1], want, "set_placement"


@_gc_paused
def redistribute(captured: Captured) -> Captured:
    """Stage 3: explicit redistribute nodes wherever a consumer needs other placements."""
    if captured.stage != "annotated":
        raise ValueError(f"redistribute: expected an annotated program, got one that is {captured.stage}")
    insert_redistributes(captured.gm, captured.cost_model, fuse=captured.fuse)
    captured.stage = "redistributed"
    return captured


@_gc_paused
def program(captured: Captured, *, after_lower: Sequence[Callable] = ()) -> ShardedProgram:
    """The ShardedProgram of a redistributed graph (it lowers to the per-rank graph on demand)."""
    if captured.stage != "redistributed":
        raise ValueError(f"program: expected a redistributed program, got one that is {captured.stage}")
    prog = ShardedProgram(captured.gm, captured, captured.mesh, captured.cost_model, captured.warnings,
                          captured.device_mesh, after_lower=tuple(after_lower))
    log_program(prog)
    return prog


def lower(captured_or_program) -> fx.GraphModule:
    """Stage 4: the per-rank graph (local shapes, functional collectives, coordinate input)."""
    prog = captured_or_program if isinstance(captured_or_program, ShardedProgram) else program(captured_or_program)
    return prog.local_graph


def _passes_at(passes, point):
    out = []
    for p in passes or ():
        stage, fn = (p if isinstance(p, tuple) else (getattr(p, "stage", None), p))
        if point is None:
            if stage not in PASS_POINTS:
                raise ValueError(f"pass {fn!r}: stage {stage!r} is not one of {PASS_POINTS} (give (stage, fn) "
                                 f"or set fn.stage)")
            continue
        if stage not in PASS_POINTS:
            raise ValueError(f"pass {fn!r}: stage {stage!r} is not one of {PASS_POINTS} (give (stage, fn) or set "
                             f"fn.stage)")
        if stage == point:
            out.append(fn)
    return out


def shard(model: nn.Module | Callable, mesh, plan: dict | None = None, *, example_inputs: Sequence,
          input_placements: Sequence | None = None, output_placements: Sequence | None = None,
          tp_dim: int | str | None = None, training: bool = False, cost_model=None,
          passes: Sequence | None = None, fuse: bool = True,
          bucket_bytes: int = 25 * 1024 * 1024, auto_options: AutoOptions | None = None,
          reuse_layers: bool | None = None) -> ShardedProgram:
    """Shard ``model`` (an nn.Module or a plain callable) over ``mesh`` (MeshSpec or DeviceMesh).

    ``plan`` maps module FQNs (``*`` globs) to torch ParallelStyles or HF tp_plan strings and applies
    to the mesh dim named ``tp`` (or ``tp_dim``); other mesh dims are data parallel.  ``plan="auto"``
    chooses every placement by a global solve (``auto_options``: memory budget and more); a plan
    with an entry ``"*": "auto"`` fixes its other entries and solves for the rest.  Plain callables
    take ``input_placements`` / ``output_placements``: one placements tuple per input / output.
    ``passes``: ``(stage, fn)`` pairs (or functions with a ``stage`` attribute) run at the named
    points of the pipeline (see ``PASS_POINTS``).  ``fuse``: let the planner use one collective over
    several mesh dims (a flattened group) where that is cheaper; ``bucket_bytes``: merge independent
    collectives of one kind and group in the per-rank graph up to this many bytes (0: off).
    ``reuse_layers`` (training, default on): trace each repeated layer once (see ``capture``).
    """
    for p in passes or ():
        _passes_at([p], None)  # validate every pass up front
    c = capture(model, example_inputs, mesh=mesh, plan=plan, tp_dim=tp_dim, cost_model=cost_model, fuse=fuse,
                training=training, reuse_layers=reuse_layers)
    c.bucket_bytes = bucket_bytes
    annotate(c, input_placements=input_placements, output_placements=output_placements, auto_options=auto_options)
    for fn in _passes_at(passes, "after_annotate"):
        fn(c.gm, c)
    redistribute(c)
    for point in ("after_redistribute", "after_fuse"):
        for fn in _passes_at(passes, point):
            fn(c.gm, c)
            c.gm.graph.lint()
            c.gm.recompile()
    return program(c, after_lower=_passes_at(passes, "after_lower"))


__all__ = ["capture", "annotate", "set_placement", "redistribute", "program", "lower", "shard", "PASS_POINTS"]
