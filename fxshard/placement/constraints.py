"""User plans -> placement constraints.

A plan maps module FQNs (``*`` matches one path component, as in ``parallelize_module``) to torch
``ParallelStyle`` objects or Hugging Face ``tp_plan`` strings.  It says three things, all on the
plan's mesh dim (``tp`` by default; other mesh dims are data parallel):

* parameter placements (Colwise: weight/bias Shard(0), embedding Shard(1); Rowwise: weight Shard(1),
  bias Replicate, embedding Shard(0); SequenceParallel: Replicate);
* the placement a module's inputs must have when the module consumes them
(``desired_input_layouts``);
* the placement a module's outputs are handed on in (``output_layouts``).

The graph keeps global semantics, so ``input_layouts`` (how torch would *reinterpret* a local
tensor) is only used where fxshard decides a placement itself: for graph inputs.  Module boundaries
are marked in the captured graph by ``fxshard::boundary`` nodes (forward hooks during capture); a
constraint applies to a boundary node by its tag ``"<module fqn>:in:<i>"`` / ``":out:<i>"``.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from .._torch import StridedShard
from ..capture.layers import layer_groups
from ..core.mesh import MeshSpec
from ..rules.experts import experts_module

log = logging.getLogger("fxshard")


@dataclass
class PlanConstraints:
    """Placements on the plan's mesh dim (``dim``), with the plan entry that asked for each."""

    dim: int | None
    # fqn -> (placement, provenance)
    params: dict[str, tuple[object, str]] = field(default_factory=dict)
    # tag -> (placement, provenance)
    boundaries: dict[str, tuple[object, str]] = field(default_factory=dict)
    # "<module>:in:<i>" -> input_layouts
    input_hints: dict[str, object] = field(default_factory=dict)
    # module fqn -> (#inputs, #outputs) to mark
    hooked: dict[str, tuple[int, int]] = field(default_factory=dict)
    auto: bool = False  # plan="auto": every placement not fixed here is chosen by the global solver
    # repeated layers (auto shares their decisions)
    blocks: list[list[str]] = field(default_factory=list)
    # experts modules whose weights the plan splits by experts ({FQN: module}): a forward capture
    # makes each one region (``capture.regions``: expert parallelism by token dispatch)
    experts: dict = field(default_factory=dict)
    # boundary tag -> what eager torch hands on there: "dtensor" (a style that makes its values
    # DTensors: ColwiseParallel's input, use_local_output=False) or "local" (to_local(): every
    # use_local_output=True, every transformers style); the compiled call returns a DTensor where
    # eager would (``ir.eager_dtensor_outputs``)
    eager_types: dict[str, str] = field(default_factory=dict)


# transformers' tp_plan style strings (its ParallelInterface) as fxshard's placements.  fxshard runs
# the global program, so a style only pins placements: gradients of replicated parameters are
# whole by construction (replicated_with_grad_allreduce is "replicate"), and an output the style
# all-reduces is asked for replicated at the module's boundary.
HF_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "sequence_parallel": lambda: SequenceParallel(),
    "replicate": lambda: "replicate",
    "replicated_with_grad_allreduce": lambda: "replicate",
    "packed_colwise": lambda: "packed_colwise",
    "packed_rowwise": lambda: "packed_rowwise",
    "all_reduce": lambda: PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate()
    ),
    # fused 3-D experts whose weights the plan shards by parameter entries (packed_colwise
    # gate_up_proj, rowwise down_proj; grouped_gemm: whole experts per rank, expert parallelism):
    # tokens and routing in replicated, the summed output out
    "moe_tp_experts": lambda: "moe_tp_experts",
    # the router of an expert-parallel plan: transformers masks each rank's routing to its own
    # experts; the global program routes every token as single device does (the experts' grouped
    # matmuls compute only a rank's experts), so the router is an ordinary replicated layer
    "ep_router": lambda: "replicate",
    "grouped_gemm": lambda: "grouped_gemm",  # (a parameter style: experts' weights, dim 0)
    # transformers 5.25's styles.  An embedding split along its hidden dim, its rows gathered:
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    # whole heads per rank on a "unit" mesh (heads replicated where ranks outnumber them): the
    # weights split along their head dim; fxshard places the attention between them itself
    "unit_colwise": lambda: ColwiseParallel(),
    "unit_rowwise": lambda: RowwiseParallel(),
    # MLA's kv_a_proj: a replicated layer whose output is split into a part that goes through a
    # colwise layer and one that does not; the style only all-reduces the second part's gradient,
    # which the global program has whole by construction
    "mla_kv_a_proj": lambda: "replicate",
    # runs a module on its parameters' local shards; the parameters' own entries place them, and
    # the global program computes the module as it is: nothing to pin
    "local_params": lambda: "local_params",
    # whole experts per rank, tokens dispatched to them (the grouped_gemm entries split the
    # weights): the experts region of capture, whose rule offers the dispatch
    "ep_dispatch_experts": lambda: "ep_dispatch_experts",
}

