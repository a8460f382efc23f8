"""fxshard's own sharding rules, for ops where DTensor has none or one fxshard cannot use.

* scaled-dot-product attention (DTensor has no rule for the CPU kernels or for the causal form):
  shard batch or heads, q/k/v/output alike;
* tensor factories (arange, full, zeros...): replicated;
* vocab-parallel embedding: DTensor's ``_MaskPartial`` is replaced by plain ``Partial(sum)`` and a
  masked local lookup at lowering time;
* loss parallel: ``gather`` from a tensor split along the gathered dim (a cross-entropy's target
  logit from vocab-sharded log-probabilities) as a masked local gather summed over ranks, and
  ``scatter`` into one (its backward) as a masked local scatter, so a loss on vocab-sharded
  logits moves no logit-sized tensor;
* ops DTensor rules only from a later torch release on (pooling, group norm, ``squeeze.dims``,
  shape-only random ops in torch 2.11), used where DTensor has no rule.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten

from .._torch import StridedShard, is_strided_shard, strided_split_factor
from ..core.spec import reshape_groups
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
GATHER = aten.gather.default
SCATTER_OPS = frozenset({aten.scatter.value, aten.scatter.src})

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


# Checks and prints of tensor values: they read the value, so it is replicated (a shard or an addend
# is not the value); they move nothing else, and this is their rule, not a fallback
VALUE_CHECK_OPS = frozenset(
    getattr(getattr(aten, name), overload)
    for name, overload in (
        ("_assert_async", "default"),
        ("_assert_async", "msg"),
        ("_functional_assert_async", "msg"),
        ("_print", "default"),
    )
    if hasattr(aten, name) and hasattr(getattr(aten, name), overload)
)


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


def _along(op, args, kwargs, device_mesh: DeviceMesh, input_placements, options) -> list:
    """DTensor's candidates for ``op`` plus, per mesh dim, ``options`` (tuples of placements: the
    op's tensor inputs, then its output; the first is the one fxshard adds): every combination
    that uses it on some mesh dim."""

    def masked(c) -> bool:  # DTensor's own _MaskPartial (lowered by fxshard as Partial(sum))
        return any(
            type(p).__name__ == "_MaskPartial" for side in c for plc in side if plc for p in plc
        )

    cands = dtensor_candidates(op, args, kwargs, device_mesh, input_placements) or []
    base = [c for c in cands if not masked(c)]
    n_in = len(options[0]) - 1
    rep = (Replicate(),) * (n_in + 1)
    for combo in itertools.product(*[[rep, *options] for _ in range(device_mesh.ndim)]):
        if all(c is not options[0] for c in combo):
            continue
        ins = tuple(tuple(c[i] for c in combo) for i in range(n_in))
        base.append((ins, (tuple(c[n_in] for c in combo),)))
    return base


def gather_candidates(op, args, kwargs, device_mesh: DeviceMesh, input_placements) -> list:
    """``gather(self, dim, index)`` with ``self`` split along ``dim`` (its vocabulary) and the index
    whole there: each rank gathers the entries it holds, zeros elsewhere, and the sum over ranks
    is the gather (``Partial(sum)``; lowered as a masked local gather)."""
    x, dim = args[0], args[1] % max(args[0].ndim, 1)
    if x.ndim == 0 or x.shape[dim] < 1:
        return dtensor_candidates(op, args, kwargs, device_mesh, input_placements)
    # other dims split alike on self, index and output (tokens), where their sizes match
    other = [(Shard(d), Shard(d), Shard(d)) for d in _aligned(x, args[2], dim)]
    return _along(op, args, kwargs, device_mesh, input_placements,
                  [(Shard(dim), Replicate(), Partial("sum")), *other])  # fmt: skip


def _aligned(x, index, dim, src=None) -> list[int]:
    """The dims other than ``dim`` where ``x``, ``index`` (and ``src``) have one size."""
    return [
        d
        for d in range(x.ndim)
        if d != dim
        and d < index.ndim
        and x.shape[d] == index.shape[d]
        and (src is None or (d < src.ndim and src.shape[d] == x.shape[d]))
    ]


def scatter_candidates(op, args, kwargs, device_mesh: DeviceMesh, input_placements) -> list:
    """``scatter(self, dim, index, value|src)`` into ``self`` split along ``dim``, the index (and
    source) whole there: each rank writes the entries it holds (lowered as a masked local
    scatter); the result is split as ``self`` is."""
    x, dim = args[0], args[1] % max(args[0].ndim, 1)
    if x.ndim == 0 or x.shape[dim] < 1:
        return dtensor_candidates(op, args, kwargs, device_mesh, input_placements)
    has_src = op is aten.scatter.src
    src = (Replicate(),) if has_src else ()
    other = [
        (Shard(d), Shard(d), *((Shard(d),) if has_src else ()), Shard(d))
        for d in _aligned(x, args[2], dim, args[3] if has_src else None)
    ]
    return _along(op, args, kwargs, device_mesh, input_placements,
                  [(Shard(dim), Replicate(), *src, Shard(dim)), *other])  # fmt: skip


# ---- rules for ops DTensor rules only in later torch releases (used where DTensor has none) ------

# Ops that are independent along the batch dim (dim 0) of some tensor arguments (by position: "b"
# sharded on dim 0, "r" replicated) and give outputs sharded on dim 0 ("b") or partial sums over
# the batch ("p"): per mesh dim, every tensor replicated, or that column.  torch 2.11 has no DTensor
# rule for these (2.12+ does, and DTensor's rules win where they exist).
BATCH_OPS = {
    aten.native_group_norm.default: ("brr", "bbb"),
    aten.native_group_norm_backward.default: ("bbbbr", "bpp"),
    aten.convolution.default: ("brr", "b"),
    aten.convolution_backward.default: ("bbr", "bpp"),
}
# torch 2.11 rules convolution with legacy rules written for DTensor's own convolution handlers,
# which do not look at the weight's or bias's placement (and always make the weight gradient
# Partial on mesh dim 0): where DTensor has no single-dim rule for them, BATCH_OPS' is used
CONVOLUTION_OPS = frozenset({aten.convolution.default, aten.convolution_backward.default})
# pooling (and its backward): N and C (every dim but the last two, the spatial ones) are
# independent, and all tensors share the placement
POOL_OPS = frozenset(
    {
        aten.max_pool2d_with_indices.default,
        aten.max_pool2d_with_indices_backward.default,
        aten.avg_pool2d.default,
        aten.avg_pool2d_backward.default,
    }
)
SQUEEZE_DIMS = aten.squeeze.dims  # torch 2.11: no rule; a view to the squeezed shape has one


def _tensors(args, kwargs) -> list:
    return [x for x in tree_flatten((tuple(args), dict(kwargs)))[0] if isinstance(x, torch.Tensor)]


def _n_outputs(op: OpOverload) -> int:
    return sum("Tensor" in str(r.type) for r in op._schema.returns)


def pool_candidates(op: OpOverload, args, kwargs, device_mesh: DeviceMesh) -> list:
    """Pooling: per mesh dim, every tensor replicated or all sharded alike on a non-spatial dim."""
    tensors = _tensors(args, kwargs)
    n_in, ndim = len(tensors), tensors[0].ndim
    columns = [Replicate()] + [Shard(d) for d in range(ndim - 2)]
    return [
        ((plc,) * n_in, (plc,) * _n_outputs(op))
        for plc in itertools.product(columns, repeat=device_mesh.ndim)
    ]


def batch_candidates(op: OpOverload, args, kwargs, device_mesh: DeviceMesh) -> list:
    ins, outs = BATCH_OPS[op]
    roles = [r for a, r in zip(args, ins) if isinstance(a, torch.Tensor)]
    n_out = _n_outputs(op)
    pick = {"b": Shard(0), "r": Replicate(), "p": Partial("sum")}
    out = []
    for batch in itertools.product((False, True), repeat=device_mesh.ndim):
        col = {r: tuple(pick[r] if b else Replicate() for b in batch) for r in "brp"}
        out.append((tuple(col[r] for r in roles), tuple(col[r] for r in outs[:n_out])))
    return out


def squeeze_dims_candidates(args, device_mesh: DeviceMesh, input_placements) -> list | None:
    """``squeeze.dims(x, dims)`` is ``view(x, squeezed shape)``: its candidates."""
    x, dims = args[0], args[1]
    dims = {d % max(x.ndim, 1) for d in dims}
    shape = [s for i, s in enumerate(x.shape) if not (i in dims and s == 1)]
    return dtensor_candidates(
        aten.view.default, (x, shape), {}, device_mesh, input_placements, drop_strided_shard=True
    )


def shape_random_candidates(op: OpOverload, args, kwargs, device_mesh: DeviceMesh) -> list:
    """A random op whose draws depend on shapes only: elementwise, every tensor placed alike, never
    Partial (each rank draws the global tensor and keeps its shard: see SHAPE_RANDOM_OPS).  Ours on
    every release: torch 2.11 has no DTensor rule for ``bernoulli.p`` and gives ``native_dropout``
    one output spec for its two outputs."""
    tensors = _tensors(args, kwargs)
    if any(t.shape != tensors[0].shape for t in tensors):
        return []  # (every op listed has one tensor input; an op with others is not elementwise)
    columns = [Replicate()] + [Shard(d) for d in range(tensors[0].ndim)]
    return [
        ((plc,) * len(tensors), (plc,) * _n_outputs(op))
        for plc in itertools.product(columns, repeat=device_mesh.ndim)
    ]


# Grouped matmuls of MoE experts: ``(tokens sorted by expert [S, K], weights [E, K, N], offs [E])``
# -> [S, N], where expert e multiplies the rows between offs[e-1] and offs[e].  transformers runs
# its experts through ``aten._grouped_mm`` (bf16) or its own opaque ``grouped_mm_fallback``.
# (``fxshard::grouped_mm``: the fallback's traceable stand-in for training, ``rules.ops``)
GROUPED_MM_OPS = frozenset(
    {"aten::_grouped_mm", "transformers::grouped_mm_fallback", "fxshard::grouped_mm"}
)
GROUPED_MM_WEIGHT_GRAD = "fxshard::grouped_mm_weight_grad"


def is_grouped_mm(op) -> bool:
    return isinstance(op, OpOverload) and op.name() in GROUPED_MM_OPS


def is_grouped_mm_weight_grad(op) -> bool:
    return isinstance(op, OpOverload) and op.name() == GROUPED_MM_WEIGHT_GRAD


def grouped_mm_weight_grad_candidates(args, kwargs, device_mesh: DeviceMesh, input_placements):
    """``(input [S, K], grad [S, N], offs) -> [E, K, N]``, per mesh dim: the input's features
    sharded (output dim 1), the gradient's (output dim 2), strided alike where they are (packed
    gate/up outputs), either Partial (the product is linear in each), or the experts (output dim
    0: each rank its experts' block); the rows (tokens sorted by expert) stay whole, as the
    forward's do."""
    tensors = _tensors(args, kwargs)
    if len(tensors) != 3 or tensors[0].ndim != 2 or tensors[1].ndim != 2:
        return []
    r, p = Replicate(), Partial("sum")
    base = [((r, r, r), r), ((Shard(1), r, r), Shard(1)), ((r, Shard(1), r), Shard(2)),
            ((p, r, r), p), ((r, p, r), p), ((r, r, r), Shard(0))]  # fmt: skip
    per_dim = []
    for m in range(device_mesh.ndim):
        cols = list(base)
        for i, out_dim in ((0, 1), (1, 2)):
            q = input_placements[i][m] if i < len(input_placements) else None
            if is_strided_shard(q) and q.dim in (1, -1):
                out = StridedShard(out_dim, split_factor=strided_split_factor(q))
                cols.append((tuple(q if j == i else r for j in range(3)), out))
        per_dim.append(cols)
    return [
        (tuple(tuple(c[0][i] for c in combo) for i in range(3)), (tuple(c[1] for c in combo),))
        for combo in itertools.product(*per_dim)
    ]


def grouped_mm_candidates(
    op: OpOverload, args, kwargs, device_mesh: DeviceMesh, input_placements
) -> list:
    """Per mesh dim: every expert's output features sharded (weight dim 2, output dim 1:
    colwise experts; strided alike where the weight is, as packed gate/up weights are), the
    contraction sharded (input dim 1, weight dim 1: rowwise experts, a Partial output; strided
    alike where the input is), the input Partial (the product is linear in it), or the experts
    sharded (weight dim 0: expert parallelism, each rank the rows of its own experts, a Partial
    output; lowered as ``fxshard::grouped_mm_experts``).  The tokens and offsets stay replicated:
    a shard of the sorted tokens would not match the global offsets."""
    tensors = _tensors(args, kwargs)
    if len(tensors) < 3 or tensors[0].ndim != 2 or tensors[1].ndim != 3:
        return []
    n_extra = len(tensors) - 3  # a bias (aten's [E, N]) follows the output features
    r, p = Replicate(), Partial("sum")
    base = [
        ((r, r, r) + (r,) * n_extra, r),
        ((r, Shard(2), r) + (Shard(1),) * n_extra, Shard(1)),
    ]
    if not n_extra:  # (a bias would be added once per rank to a Partial output)
        base += [((Shard(1), Shard(1), r), p), ((p, r, r), p)]
        # experts sharded (expert parallelism): each rank the rows of its experts, the rest zero
        base.append(((r, Shard(0), r), p))
    x_plc = list(input_placements[0]) if input_placements else []
    weight = list(input_placements[1]) if len(input_placements) > 1 else []
    per_dim = []
    for m in range(device_mesh.ndim):
        cols = list(base)
        w = weight[m] if m < len(weight) else None
        x = x_plc[m] if m < len(x_plc) else None
        if is_strided_shard(w) and w.dim in (2, -1):  # packed output features, strided alike
            out_plc = StridedShard(1, split_factor=strided_split_factor(w))
            cols.append(((r, w, r) + (out_plc,) * n_extra, out_plc))
        if not n_extra and is_strided_shard(x) and x.dim in (1, -1):
            # a contraction over packed features (the backward of a packed layer: its output's
            # gradient times the weight transposed), strided alike on both sides
            sf = strided_split_factor(x)
            cols.append(((x, StridedShard(1, split_factor=sf), r), p))
        per_dim.append(cols)
    out = []
    any_strides = op.name() != "aten::_grouped_mm"  # the fallback takes any strides
    for combo in itertools.product(*per_dim):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(len(tensors)))
        if any_strides or _keeps_16_byte_rows(tensors[:2], ins[:2], device_mesh.shape):
            out.append((ins, (tuple(c[1] for c in combo),)))
    return out


