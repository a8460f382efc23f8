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
    return v % rank if v < 0 else v


def _negate(v, rank: int):
    return v - rank if 0 <= v < rank else v


def _map(v, rank: int, f):
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, int):
        return f(v, rank)
    if isinstance(v, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in v
    ):
        return type(v)(f(x, rank) for x in v)
    return v


def normalize_dims(op, args: Sequence, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every negative dim-like argument made non-negative (see the module
    docstring); unchanged for ops without a schema or a tensor argument."""
    return _map_dims(op, args, kwargs, _wrap)


def negate_dims(op, args: Sequence, kwargs: dict) -> tuple[tuple, dict]:
    """The same call with every dim-like argument written negatively (``dim=1`` of a 3-d tensor
    as ``dim=-2``): what the rule checker also tries, to see that normalising works."""
    return _map_dims(op, args, kwargs, _negate)


def _map_dims(op, args: Sequence, kwargs: dict, f) -> tuple[tuple, dict]:
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
            args[i] = _map(args[i], rank, f)
        elif a.name in kwargs:
            kwargs[a.name] = _map(kwargs[a.name], rank, f)
    return tuple(args), kwargs
