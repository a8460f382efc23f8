"""fxshard's own sharding rules, for ops where DTensor has none or one fxshard cannot use.

* scaled-dot-product attention (DTensor has no rule for the CPU kernels or for the causal form):
  shard batch or heads, q/k/v/output alike;
* tensor factories (arange, full, zeros...): replicated;
* vocab-parallel embedding: DTensor's ``_MaskPartial`` is replaced by plain ``Partial(sum)`` and a
  masked local lookup at lowering time.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten

from .dtensor import dtensor_candidates

aten = torch.ops.aten
SDPA_OPS = {
    aten.scaled_dot_product_attention.default: 1,
    aten._scaled_dot_product_flash_attention_for_cpu.default: 2,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 3,
}
FACTORY_OPS = {
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.full.default,
    aten.zeros.default,
    aten.ones.default,
    aten.empty.memory_format,
    aten.scalar_tensor.default,
    aten.rand.default,
    aten.randn.default,
}
EMBEDDING = aten.embedding.default

# Random ops whose draws depend on their inputs' shapes only (the input is a shape / dtype template,
# or is multiplied by a mask drawn for its shape): sharded, each rank draws the whole global tensor
# as single device would and keeps its own shard (lowering does it), so shards never repeat a mask
# and the program draws what the single-device program draws for the same seed.
SHAPE_RANDOM_OPS = frozenset(
    {
        aten.rand_like.default,
        aten.randn_like.default,
        aten.randint_like.default,
        aten.randint_like.low_dtype,
        aten.bernoulli.p,
        aten.native_dropout.default,
        aten.uniform.default,
        aten.normal_functional.default,
        aten.exponential.default,
        aten.cauchy.default,
        aten.log_normal.default,
        aten.geometric.default,
        aten.random.default,
        getattr(aten.random, "from"),
        aten.random.to,
    }
)
# Random ops whose draws depend on their inputs' values (probabilities, means, rates): computed
# replicated, every rank drawing the same global result.
VALUE_RANDOM_OPS = frozenset(
    {
        aten.bernoulli.default,
        aten.bernoulli.Tensor,
        aten.multinomial.default,
        aten.poisson.default,
        aten.binomial.default,
        aten.normal.Tensor_float,
        aten.normal.float_Tensor,
        aten.normal.Tensor_Tensor,
        aten.rrelu_with_noise.default,
        # in place (eager programs; captured graphs hold the functional forms): replicated, every
        # rank overwriting its copy with the same global draw
        aten.bernoulli_.float,
        aten.bernoulli_.Tensor,
        aten.uniform_.default,
        aten.normal_.default,
        aten.exponential_.default,
        aten.cauchy_.default,
        aten.log_normal_.default,
        aten.geometric_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
    }
)


def random_candidates(op: OpOverload, cands: list | None) -> list | None:
    """The candidates a random op keeps: none with a Partial value (a draw is not a sum of
    addends), and only the replicated one where the draws depend on the inputs' values."""
    if cands is None or not isinstance(cands, list):
        return cands
    out = []
    for ins, outs in cands:
        plcs = [p for side in (ins, outs) for plc in side if plc for p in plc]
        if any(isinstance(p, Partial) for p in plcs):
            continue
        if op in VALUE_RANDOM_OPS and not all(isinstance(p, Replicate) for p in plcs):
            continue
        out.append((ins, outs))
    return out


def sdpa_candidates(
    op: OpOverload, args: Sequence, kwargs: dict, mesh: DeviceMesh, input_placements: Sequence
) -> list:
    """q, k, v (and a mask; the backward's grad_out, out and logsumexp) sharded alike on batch (dim
    0) or heads (dim 1), per mesh dim; a tensor of size 1 on that dim (a broadcast mask) is
    replicated instead.  Outputs (and logsumexp, the input gradients) follow q."""
    tensors = [
        x for x in tree_flatten((tuple(args), dict(kwargs)))[0] if isinstance(x, torch.Tensor)
    ]
    q = tensors[0]
    n_out = SDPA_OPS[op]
    n_alike = 4 if n_out == 3 else 3  # (grad_out,) q, k, v
    per_dim = []
    for _m in range(mesh.ndim):
        opts = [Replicate(), Shard(0), Shard(1)]
        per_dim.append(opts)
    out = []
    for combo in itertools.product(*per_dim):
        ins = []
        for t in tensors:
            plc = tuple(
                p
                if not isinstance(p, Shard) or (t.ndim >= 2 and t.shape[p.dim] == q.shape[p.dim])
                else Replicate()
                for p in combo
            )
            ins.append(plc)
        # k/v must be sharded exactly like q on batch/heads (GQA without expansion is not covered)
        if any(ins[i] != tuple(combo) for i in range(min(n_alike, len(ins)))):
            continue
        out.append((tuple(ins), tuple(tuple(combo) for _ in range(n_out))))
    return out


def embedding_candidates(
    op: OpOverload, args: Sequence, kwargs: dict, mesh: DeviceMesh, input_placements: Sequence
) -> list:
    """DTensor's candidates without _MaskPartial, plus vocab-parallel lookups: weight Shard(0) on a
    mesh dim, indices replicated there, output Partial(sum) (lowered as a masked local lookup)."""
    base = dtensor_candidates(op, args, kwargs, mesh, input_placements) or []
    keep = [
        c
        for c in base
        if not any(
            type(p).__name__ == "_MaskPartial" for side in c for plc in side if plc for p in plc
        )
    ]
    per_dim = []
    weight = args[0]
    for _m in range(mesh.ndim):
        per_dim.append(
            [
                ("R", Replicate(), Replicate(), Replicate()),
                ("vocab", Shard(0), Replicate(), Partial("sum")),
                ("batch", Replicate(), Shard(0), Shard(0)),
            ]
        )
    for combo in itertools.product(*per_dim):
        if all(c[0] != "vocab" for c in combo):
            continue
        w = tuple(c[1] for c in combo)
        idx = tuple(c[2] for c in combo)
        o = tuple(c[3] for c in combo)
        if weight.shape[0] < 1:
            continue
        keep.append(((w, idx), (o,)))
    return keep