def _keeps_16_byte_rows(tensors, placements, mesh_shape) -> bool:
    """aten._grouped_mm wants every operand's row stride a multiple of 16 bytes: a shard of a
    last-two dim must keep that where the whole tensor has it (bf16 features 32 over 4 ranks: 8
    each, 16 bytes; over 8 ranks: 4, which the kernel refuses; an uneven split is refused)."""
    for t, plc in zip(tensors, placements):
        ways: dict[int, int] = {}
        for m, p in enumerate(plc):
            if isinstance(p, Shard) or is_strided_shard(p):
                d = p.dim % t.ndim
                ways[d] = ways.get(d, 1) * mesh_shape[m]
        for d, k in ways.items():
            if d < t.ndim - 2:
                continue
            size = t.shape[d] * t.element_size()
            if size % 16 == 0 and (t.shape[d] % k or (t.shape[d] // k) * t.element_size() % 16):
                return False
    return True


# split / chunk of a dim strided in sf pieces (packed weights' outputs: gate and up fused), into
# those sf pieces: each piece is the plain shard of its part (the pieces were cut before the
# ranks' chunks), so no redistribution is needed; DTensor has no such rule
STRIDED_SPLIT_OPS = frozenset({aten.split.Tensor, aten.split_with_sizes.default})


def _split_pieces(op, args) -> tuple[int, int]:
    """(dim, number of equal pieces) of a split, (dim, 0) where the pieces differ."""
    x, size = args[0], args[1]
    dim = args[2] if len(args) > 2 else 0
    dim %= max(x.ndim, 1)
    n = x.shape[dim]
    if op is aten.split_with_sizes.default:
        sizes = list(size)
        return dim, len(sizes) if sizes and len(set(sizes)) == 1 else 0
    return dim, n // size if size and n % size == 0 else 0


def strided_split_candidates(
    op: OpOverload, args, kwargs, device_mesh: DeviceMesh, input_placements
) -> list:
    """The candidates a split into a strided dim's pieces adds (see STRIDED_SPLIT_OPS): those of
    the input with the strided mesh dims replicated, with the strided placement in and each
    piece's plain shard out on them."""
    if not input_placements:
        return []
    dim, pieces = _split_pieces(op, args)
    x_plc = list(input_placements[0])
    strided = [
        m
        for m, p in enumerate(x_plc)
        if is_strided_shard(p) and p.dim % args[0].ndim == dim and strided_split_factor(p) == pieces
    ]
    if not strided:
        return []
    plain = [Replicate() if m in strided else p for m, p in enumerate(x_plc)]
    base = dtensor_candidates(op, args, kwargs, device_mesh, [tuple(plain)]) or []
    out = []
    for ins, outs in base:
        if ins[0] is None or any(not ins[0][m].is_replicate() for m in strided):
            continue
        if any(o is None or not o[m].is_replicate() for o in outs for m in strided):
            continue
        new_in = tuple(x_plc[m] if m in strided else p for m, p in enumerate(ins[0]))
        new_outs = tuple(
            tuple(Shard(dim) if m in strided else p for m, p in enumerate(o)) for o in outs
        )
        out.append(((new_in, *ins[1:]), new_outs))
    return out


# row-major reshapes: a dim sharded behind others of the dims it merges with is a strided shard
# of the merged dim (heads sharded in ``[b, h, s, d] -> [b*h, s, d]``, eager attention's matmul),
# and back.  DTensor's view rule knows these from torch 2.12 on; on earlier releases these
# candidates are fxshard's.  Each is checked exactly against the ranks' global indices where it
# is placed (``reshapes_soundly``); duplicates of DTensor's are dropped.
RESHAPE_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


def _reshaped_placement(p, in_shape, out_shape, groups):
    """The output placement of a strided reshape for one mesh dim's input placement ``p``: the
    merged / split dim where the input's piece lands, strided by what lies before it; None where
    ``p`` is a plain shard that stays plain (DTensor's rule covers those) or nothing fits."""
    if not isinstance(p, Shard) and not is_strided_shard(p):
        return p
    sf = strided_split_factor(p) if is_strided_shard(p) else 1
    d = p.dim % len(in_shape)
    for ga, gb in groups:
        if d not in ga:
            continue
        before = sf * math.prod(in_shape[e] for e in ga[: ga.index(d)])
        for i in range(len(gb) - 1, -1, -1):
            pre = math.prod(out_shape[e] for e in gb[:i])
            if before % pre == 0:
                out_sf = before // pre
                return Shard(gb[i]) if out_sf == 1 else StridedShard(gb[i], split_factor=out_sf)
        return None
    return None


def strided_reshape_candidates(args, device_mesh: DeviceMesh, input_placements, found) -> list:
    """The reshape candidates with a strided shard on either side that ``found`` lacks: from every
    shard of an input dim (and the input's own strided placements) per mesh dim, the output
    placement the reshape gives it."""
    x, shape = args[0], args[1]
    in_shape = list(x.shape)
    out_shape = list(shape)
    if -1 in out_shape:
        known = math.prod(n for n in out_shape if n != -1)
        out_shape[out_shape.index(-1)] = math.prod(in_shape) // known if known else 0
    if not all(isinstance(n, int) for n in (*in_shape, *out_shape)):
        return []
    groups = reshape_groups(in_shape, out_shape)
    if groups is None:
        return []
    per_mesh = []
    for m in range(device_mesh.ndim):
        opts = [Replicate(), *(Shard(d) for d in range(len(in_shape)) if in_shape[d] > 1)]
        own = input_placements[0][m] if input_placements and input_placements[0] else None
        if own is not None and (is_strided_shard(own) or own.is_partial()):
            opts.append(own)
        per_mesh.append(opts)
    have = {(tuple(ins[0]), tuple(outs[0])) for ins, outs in found if ins[0] and outs[0]}
    extra = []
    for plc in itertools.product(*per_mesh):
        out = tuple(_reshaped_placement(p, in_shape, out_shape, groups) for p in plc)
        if any(o is None for o in out):
            continue
        if not any(is_strided_shard(p) for p in (*plc, *out)) or (plc, out) in have:
            continue
        if sum(isinstance(p, Shard) or is_strided_shard(p) for p in plc) > 1:
            continue  # one mesh dim at a time: torch 2.11's auto plans of a sequence sharded on
            # two mesh dims got worse (231 us vs 108 with 2.13's rule) with the 2-d ones
        dims = [p.dim for p in out if isinstance(p, Shard) or is_strided_shard(p)]
        if len(set(dims)) < len(dims):
            continue  # two mesh dims on one output dim: their order is DTensor's to state
        extra.append(((plc,), (out,)))
    return extra


STRIDED_CAT = aten.cat.default


def strided_cat_candidates(args, kwargs, device_mesh: DeviceMesh, input_placements) -> list:
    """``cat`` of n equal pieces each sharded on the joined dim (the backward of the split
    above): the result is the dim strided in n, locally the pieces' shards side by side."""
    tensors = list(args[0])
    if len(tensors) < 2 or len(input_placements) != len(tensors):
        return []
    x = tensors[0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % max(x.ndim, 1)
    if any(t.shape != x.shape for t in tensors):
        return []
    sharded = [
        m
        for m in range(device_mesh.ndim)
        if all(
            isinstance(p[m], Shard) and not is_strided_shard(p[m]) and p[m].dim % x.ndim == dim
            for p in input_placements
        )
    ]
    if not sharded:
        return []
    plain = [tuple(Replicate() if m in sharded else q for m, q in enumerate(p))
             for p in input_placements]  # fmt: skip
    base = dtensor_candidates(aten.cat.default, args, kwargs, device_mesh, plain) or []
    strided = StridedShard(dim, split_factor=len(tensors))
    out = []
    for ins, outs in base:
        if any(i is None or not i[m].is_replicate() for i in ins for m in sharded):
            continue
        if outs[0] is None or any(not outs[0][m].is_replicate() for m in sharded):
            continue
        new_ins = tuple(
            tuple(Shard(dim) if m in sharded else q for m, q in enumerate(i)) for i in ins
        )
        new_out = tuple(strided if m in sharded else q for m, q in enumerate(outs[0]))
        out.append((new_ins, (new_out, *outs[1:])))
    return out


# index_put: torch 2.11's DTensor rule (a strategy function, before the single-dim rules of 2.12)
# keeps self sharded on an indexed dim when values has as many dims as self, which is wrong (the
# checker finds it); where DTensor has no single-dim rule for it, this one is used instead
INDEX_PUT_OPS = frozenset({aten.index_put.default, aten._index_put_impl_.default})


def index_put_candidates(args, kwargs, device_mesh: DeviceMesh) -> list:
    """``index_put(self, indices, values, accumulate)``: indices replicated; self sharded on a dim
    after every indexed one, values on the dim it aligns with from the right (unbroadcast); with
    ``accumulate``, self and values partial too (a scatter-add is linear in both)."""
    x, indices, values = args[0], list(args[1]), args[2]
    accumulate = bool(args[3]) if len(args) > 3 else bool(kwargs.get("accumulate", False))
    # the dims of self an index covers: one, or as many as a boolean mask has
    covered, d = [], 0
    for t in indices:
        if t is not None and t.dtype in (torch.bool, torch.uint8):
            covered += range(d, d + t.ndim)
            d += t.ndim
        else:
            if t is not None:
                covered.append(d)
            d += 1
    n_idx = sum(t is not None for t in indices)
    columns = [(Replicate(), Replicate())]  # (self and output, values)
    for d in range(max(covered, default=-1) + 1, x.ndim):
        vd = d - x.ndim + values.ndim
        if vd >= 0 and values.shape[vd] == x.shape[d]:
            columns.append((Shard(d), Shard(vd)))
    if accumulate:
        columns.append((Partial("sum"), Partial("sum")))
    out = []
    for combo in itertools.product(columns, repeat=device_mesh.ndim):
        self_plc = tuple(c[0] for c in combo)
        rep = (Replicate(),) * device_mesh.ndim
        ins = (self_plc,) + (rep,) * n_idx + (tuple(c[1] for c in combo),)
        out.append((ins, (self_plc,)))
    return out