# styles whose layers fxshard has no rules for yet, and what each would need
HF_STYLES_NOT_YET = {
    "megamoe_router": "MegaMoE routing (data-dependent token dispatch)",
    "megamoe_experts": "MegaMoE experts (grouped_mm rules)",
    "moe_identity_expert": "MoE identity experts (expert routing)",
}


# plan="auto", or a plan entry {"*": "auto"} next to fixed entries: the solver picks the rest
AUTO = "auto"


def plan_dim(mesh: MeshSpec, tp_dim: int | str | None) -> int:
    if tp_dim is not None:
        return mesh.dim_index(tp_dim)
    if mesh.ndim == 1:
        return 0
    if mesh.names is None:
        raise ValueError(
            f"a plan for a {mesh.ndim}-D mesh {mesh.shape} needs named mesh dims (e.g. "
            "names=('dp', 'tp')) "
            f"or tp_dim=<index> to say which mesh dim the plan applies to"
        )
    if "tp" not in mesh.names:
        raise ValueError(
            f"the plan applies to the mesh dim named 'tp', but the mesh dims are {mesh.names}; "
            f"pass tp_dim=<name>"
        )
    return mesh.names.index("tp")


def _match(pattern: str, fqn: str) -> bool:
    a, b = pattern.split("."), fqn.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(y, x) for x, y in zip(a, b))


