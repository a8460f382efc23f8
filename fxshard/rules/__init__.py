"""Sharding rules: candidate (input placements, output placements) per ATen op.

Where a rule comes from, first match wins: a rule the user registered (``register_rule``),
fxshard's own (``own``: attention, factories, vocab-parallel embedding), DTensor's (``dtensor``).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from .dims import normalize_dims
from .dtensor import dtensor_candidates, has_single_dim_rule, single_dim_rule_count
from .excluded import drop_excluded
from .experts import MOE_EXPERTS_BACKWARD, VARIANTS, dispatch_steps, experts_candidates
from .ops import stand_ins
from .own import (
    BATCH_OPS,
    CONVOLUTION_OPS,
    EMBEDDING,
    FACTORY_OPS,
    GATHER,
    INDEX_PUT_OPS,
    POOL_OPS,
    RESHAPE_OPS,
    SCATTER_OPS,
    SDPA_OPS,
    SHAPE_RANDOM_OPS,
    SQUEEZE_DIMS,
    STRIDED_CAT,
    STRIDED_SPLIT_OPS,
    VALUE_CHECK_OPS,
    VALUE_RANDOM_OPS,
    batch_candidates,
    embedding_candidates,
    gather_candidates,
    grouped_mm_candidates,
    grouped_mm_weight_grad_candidates,
    index_put_candidates,
    is_grouped_mm,
    is_grouped_mm_weight_grad,
    pool_candidates,
    scatter_candidates,
    sdpa_candidates,
    shape_random_candidates,
    squeeze_dims_candidates,
    strided_cat_candidates,
    strided_reshape_candidates,
    strided_split_candidates,
)
from .user import has_rule, register_rule, unregister_rule, user_candidates


def candidates(
    op: OpOverload,
    args: Sequence,
    kwargs: dict,
    device_mesh: DeviceMesh,
    input_placements: Sequence[Sequence[Placement]],
) -> list | str | None:
    """All candidate strategies for ``op`` (args with fake tensors) given the inputs' current
    placements; ``None`` when no rule exists.  Dim arguments are normalised first (``dims``)."""
    found = _candidates(op, args, kwargs, device_mesh, input_placements)
    found = _no_partial_casts(args, kwargs, _no_partial_indices(op, found))
    return drop_excluded(op, found)


def _no_partial_casts(args, kwargs, found):
    """Candidates without a Partial floating input where the op casts to an integer dtype
    (``cumsum(x, 0, dtype=torch.int32)``): each addend is truncated on its own, and the truncated
    addends do not sum to the truncated sum (torch 2.14 offers ``P -> P`` for it)."""
    import torch

    dtype = (kwargs or {}).get("dtype")
    if not isinstance(found, list) or not isinstance(dtype, torch.dtype):
        return found
    if dtype.is_floating_point or dtype.is_complex:
        return found
    tensors = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
    if not floating:
        return found
    return _without_partial(found, 0, floating)


def _without_partial(found, side, idx):
    """``found`` less the candidates with a Partial placement at input (side 0) or output
    (side 1) positions ``idx``."""
    return [
        c
        for c in found
        if not any(
            i < len(c[side]) and c[side][i] is not None and any(p.is_partial() for p in c[side][i])
            for i in idx
        )
    ]


def _flat(args):
    from torch.utils._pytree import tree_flatten

    return tree_flatten(tuple(args))[0]


_INDEX_OPS = frozenset({"aten::argmax", "aten::argmin"})


def _no_partial_indices(op, found):
    """Candidates without a Partial index output: a position found on one rank's shard is a local
    index, and no reduction of ranks' local indices is the global one (torch 2.11 offers
    ``argmax`` of a ``Shard(0)`` input along dim 0 as ``Partial(max)``)."""
    if not isinstance(found, list):
        return found
    names = [r.name for r in op._schema.returns]
    idx = [i for i, n in enumerate(names) if n == "indices"]
    if op._schema.name in _INDEX_OPS:
        idx = [0]
    if not idx:
        return found
    return _without_partial(found, 1, idx)


def _candidates(op, args, kwargs, device_mesh, input_placements) -> list | str | None:
    args, kwargs = normalize_dims(op, args, kwargs)
    skipped = _legacy_empty(op, args)
    if skipped:
        return _cat_without(skipped, args, kwargs, device_mesh, input_placements)
    if has_rule(op):
        return user_candidates(op, args, kwargs, device_mesh.ndim)
    if op in FACTORY_OPS:
        return "factory"
    if op in SDPA_OPS:
        return sdpa_candidates(op, args, kwargs, device_mesh, input_placements)
    if op == EMBEDDING:
        return embedding_candidates(op, args, kwargs, device_mesh, input_placements)
    if op == GATHER:
        return gather_candidates(op, args, kwargs, device_mesh, input_placements)
    if op in SCATTER_OPS:
        return scatter_candidates(op, args, kwargs, device_mesh, input_placements)
    if is_grouped_mm(op):
        return grouped_mm_candidates(op, args, kwargs, device_mesh, input_placements)
    if is_grouped_mm_weight_grad(op):
        return grouped_mm_weight_grad_candidates(args, kwargs, device_mesh, input_placements)
    if op in VARIANTS:
        return experts_candidates(op, args, device_mesh)
    if op in VALUE_RANDOM_OPS or op in VALUE_CHECK_OPS or _empty_tensor(args, kwargs):
        # every rank draws the global result; an empty tensor is nothing to split (and DTensor's
        # view rule loops forever on some zero-size shapes)
        rep = (Replicate(),) * device_mesh.ndim
        n_out = sum("Tensor" in str(r.type) for r in op._schema.returns)
        return [((rep,) * len(input_placements), (rep,) * n_out)]
    if op in SHAPE_RANDOM_OPS:  # elementwise in one shape: the same rule on every release
        return shape_random_candidates(op, args, kwargs, device_mesh)
    if not has_single_dim_rule(op):  # torch 2.11's rules for these are wrong
        if op in INDEX_PUT_OPS:
            return index_put_candidates(args, kwargs, device_mesh)
        if op in CONVOLUTION_OPS:
            return batch_candidates(op, args, kwargs, device_mesh)
    found = dtensor_candidates(op, args, kwargs, device_mesh, input_placements)
    if op in STRIDED_SPLIT_OPS and found is not None:
        found = found + strided_split_candidates(op, args, kwargs, device_mesh, input_placements)
    if op in RESHAPE_OPS and found is not None:
        found = found + strided_reshape_candidates(args, device_mesh, input_placements, found)
    if op == STRIDED_CAT and found is not None:
        found = found + strided_cat_candidates(args, kwargs, device_mesh, input_placements)
    if found is None:  # ops DTensor rules only in later torch releases
        if op in POOL_OPS:
            return pool_candidates(op, args, kwargs, device_mesh)
        if op in BATCH_OPS:
            return batch_candidates(op, args, kwargs, device_mesh)
        if op == SQUEEZE_DIMS:
            return squeeze_dims_candidates(args, device_mesh, input_placements)
    return found


def _legacy_empty(op, args) -> list[int]:
    """The inputs of a ``cat`` that it skips: 1-D and empty (``torch.cat([torch.tensor([]), x])``,
    how a cache starts), next to inputs of other ranks."""
    if op != STRIDED_CAT or not args or not isinstance(args[0], (list, tuple)):
        return []
    ts = args[0]
    skip = [i for i, t in enumerate(ts) if t.ndim == 1 and t.numel() == 0]
    if not skip or len(skip) == len(ts) or all(t.ndim == 1 for t in ts):
        return []
    return skip


def _cat_without(skipped, args, kwargs, device_mesh, input_placements) -> list | None:
    """A cat's candidates with the inputs it skips left out (then replicated: they hold
    nothing)."""
    ts = [t for i, t in enumerate(args[0]) if i not in skipped]
    plc = [p for i, p in enumerate(input_placements) if i not in skipped]
    found = _candidates(STRIDED_CAT, (ts, *args[1:]), kwargs, device_mesh, plc)
    if not isinstance(found, list):
        return found
    rep = (Replicate(),) * device_mesh.ndim
    out = []
    for ins, outs in found:
        it = iter(ins)
        out.append((tuple(rep if i in skipped else next(it) for i in range(len(args[0]))), outs))
    return out


def _empty_tensor(args, kwargs) -> bool:
    import torch
    from torch.utils._pytree import tree_flatten

    leaves = tree_flatten((tuple(args), dict(kwargs)))[0]
    return any(isinstance(x, torch.Tensor) and x.numel() == 0 for x in leaves)


def rules_mesh(shape: Sequence[int]) -> DeviceMesh:
    """A DeviceMesh of ``shape`` with no process group: strategy functions never communicate."""
    from .._torch import torch_planning_mesh

    key = tuple(shape)
    if key not in _MESHES:
        _MESHES[key] = torch_planning_mesh(key)
    return _MESHES[key]


_MESHES: dict = {}  # cache: mesh shape -> planning DeviceMesh (no process group)


__all__ = [
    "MOE_EXPERTS_BACKWARD",
    "VARIANTS",
    "candidates",
    "dispatch_steps",
    "stand_ins",
    "rules_mesh",
    "register_rule",
    "unregister_rule",
    "has_rule",
    "dtensor_candidates",
    "has_single_dim_rule",
    "single_dim_rule_count",
    "EMBEDDING",
    "GATHER",
    "SCATTER_OPS",
    "FACTORY_OPS",
    "SDPA_OPS",
]
