"""Ops of fxshard's own that stand in for library ops it cannot trace, and the table of stand-ins.

transformers runs fp32 MoE experts under torch.compile through ``transformers::grouped_mm_fallback``
(a Python loop over experts behind a custom op).  Its autograd formula reads the offsets with
``.tolist()``: fine when it runs, but a joint forward+backward graph cannot be traced through it
(the backward's loop bounds are tensor values).  ``fxshard::grouped_mm`` computes the same product
and differentiates into two ops whose loops stay inside them: the input gradient is
``grouped_mm(grad, weight^T)``, the weight gradient ``grouped_mm_weight_grad(input, grad)`` (per
expert ``input[rows]^T @ grad[rows]``).  Capturing a training graph replaces the fallback by it
(``stand_ins``); both have sharding rules (``rules.own``).

Under expert parallelism a rank holds a block of the experts (the weights' dim 0 sharded, as
transformers' ``grouped_gemm`` style shards them) and the global sorted tokens: it computes the
rows of its own experts (``grouped_mm_experts``; zero elsewhere, so the ranks' results add up)
and its experts' block of the weight gradient (``grouped_mm_weight_grad_experts``).  Lowering
emits these for grouped matmuls whose experts are sharded.
"""

from __future__ import annotations

import torch


def _loop(offs: torch.Tensor):
    start = 0
    for e, end in enumerate(offs.tolist()):
        yield e, start, end
        start = end


@torch.library.custom_op("fxshard::grouped_mm", mutates_args=())
def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``input`` [S, K] times ``weight[e]`` [K, N] -> [S, N] (rows
    past the last offset are zero)."""
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for e, start, end in _loop(offs):
        if end > start:
            out[start:end] = input[start:end] @ weight[e]
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(input, weight, offs):
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("fxshard::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(
    input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """The gradient of ``grouped_mm``'s weight: per expert ``input[rows]^T @ grad[rows]`` ->
    [E, K, N] (zero for an expert with no rows)."""
    out = input.new_zeros(offs.shape[0], input.shape[1], grad.shape[1])
    for e, start, end in _loop(offs):
        if end > start:
            out[e] = input[start:end].transpose(0, 1) @ grad[start:end]
    return out


@grouped_mm_weight_grad.register_fake
def _grouped_mm_weight_grad_fake(input, grad, offs):
    return input.new_empty(offs.shape[0], input.shape[1], grad.shape[1])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2])


def _backward(ctx, grad):
    input, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()
    d_input = grouped_mm(grad, weight.transpose(1, 2), offs)
    d_weight = grouped_mm_weight_grad(input, grad, offs)
    return d_input, d_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup)

GROUPED_MM = torch.ops.fxshard.grouped_mm.default
GROUPED_MM_WEIGHT_GRAD = torch.ops.fxshard.grouped_mm_weight_grad.default


def stand_ins() -> dict:
    """{library op: fxshard's op} for training captures (ops whose libraries are loaded)."""
    out = {}
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        try:
            out[fallback.default] = GROUPED_MM
            out[fallback] = GROUPED_MM
        except AttributeError:  # not registered after all
            pass
    return out


# ---- expert parallelism: a rank holds a block of experts ----------------------------------------


def _expert_rows(offs: torch.Tensor, first: int, count: int):
    """(local expert, start row, end row) of the experts ``first .. first + count - 1``."""
    ends = offs.tolist()
    for j in range(count):
        e = first + j
        if e >= len(ends):
            break
        start = ends[e - 1] if e > 0 else 0
        yield j, start, ends[e]


@torch.library.custom_op("fxshard::grouped_mm_experts", mutates_args=())
def grouped_mm_experts(
    input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, first: torch.Tensor
) -> torch.Tensor:
    """``grouped_mm`` on the rank that holds experts ``first .. first + weight.shape[0] - 1``
    (``weight`` is their block): their rows of the global sorted tokens, zero elsewhere (the
    ranks' results add up to the product)."""
    out = input.new_zeros(input.shape[0], weight.shape[2])
    for j, start, end in _expert_rows(offs, int(first), weight.shape[0]):
        if end > start:
            out[start:end] = input[start:end] @ weight[j]
    return out


@grouped_mm_experts.register_fake
def _grouped_mm_experts_fake(input, weight, offs, first):
    return input.new_empty(input.shape[0], weight.shape[2])


@torch.library.custom_op("fxshard::grouped_mm_weight_grad_experts", mutates_args=())
def grouped_mm_weight_grad_experts(
    input: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, first: torch.Tensor, count: int
) -> torch.Tensor:
    """``grouped_mm_weight_grad`` of the experts ``first .. first + count - 1`` (this rank's
    block of the weight's gradient)."""
    out = input.new_zeros(count, input.shape[1], grad.shape[1])
    for j, start, end in _expert_rows(offs, int(first), count):
        if end > start:
            out[j] = input[start:end].transpose(0, 1) @ grad[start:end]
    return out


@grouped_mm_weight_grad_experts.register_fake
def _grouped_mm_weight_grad_experts_fake(input, grad, offs, first, count):
    return input.new_empty(count, input.shape[1], grad.shape[1])


GROUPED_MM_EXPERTS = torch.ops.fxshard.grouped_mm_experts.default
GROUPED_MM_WEIGHT_GRAD_EXPERTS = torch.ops.fxshard.grouped_mm_weight_grad_experts.default

__all__ = [
    "GROUPED_MM",
    "GROUPED_MM_WEIGHT_GRAD",
    "GROUPED_MM_EXPERTS",
    "GROUPED_MM_WEIGHT_GRAD_EXPERTS",
    "stand_ins",
]
