"""User sharding rules: ``fxshard.register_rule(op, strategies)``.

``_USER_RULES`` is the registry (like torch's own op registries, process-wide): a rule registered
for an op is used by every later ``shard`` until ``unregister_rule``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from .excluded import forget_checked

_USER_RULES: dict = {}


def _tensor_counts(op) -> tuple[int, int]:
    """(tensor inputs, tensor outputs) from an operator's schema."""

    def is_tensor(t) -> bool:
        text = str(t)
        return "Tensor" in text and "[]" not in text  # Tensor and Tensor? (lists are not supported)

    schema = op._schema
    return (
        sum(is_tensor(a.type) for a in schema.arguments),
        sum(is_tensor(r.type) for r in schema.returns),
    )


def _as_overload(op):
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(
            f"register_rule: expected a torch operator such as torch.ops.mylib.myop.default, "
            f"got {op!r}"
        )
    return op


def register_rule(op: OpOverload | OpOverloadPacket, strategies: Sequence | Callable | None = None):
    """Teach fxshard how ``op`` may be sharded; overrides DTensor's rule for built-in ops.

    ``strategies`` lists *per-mesh-dim* strategies, each ``(input_placements, output_placements)``
    with one placement per tensor input / output of the op (``Shard(d)``, ``Replicate()``,
    ``Partial(op)``), e.g. for an elementwise op ``[((Shard(0), Shard(0)), (Shard(0),))]``.  On an
    N-D mesh fxshard combines them per mesh dim; all-replicated is always allowed.  Instead of a
    list, a callable ``fn(args, kwargs, ndim) -> strategies`` can compute them from the (fake)
    arguments. Checked now: a strategy with the wrong number of placements is rejected here, not at
    use. Usable as a decorator: ``@register_rule(op)`` over the callable.
    """
    op = _as_overload(op)
    if strategies is None:  # decorator form

        def deco(fn):
            register_rule(op, fn)
            return fn

        return deco
    n_in, n_out = _tensor_counts(op)
    if not callable(strategies):
        strategies = [tuple(map(tuple, s)) for s in strategies]
        for s in strategies:
            _check_strategy(op, s, n_in, n_out)
    _USER_RULES[op] = (strategies, n_in, n_out)
    forget_checked(op)  # a new rule is checked anew
    return strategies


def unregister_rule(op: OpOverload | OpOverloadPacket) -> None:
    """Forget a registered rule (a built-in op goes back to DTensor's)."""
    _USER_RULES.pop(_as_overload(op), None)
    forget_checked(_as_overload(op))


def _check_strategy(op, s, n_in, n_out):
    if len(s) != 2:
        raise ValueError(
            f"register_rule({op}): a strategy is (input_placements, output_placements), got {s!r}"
        )
    ins, outs = s
    if len(ins) != n_in or len(outs) != n_out:
        raise ValueError(
            f"register_rule({op}): strategy {s!r} gives {len(ins)} input and {len(outs)} output "
            f"placements, but {op} has {n_in} tensor inputs and {n_out} tensor outputs"
        )
    for p in (*ins, *outs):
        if not isinstance(p, (Shard, Replicate, Partial)):
            raise ValueError(
                f"register_rule({op}): {p!r} is not a placement (Shard(d), Replicate(), Partial())"
            )


def user_candidates(op: OpOverload, args: Sequence, kwargs: dict, mesh_ndim: int) -> list:
    rule, n_in, n_out = _USER_RULES[op]
    per_dim = rule(args, kwargs, mesh_ndim) if callable(rule) else rule
    per_dim = [tuple(map(tuple, s)) for s in per_dim]
    for s in per_dim:
        _check_strategy(op, s, n_in, n_out)
    rep = (tuple(Replicate() for _ in range(n_in)), tuple(Replicate() for _ in range(n_out)))
    if rep not in per_dim:
        per_dim = [rep, *per_dim]
    out = []
    for combo in itertools.product(per_dim, repeat=mesh_ndim):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(n_in))
        outs = tuple(tuple(c[1][j] for c in combo) for j in range(n_out))
        out.append((ins, outs))
    return out


def has_rule(op: object) -> bool:
    return op in _USER_RULES