def resolve_plan(
    plan: dict | str | None,
    model: nn.Module | None,
    mesh: MeshSpec,
    tp_dim: int | str | None = None,
) -> PlanConstraints:
    """The constraints of ``plan`` on ``model``.  Without a plan: none, but the plan dim is still
    known where it can be (``tp_dim``, a 1-D mesh, a dim named ``tp``): inputs are then
    batch-sharded on the other (data-parallel) dims."""
    if plan is not None and not isinstance(plan, (dict, str)):
        raise TypeError(
            f"plan must be a dict of module FQN -> ParallelStyle or tp_plan string (e.g. "
            f'{{"fc1": ColwiseParallel(), "fc2": "rowwise"}}), "auto", or None; got '
            f"{type(plan).__name__}"
        )
    if isinstance(plan, str):
        if plan != AUTO:
            raise ValueError(
                f"plan={plan!r}: a plan is a dict of module FQN -> ParallelStyle, or {AUTO!r}"
            )
        plan = {"*": AUTO}
    if isinstance(plan, dict) and any(isinstance(s, str) and s == AUTO for s in plan.values()):
        rest = {k: s for k, s in plan.items() if not (isinstance(s, str) and s == AUTO)}
        out = resolve_plan(rest, model, mesh, tp_dim)
        if rest and out.dim is None:
            out.dim = plan_dim(mesh, tp_dim)
        out.auto = True
        out.blocks = [[fqn for fqn, _ in g] for g in layer_groups(model)]
        for group in out.blocks:
            for (
                fqn
            ) in group:  # mark every layer's inputs and output: its nodes are what lies between
                a, b = out.hooked.get(fqn, (0, 0))
                out.hooked[fqn] = (max(a, 16), max(b, 1))
        return out
    if not plan:
        default_dim = (
            tp_dim is not None or mesh.ndim == 1 or bool(mesh.names and "tp" in mesh.names)
        )
        return PlanConstraints(dim=plan_dim(mesh, tp_dim) if default_dim else None)
    if model is None:
        raise ValueError(
            "a module plan needs an nn.Module; for a plain callable pass input_placements / "
            "output_placements instead"
        )
    dim = plan_dim(mesh, tp_dim)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    # a transformers model's own plans (its tp_plan, its expert-parallel plan) cover every variant
    # of its architecture (dense and MoE layers, attention and linear-attention layers): as
    # transformers does, their entries that match nothing in this model are skipped, also where
    # the model sits inside a user's module and the plan names its entries under its FQN
    own = _own_entries(model, plan)
    out = PlanConstraints(dim=dim)
    for pattern, style in plan.items():
        raw = style if isinstance(style, str) else None
        if isinstance(style, str):
            if style in HF_STYLES_NOT_YET:
                raise NotImplementedError(
                    f"plan entry {pattern!r}: tp_plan style {style!r} is not supported yet: it "
                    f"needs {HF_STYLES_NOT_YET[style]}; leave the entry out (those layers are "
                    "then replicated) or give that module a ParallelStyle fxshard supports"
                )
            if style not in HF_STYLES:
                raise ValueError(
                    f"fxshard: plan entry {pattern!r}: unknown tp_plan style {style!r} (a style of "
                    "a transformers release newer than fxshard knows?); replace the entry with a "
                    "torch ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...) or a known "
                    "style, or leave it out (fxshard then places that layer itself); known: "
                    f"{sorted(HF_STYLES)}"
                )
            style = HF_STYLES[style]()
        # "" is the model itself (a plan for a bare nn.Linear)
        matches = [f for f in modules if (f or not pattern) and _match(pattern, f)]
        named = [f for f in params if _match(pattern, f)] if not matches else []
        if named:  # transformers' entries that name parameters (fused 3-D MoE experts)
            if raw is None:
                raise ValueError(
                    f"plan entry {pattern!r} names parameters ({named[0]}, ...): a ParallelStyle "
                    "applies to a module; give the module's FQN, or a tp_plan string such as "
                    "'colwise' for the parameter"
                )
            for f in named:
                _apply_param_style(out, f, params[f], raw, f"{pattern}: {raw}")
                owner = f.rpartition(".")[0]
                if raw == "grouped_gemm" and experts_module(modules.get(owner)) is not None:
                    out.experts[owner] = modules[owner]
            continue
        if not matches and (pattern, raw) in own:
            log.info("fxshard: %s's tp_plan entry %r matches nothing here", type(model).__name__,
                     pattern)  # fmt: skip
            continue
        if not matches:
            close = difflib.get_close_matches(pattern, [f for f in modules if f], n=5, cutoff=0.5)
            raise ValueError(
                f"fxshard: plan entry {pattern!r} matches no module of {type(model).__name__}; "
                f"closest existing FQNs: {close or sorted(modules)[:8]}; fix the FQN or leave "
                "the entry out"
            )
        for fqn in matches:
            before = set(out.boundaries)
            _apply_style(out, fqn, modules[fqn], style, f"{pattern}: {_style_name(style)}")
            for tag in set(out.boundaries) - before:
                out.eager_types[tag] = "local" if raw is not None else _eager_type(style, tag)
    _tie(out, model)
    return out


def _own_entries(model: nn.Module, plan) -> set:
    """(pattern, style) of ``plan`` that a transformers model in ``model`` (``model`` itself or a
    submodule) ships in its own ``tp_plan`` / ``_ep_plan``, under that module's FQN. transformers
    skips such entries where they match nothing (a plan covers its architecture's variants)."""
    entries = {(k, v) for k, v in plan.items() if isinstance(v, str)}
    own = set()
    for fqn, mod in model.named_modules():
        for p in (getattr(mod, "tp_plan", None), getattr(mod, "_ep_plan", None)):
            if isinstance(p, dict):
                pre = f"{fqn}." if fqn else ""
                own |= {(pre + k, v) for k, v in p.items() if isinstance(v, str)} & entries
    return own


def tied_names(model: nn.Module) -> list[list[str]]:
    """Groups (>= 2) of names one parameter or buffer goes by (tied weights), in module order."""
    by_id: dict[int, list[str]] = {}
    for fqn, t in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        by_id.setdefault(id(t), []).append(fqn)
    return [names for names in by_id.values() if len(names) > 1]


def _tie(out: PlanConstraints, model: nn.Module) -> None:
    """A tied tensor is one tensor: the placement a plan entry gives one of its names applies to
    all of them; two entries that place it differently are an error naming both."""
    for names in tied_names(model):
        entries = [(f, out.params[f]) for f in names if f in out.params]
        if not entries:
            continue
        first, (placement, prov) = entries[0]
        for f, (other, other_prov) in entries[1:]:
            if other != placement:
                raise ValueError(
                    f"{first} and {f} are one tensor (tied weights), but the plan places them "
                    f"differently: {placement} ({prov}) and {other} ({other_prov}); give both "
                    f"names one placement, or untie them"
                )
        for f in names:
            if f not in out.params:
                out.params[f] = (placement, f"{prov} (tied with {first})")


