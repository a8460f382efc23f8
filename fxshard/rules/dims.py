"""Dim arguments normalised before any rule sees them.

A rule compares a dim argument with the tensor dims its placements shard; ``dim=-1`` and
``dim=ndim-1`` are the same dim, but a rule that compares them as numbers treats them as two
(DTensor's scan rule, for one, lets ``cumsum(x, -1)`` run on a tensor sharded on its last dim, each
shard scanning alone).  So every dim-like argument of an op's schema (``dim``, ``dims``, ``dim0``,
``start_dim``, ``source`` ...) is made non-negative first: modulo the rank of the op's first
tensor argument, or of its output for the ops whose dim indexes the output (``unsqueeze``,
``stack``, ``diag_embed``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_DIM_ARGS = frozenset(
    {"dim", "dims", "dim0", "dim1", "dim2", "start_dim", "end_dim", "source", "destination"}
)
_OUTPUT_RANK = frozenset({"unsqueeze", "unsqueeze_copy", "stack", "diag_embed"})


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (list, tuple)):
        for y in x:
            t = _first_tensor(y)
            if t is not None:
                return t
    return None


def _wrap(v, rank: int):
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return v % rank if v < 0 else v
    if isinstance(v, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        return type(v)(x % rank if x < 0 else x for x in v)
    return v


def normalize_dims(op, args: Sequence, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every negative dim-like argument made non-negative (see the module
    docstring); unchanged for ops without a schema or a tensor argument."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return tuple(args), dict(kwargs)
    ref = _first_tensor(list(args)) if args else None
    if ref is None:
        ref = _first_tensor(list(kwargs.values()))
    if ref is None:
        return tuple(args), dict(kwargs)
    name = op.name().split("::")[-1].split(".")[0]
    rank = max(ref.ndim, 1) + (1 if name in _OUTPUT_RANK else 0)
    args, kwargs = list(args), dict(kwargs)
    for i, a in enumerate(schema.arguments):
        if a.name not in _DIM_ARGS:
            continue
        if i < len(args) and not a.kwarg_only:
            args[i] = _wrap(args[i], rank)
        elif a.name in kwargs:
            kwargs[a.name] = _wrap(kwargs[a.name], rank)
    return tuple(args), kwargs
