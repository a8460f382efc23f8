"""The pipeline as public stages, and ``fxshard.shard`` as their composition.

    c = fxshard.capture(model, example_inputs, mesh=mesh, plan=plan)  # ATen graph + markers
    fxshard.annotate(c)                                  # placements in node.meta["fxshard"]
    fxshard.set_placement(node, (Shard(0), Replicate()))  # optional hand edits
    fxshard.redistribute(c)                              # explicit redistribute nodes
    prog = fxshard.program(c)                            # ShardedProgram
    prog.local_graph                                     # lowered, then bucketed, on first use

Each stage reads and writes ``node.meta["fxshard"]`` (``fxshard.ir.NodeInfo``: ``spec``,
``input_specs``, ``provenance``, ``plan`` ...).  This module is the only place the stages are
composed: ``shard`` (models and callables), ``shard_dynamo_graph`` (the ``torch.compile``
backend); ``fxshard.parallelize`` calls ``shard``.  User passes run at named points:
``after_annotate`` and ``after_redistribute`` with ``fn(gm, captured)`` on the global graph,
``after_lower`` and ``after_bucket`` with ``fn(local_gm, program)`` on the per-rank graph.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from .capture import Captured, capture_dynamo_graph, capture_forward, capture_joint
from .capture.common import ModelSnapshot
from .capture.regions import expert_regions, region_forwards
from .core.config import DEFAULT_BUCKET_BYTES, DEFAULT_SEARCH, ShardConfig
from .core.cost import CostModel, CostModelLike
from .core.mesh import MeshSpec
from .core.spec import ShardingSpec
from .ir import (
    AS_EAGER,
    INPUT,
    KEPT_STATE,
    OWN_PLACEMENT,
    NodeKind,
    eager_dtensor_outputs,
    info,
    output_roles,
)
from .passes.redistribute import insert_redistributes
from .placement import greedy
from .placement.auto import AutoInfeasible, AutoOptions, annotate_auto
from .placement.constraints import PlanConstraints, resolve_plan
from .placement.problem import PlacementProblem
from .report import log_program
from .runtime.program import ShardedProgram

log = logging.getLogger("fxshard")

PASS_POINTS = ("after_annotate", "after_redistribute", "after_lower", "after_bucket")
_RENAMED_POINTS = {"after_fuse": "after_bucket"}  # deprecated name -> point


def _gc_paused(stage):
    """Run a stage with Python's cyclic garbage collector paused (restored after, no forced
    collect).

    The stages allocate hundreds of thousands of small objects (FX nodes, fake tensors, specs) next
    to long-lived ones (the model, earlier graphs); every gen-2 collection triggered meanwhile walks
    them all.  On the 32-layer LLaMA-3-8B capture + auto plan that is 0.6-0.7 s of ~5 s.  The
    garbage a stage leaves is collected by the next collection after it."""

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


def _multi_dim(multi_dim_collectives: bool, fuse: bool | None) -> bool:
    if fuse is None:
        return multi_dim_collectives
    warnings.warn(
        "fuse= is deprecated: it is called multi_dim_collectives= (one collective over several "
        "mesh "
        "dims where that is cheaper)",
        DeprecationWarning,
        stacklevel=3,
    )
    return bool(fuse)


@_gc_paused
def capture(
    model: nn.Module | Callable,
    example_inputs: Sequence,
    *,
    mesh: MeshSpec | DeviceMesh,
    plan: dict | str | None = None,
    tp_dim: int | str | None = None,
    cost_model: CostModelLike | None = None,
    multi_dim_collectives: bool = True,
    fuse: bool | None = None,
    training: bool = False,
    reuse_layers: bool | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    search: str = DEFAULT_SEARCH,
) -> Captured:
    """Stage 1: trace to an ATen graph; module boundaries the plan names are marked.  ``training``:
    the joint forward+backward graph (outputs: the forward outputs, then the gradients).

    ``reuse_layers`` (training; default on): trace each repeated layer (equal-state children of a
    container) once and stitch copies of its joint graph in; the model's own code is still traced,
    and the result is the plain trace node for node.  ~7x faster capture of deep models; falls back
    to the plain trace where it does not apply (logged on ``fxshard.stitch``).  Layers of equal
    state are assumed to compute the same function of their tensors (``fxshard.capture.stitch``);
    ``False`` traces every layer."""
    config = ShardConfig.make(
        mesh,
        cost_model=cost_model,
        multi_dim_collectives=_multi_dim(multi_dim_collectives, fuse),
        bucket_bytes=bucket_bytes,
        search=search,
    )
    constraints = resolve_plan(
        plan, model if isinstance(model, nn.Module) else None, config.mesh, tp_dim
    )
    if training:
        with region_forwards(constraints.experts, config.mesh.shape):
            c = capture_joint(
                model,
                example_inputs,
                boundaries=constraints.hooked,
                reuse_layers=reuse_layers is not False,
            )
    else:
        c = capture_forward(model, example_inputs, boundaries=constraints.hooked)
    snapshot = ModelSnapshot.of(model) if isinstance(model, nn.Module) else None
    c = dataclasses.replace(c, config=config, constraints=constraints, snapshot=snapshot)
    _form_regions(c)
    return c


def _form_regions(c: Captured) -> None:
    """Experts modules the plan splits by experts become one op each (forward captures: expert
    parallelism by token dispatch, ``capture.regions``)."""
    experts = getattr(c.constraints, "experts", None)
    if not experts or c.training:
        return
    shape = c.config.mesh.shape
    done = expert_regions(c.gm, experts, shape)
    if c.symbolic is not None and done:
        twin = expert_regions(c.symbolic.gm, {f: experts[f] for f in done}, shape)
        if twin != done:  # the hinted graph stands for the symbolic one node for node
            raise RuntimeError(
                f"fxshard: experts regions {done} formed in the hinted graph but {twin} in the "
                "symbolic one; pass dynamic=False (a program per size)"
            )


def _check_placements(mesh, input_placements, output_placements) -> None:
    for what, pls in (
        ("input_placements", input_placements),
        ("output_placements", output_placements),
    ):
        if pls is not None:
            for i, p in enumerate(pls):
                if p is None or p in (KEPT_STATE, OWN_PLACEMENT) or isinstance(p, ShardingSpec):
                    continue
                if len(tuple(p)) != mesh.ndim:
                    raise ValueError(
                        f"{what}[{i}] has {len(tuple(p))} placements for a {mesh.ndim}-D mesh "
                        f"{mesh.shape}; give one placement per mesh dim"
                    )


@_gc_paused
def annotate(
    captured: Captured,
    *,
    input_placements: Sequence | None = None,
    output_placements: Sequence | None = None,
    auto_options: AutoOptions | None = None,
) -> Captured:
    """Stage 2: a placement for every node (``node.meta["fxshard"].spec``) and its provenance.

    The placements a plan does not fix are chosen by one global solve (``fxshard.placement.auto``):
    with ``plan="auto"`` (or a plan entry ``"*": "auto"``) every placement the plan does not fix,
    parameters and inputs included (``auto_options`` sets its memory budget); with any other plan
    (the default ``search="global"``), every op's placement, the plan's parameters, inputs and
    module boundaries fixed.  ``captured.auto`` then holds the solver's report.  With
    ``search="greedy"`` each node takes the cheapest of its legal states given its inputs, in graph
    order (``fxshard.placement.greedy``: DTensor's op-by-op choice).  A global solve that finds no
    finite plan (a boundary no redistribution reaches) falls back to the greedy one, logged."""
    config, cons = captured.config, captured.constraints
    if callable(output_placements):  # decided from the capture (fxshard.parallelize)
        output_placements = output_placements(captured)
    if isinstance(output_placements, str):
        if output_placements != "replicate":
            raise ValueError(
                f"output_placements={output_placements!r}: a list (one placements tuple or None "
                "per output) or 'replicate' (every output global)"
            )
        output = next(n for n in reversed(captured.gm.graph.nodes) if n.op == "output")
        count = sum(r.kind == "output" for r in output_roles(output))
        output_placements = [(Replicate(),) * config.mesh.ndim] * count
    _check_placements(config.mesh, input_placements, output_placements)
    if not cons.auto and auto_options is not None:
        raise ValueError("auto_options applies to plan='auto' (or a plan with a '*': 'auto' entry)")
    auto_options = _auto_options(auto_options)

    def problem_for(multi_dim: bool) -> PlacementProblem:
        return PlacementProblem(
            config.mesh,
            config.cost_model,
            cons,
            input_placements=input_placements,
            output_placements=output_placements,
            multi_dim=multi_dim,
            batch_size=config.batch_size,
            replicate_grads=config.replicate_grads,
            training=captured.training,
        )

    # The greedy choices are made on unfused costs and fusion is applied when the redistributions
    # are planned: each planned redistribution then costs at most its unfused plan, so a fused
    # program is never worse than the unfused one (greedy choices made on fused costs can be).
    # A global solve prices fused collectives itself.
    if cons.auto:
        captured.warnings, captured.auto = annotate_auto(
            captured.gm,
            problem_for(config.multi_dim_collectives),
            options=auto_options or AutoOptions(),
            blocks=cons.blocks,
            training=captured.training,
        )
    else:
        problem = problem_for(False)
        captured.warnings = greedy.annotate(captured.gm, problem)
        if config.search == "global":
            # the global solve starts from the greedy plan and searches around it
            problem.multi_dim = config.multi_dim_collectives
            try:
                captured.warnings, captured.auto = annotate_auto(
                    captured.gm,
                    problem,
                    # "follow" keeps one state per input placement, the cheapest to compute, and
                    # can drop the greedy one: the search would no longer contain the greedy plan
                    options=AutoOptions(follow=False),
                    training=captured.training,
                    anchored=True,
                )
            except AutoInfeasible as e:  # the greedy annotation is still in place
                log.info("fxshard: the global placement solve found no plan (%s); greedy kept", e)
    captured.stage = "annotated"
    return captured


def set_placement(
    node: fx.Node, placements: Sequence, *, cost_model: CostModelLike | None = None
) -> None:
    """Force a node's output placements between ``annotate`` and ``redistribute``.

    The node takes the cheapest state its sharding rule allows with exactly that output (its
    inputs are redistributed as needed); consumers keep what they asked for, so ``redistribute``
    inserts whatever the change costs.  Raises if the rule allows no such state."""
    rec = info(node)
    if rec.spec is None:
        raise ValueError(f"set_placement({node.name}): annotate the graph first")
    if rec.kind == NodeKind.REDISTRIBUTE:
        raise ValueError(
            f"set_placement({node.name}): redistribute nodes are placed by their plan; edit the "
            f"producer or consumer instead (or set placements before redistribute)"
        )
    mesh = (rec.spec[0] if isinstance(rec.spec, tuple) else rec.spec).mesh
    problem = PlacementProblem(mesh, cost_model or CostModel(mesh), PlanConstraints(dim=None))
    greedy.set_placement(node, placements, problem)


@_gc_paused
def redistribute(captured: Captured) -> Captured:
    """Stage 3: explicit redistribute nodes wherever a consumer needs other placements."""
    if captured.stage != "annotated":
        raise ValueError(
            f"redistribute: expected an annotated program, got one that is {captured.stage}"
        )
    insert_redistributes(
        captured.gm, captured.config.cost_model, fuse=captured.config.multi_dim_collectives
    )
    captured.stage = "redistributed"
    return captured


@_gc_paused
def program(
    captured: Captured,
    *,
    after_lower: Sequence[Callable] = (),
    after_bucket: Sequence[Callable] = (),
) -> ShardedProgram:
    """The ShardedProgram of a redistributed graph.  Its per-rank graph is built on first use:
    lowered (stage 4), ``after_lower`` passes, bucketed (stage 5), ``after_bucket`` passes."""
    if captured.stage != "redistributed":
        raise ValueError(
            f"program: expected a redistributed program, got one that is {captured.stage}"
        )
    prog = ShardedProgram(captured, after_lower=after_lower, after_bucket=after_bucket)
    log_program(prog)
    return prog


def lower(captured_or_program: Captured | ShardedProgram) -> fx.GraphModule:
    """Stages 4-5: the per-rank graph (local shapes, functional collectives, coordinate input,
    bucketed)."""
    prog = (
        captured_or_program
        if isinstance(captured_or_program, ShardedProgram)
        else program(captured_or_program)
    )
    return prog.local_graph


def _point(stage) -> str:
    if stage in _RENAMED_POINTS:
        warnings.warn(
            f"pass point {stage!r} is deprecated: its passes run at {_RENAMED_POINTS[stage]!r}, on "
            "the "
            f"bucketed per-rank graph (fn(local_gm, program)); for the global graph use "
            f"'after_redistribute'",
            DeprecationWarning,
            stacklevel=4,
        )
        return _RENAMED_POINTS[stage]
    return stage


def _passes_by_point(passes) -> dict[str, list[Callable]]:
    """{point: [fn, ...]} of ``(point, fn)`` pairs or functions with a ``stage`` attribute; every
    pass validated up front."""
    out: dict[str, list[Callable]] = {p: [] for p in PASS_POINTS}
    for p in passes or ():
        stage, fn = p if isinstance(p, tuple) else (getattr(p, "stage", None), p)
        stage = _point(stage)
        if stage not in PASS_POINTS:
            raise ValueError(
                f"pass {fn!r}: stage {stage!r} is not one of {PASS_POINTS} (give (stage, fn) or "
                "set "
                f"fn.stage)"
            )
        out[stage].append(fn)
    return out


def shard(
    model: nn.Module | Callable,
    mesh: MeshSpec | DeviceMesh,
    plan: dict | str | None = None,
    *,
    example_inputs: Sequence,
    input_placements: Sequence | None = None,
    output_placements: Sequence | None = None,
    tp_dim: int | str | None = None,
    training: bool = False,
    cost_model: CostModelLike | None = None,
    passes: Sequence | None = None,
    multi_dim_collectives: bool = True,
    fuse: bool | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    auto_options: AutoOptions | None = None,
    reuse_layers: bool | None = None,
    search: str = DEFAULT_SEARCH,
) -> ShardedProgram:
    """Shard ``model`` (an nn.Module or a plain callable) over ``mesh`` (MeshSpec or DeviceMesh).

    ``plan`` maps module FQNs (``*`` globs) to torch ParallelStyles or HF tp_plan strings and
    applies to the mesh dim named ``tp`` (or ``tp_dim``); other mesh dims are data parallel.
    ``plan="auto"`` chooses every placement by a global solve (``auto_options``: memory budget and
    more); a plan with an entry ``"*": "auto"`` fixes its other entries and solves for the rest.
    Plain callables take ``input_placements`` / ``output_placements``: one placements tuple per
    input / output (``output_placements="replicate"``: every output global).
    ``passes``: ``(point, fn)`` pairs (or functions with a ``stage`` attribute) run at the named
    points of the pipeline (see ``PASS_POINTS``).  ``multi_dim_collectives``: let the planner use
    one collective over several mesh dims (a flattened group) where that is cheaper (``fuse`` is
    its old name); ``bucket_bytes``: merge independent collectives of one kind and group in the
    per-rank graph up to this many bytes (0: off).  ``reuse_layers`` (training, default on): trace
    each repeated layer once (see ``capture``).  ``search``: how the placements the plan leaves
    free are chosen, ``"global"`` (one solve over the graph) or ``"greedy"`` (node by node; see
    ``annotate``).
    """
    if isinstance(example_inputs, torch.Tensor):  # one input: a tuple of one
        example_inputs = (example_inputs,)
    by_point = _passes_by_point(passes)
    c = capture(
        model,
        example_inputs,
        mesh=mesh,
        plan=plan,
        tp_dim=tp_dim,
        cost_model=cost_model,
        multi_dim_collectives=_multi_dim(multi_dim_collectives, fuse),
        training=training,
        reuse_layers=reuse_layers,
        bucket_bytes=bucket_bytes,
        search=search,
    )
    annotate(
        c,
        input_placements=input_placements,
        output_placements=output_placements,
        auto_options=auto_options,
    )
    for fn in by_point["after_annotate"]:
        fn(c.gm, c)
    redistribute(c)
    for fn in by_point["after_redistribute"]:
        fn(c.gm, c)
        c.gm.graph.lint()
        c.gm.recompile()
    return program(c, after_lower=by_point["after_lower"], after_bucket=by_point["after_bucket"])


def _auto_options(options) -> AutoOptions | None:
    """``AutoOptions``, or a dict of its fields."""
    if options is None or isinstance(options, AutoOptions):
        return options
    if isinstance(options, dict):
        import dataclasses

        known = {f.name for f in dataclasses.fields(AutoOptions)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(
                f"auto_options: unknown field(s) {unknown}; AutoOptions has {sorted(known)}"
            )
        return AutoOptions(**options)
    raise TypeError(
        f"auto_options must be fxshard.AutoOptions(...) (or a dict of its fields), got "
        f"{type(options).__name__}"
    )


def _as_eager(c: Captured, k: int):
    """Output ``k``'s placements where the backend hands back what eager would: replicated (a
    plain global tensor); a DTensor's, where eager returns one: the placement of the plan boundary
    it leaves (``use_local_output=False``), else the program's own (None; replicated under
    autograd, whose incoming gradient needs a placement before the program is planned)."""
    ndim = c.config.mesh.ndim
    eager = c.dtensor_outputs[k] if k < len(c.dtensor_outputs) else False
    if isinstance(eager, str) and eager in c.constraints.boundaries:
        placements = [Replicate()] * ndim
        placements[c.constraints.dim] = c.constraints.boundaries[eager][0]
        return tuple(placements)
    return None if eager else (Replicate(),) * ndim


def shard_dynamo_graph(
    gm: fx.GraphModule,
    args: Sequence,
    config: ShardConfig,
    constraints: PlanConstraints,
    *,
    roots: dict | None = None,
    sources: Sequence | None = None,
    training: bool = False,
    num_outputs: int = 1,
    output_placements: Sequence | None = None,
    arg_specs: dict | None = None,
    kept_state: frozenset = frozenset(),
    auto_options: AutoOptions | None = None,
    dynamic=None,
    dtensor_args: frozenset = frozenset(),
) -> ShardedProgram:
    """A dynamo graph sharded for this call's arguments (the ``torch.compile`` backend): captured
    (the joint forward+backward under autograd), annotated, redistributed.  Outputs are handed back
    replicated (the global values) unless ``output_placements`` says otherwise per output (None:
    the program's own placement, reduced); ``arg_specs`` ({argument index: ShardingSpec}) fixes the
    placements of DTensor arguments (user inputs only); ``kept_state`` (argument indices): plain
    inputs that, where the graph updates them in place, come back placed as the program takes them
    (state kept sharded between calls) rather than replicated; ``dtensor_args`` (argument
    indices): the DTensor arguments (not KeptTensors), which make the outputs derived from them
    DTensors where the backend hands back what eager would.  ``dynamic``
    (``capture.symbolic.DynamicDims``): one program for every size of those dims."""
    c = capture_dynamo_graph(
        gm,
        args,
        constraints.hooked,
        roots,
        sources,
        training=training,
        dynamic=dynamic,
        experts=constraints.experts,
        mesh_shape=config.mesh.shape,
    )
    c = dataclasses.replace(c, config=config, constraints=constraints)
    _form_regions(c)
    if output_placements is None:
        output_placements = [(Replicate(),) * config.mesh.ndim] * num_outputs
    c.dtensor_outputs = eager_dtensor_outputs(c.gm, set(dtensor_args), constraints.eager_types)
    output_placements = [
        _as_eager(c, k) if p is AS_EAGER else p for k, p in enumerate(output_placements)
    ]
    input_placements = None
    if arg_specs or kept_state:
        input_placements = [None] * c.num_inputs
        for p in c.gm.graph.nodes:
            if p.op != "placeholder":
                continue
            rec = info(p)
            if rec.kind == INPUT and rec.arg_index in kept_state:
                input_placements[rec.input_index] = KEPT_STATE
            if rec.arg_index not in (arg_specs or {}):
                continue
            if rec.kind != INPUT:
                raise NotImplementedError(
                    f"fxshard backend: argument {rec.arg_index} ({rec.fqn}) is a DTensor "
                    f"{rec.kind}: the backend shards plain parameters by its plan; compile a model "
                    "with plain parameters (or use fxshard.parallelize, whose parameters are "
                    "DTensors)"
                )
            input_placements[rec.input_index] = arg_specs[rec.arg_index]
    annotate(
        c,
        input_placements=input_placements,
        output_placements=output_placements,
        auto_options=auto_options if constraints.auto else None,
    )
    redistribute(c)
    return program(c)


__all__ = [
    "capture",
    "annotate",
    "set_placement",
    "redistribute",
    "program",
    "lower",
    "shard",
    "shard_dynamo_graph",
    "PASS_POINTS",
]