def _style_name(style) -> str:
    return style if isinstance(style, str) else type(style).__name__


def _params(module: nn.Module):
    return [(n, p) for n, p in module.named_parameters(recurse=False)]


def _is_conv1d(mod: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (transformers): a Linear whose weight is stored (in, out)."""
    w = getattr(mod, "weight", None)
    return (
        type(mod).__name__ == "Conv1D"
        and isinstance(w, torch.Tensor)
        and w.ndim == 2
        and tuple(w.shape) == (getattr(mod, "nx", None), getattr(mod, "nf", None))
    )


def _apply_style(out: PlanConstraints, fqn: str, mod: nn.Module, style, prov: str):
    def set_param(name, placement):
        out.params[f"{fqn}.{name}" if fqn else name] = (placement, prov)

    def need(n_in, n_out):
        a, b = out.hooked.get(fqn, (0, 0))
        out.hooked[fqn] = (max(a, n_in), max(b, n_out))

    is_linear, is_emb = isinstance(mod, nn.Linear), isinstance(mod, nn.Embedding)
    # Conv1D: a Linear with its weight transposed, so its output features are weight dim 1
    is_conv1d = _is_conv1d(mod)
    is_linear = is_linear or is_conv1d
    out_dim = 1 if is_conv1d else 0
    if isinstance(style, ColwiseParallel) or style == "packed_colwise":
        if not (is_linear or is_emb):
            raise ValueError(
                f"{prov}: ColwiseParallel applies to nn.Linear / nn.Embedding (and GPT-2's "
                f"Conv1D), but {fqn!r} is {type(mod).__name__}"
            )
        for name, _ in _params(mod):
            d = out_dim if name == "weight" else 0
            if style == "packed_colwise":
                set_param(name, StridedShard(d, split_factor=2))
            else:
                set_param(name, Shard(1) if is_emb else Shard(d))
        # packed: the output features stay strided as the weight's (transformers hands them on
        # as _StridedShard(-1)), so that splitting gate from up costs nothing
        packed = style == "packed_colwise"
        if packed:
            style = ColwiseParallel()
        need(1, 1)
        out.boundaries[f"{fqn}:in:0"] = (Replicate(), prov)
        _hint(out, fqn, 0, style.input_layouts[0])
        out_layout = StridedShard(-1, split_factor=2) if packed else style.output_layouts[0]
        out.boundaries[f"{fqn}:out:0"] = (out_layout, prov)
    elif isinstance(style, RowwiseParallel):
        if not (is_linear or is_emb):
            raise ValueError(
                f"{prov}: RowwiseParallel applies to nn.Linear / nn.Embedding (and GPT-2's "
                f"Conv1D), but {fqn!r} is {type(mod).__name__}"
            )
        for name, _ in _params(mod):
            if is_emb:
                set_param(name, Shard(0))
            else:
                set_param(name, Shard(1 - out_dim) if name == "weight" else Replicate())
        need(1, 1)
        out.boundaries[f"{fqn}:in:0"] = (Replicate() if is_emb else Shard(-1), prov)
        _hint(out, fqn, 0, style.input_layouts[0])
        out.boundaries[f"{fqn}:out:0"] = (style.output_layouts[0], prov)
    elif isinstance(style, SequenceParallel):
        for name, _ in mod.named_parameters():
            out.params[f"{fqn}.{name}" if fqn else name] = (Replicate(), prov)
        need(1, 0)
        out.boundaries[f"{fqn}:in:0"] = (style.sequence_sharding[0], prov)
        _hint(out, fqn, 0, style.sequence_sharding[0])
    elif style == "packed_rowwise":  # fused weights packed along the input features
        if not is_linear:
            raise ValueError(
                f"{prov}: packed_rowwise applies to nn.Linear (and GPT-2's Conv1D), but {fqn!r} "
                f"is {type(mod).__name__}"
            )
        for name, _ in _params(mod):
            if name == "weight":  # transformers' layout: the weight's last dim, strided
                set_param(name, StridedShard(1, split_factor=2))
            else:
                set_param(name, Replicate())
    elif style == "moe_tp_experts":
        need(1, 1)
        out.boundaries[f"{fqn}:in:0"] = (Replicate(), prov)
        out.boundaries[f"{fqn}:out:0"] = (Replicate(), prov)
    elif style == "local_params":
        pass  # the parameters' own plan entries place them
    elif style == "ep_dispatch_experts":
        if experts_module(mod) is None:
            raise ValueError(
                f"{prov}: ep_dispatch_experts applies to a transformers experts module (fused "
                f"3-D expert weights, forward(hidden_states, top_k_index, top_k_weights)), but "
                f"{fqn!r} is {type(mod).__name__}"
            )
        out.experts[fqn] = mod
    elif style == "grouped_gemm":
        raise ValueError(
            f"{prov}: grouped_gemm shards a fused experts' weight parameters (entries such as "
            f"'layers.*.mlp.experts.gate_up_proj'), not the module {fqn!r}"
        )
    elif style == "replicate":
        for name, _ in mod.named_parameters():
            out.params[f"{fqn}.{name}" if fqn else name] = (Replicate(), prov)
    elif isinstance(style, PrepareModuleInputOutput):
        _apply_style(out, fqn, mod, style.prepare_module_input, prov)
        _apply_style(out, fqn, mod, style.prepare_module_output, prov)
    elif isinstance(style, PrepareModuleInput):
        if style.with_kwargs:
            raise NotImplementedError(f"{prov}: keyword input layouts are not supported yet")
        n = len(style.desired_input_layouts)
        need(n, 0)
        for i, (given, desired) in enumerate(zip(style.input_layouts, style.desired_input_layouts)):
            if desired is not None:
                out.boundaries[f"{fqn}:in:{i}"] = (desired, prov)
            if given is not None:
                _hint(out, fqn, i, given)
    elif isinstance(style, PrepareModuleOutput):
        n = len(style.desired_output_layouts)
        need(0, n)
        for i, desired in enumerate(style.desired_output_layouts):
            if desired is not None:
                out.boundaries[f"{fqn}:out:{i}"] = (desired, prov)
    else:
        raise ValueError(f"{prov}: unsupported plan style {style!r}")


def _eager_type(style, tag: str) -> str:
    """What torch's ``parallelize_module`` hands on at a boundary ``style`` made: "dtensor" or
    "local"."""
    side = "in" if ":in:" in tag else "out"
    if isinstance(style, PrepareModuleInputOutput):
        style = style.prepare_module_input if side == "in" else style.prepare_module_output
    if isinstance(style, (ColwiseParallel, RowwiseParallel, SequenceParallel)) and side == "in":
        return "dtensor"  # the module's body runs on DTensors
    local = getattr(style, "use_local_output", True)
    return "local" if local else "dtensor"


def _apply_param_style(out: PlanConstraints, fqn: str, param, style: str, prov: str) -> None:
    """A tp_plan style on one parameter, as transformers shards it: colwise splits the output
    features (dim -2 of a weight, as of a fused experts' ``[E, out, in]``; a 1-D bias dim 0),
    rowwise the input features (dim -1; a bias stays replicated), packed styles strided in two
    (gate and up fused)."""
    nd = param.ndim
    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        placement = Shard(nd - 2 if nd >= 2 else 0)
    elif style == "packed_colwise":
        placement = StridedShard(nd - 2 if nd >= 2 else 0, split_factor=2)
    elif style in ("rowwise", "rowwise_rep", "rowwise_split_input"):
        placement = Shard(nd - 1) if nd >= 2 else Replicate()
    elif style == "packed_rowwise":
        placement = StridedShard(nd - 1, split_factor=2) if nd >= 2 else Replicate()
    elif style in ("embedding_rowwise", "grouped_gemm"):  # grouped_gemm: experts, dim 0
        placement = Shard(0)
    elif style in ("replicate", "replicated_with_grad_allreduce"):
        placement = Replicate()
    else:
        raise ValueError(
            f"plan entry for parameter {fqn!r}: tp_plan style {style!r} applies to a module, not "
            "a parameter"
        )
    out.params[fqn] = (placement, prov)


def _hint(out: PlanConstraints, fqn, i, layout):
    if layout is not None:
        out.input_hints[f"{fqn}:in:{i}"] = layout
