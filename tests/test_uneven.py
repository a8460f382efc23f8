"""Uneven shards: every placement DTensor accepts for shapes the mesh does not divide, through
capture, annotate, lower and simulate, against single device; nothing falls back to replicated.

Local shards follow torch.chunk as DTensor does (the last ranks hold less, or nothing); the program
is lowered per rank where shapes differ (``ShardedProgram.uneven``)."""

import logging
import random
import tempfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_redistribute_sweep import all_placements, nondefault_order
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel

import fxshard
from fxshard import zoo
from fxshard.core.spec import ShardingSpec, placements_str
from fxshard.ir import info

# ---- identity programs: an input placed one way, the output another ---------------------------

SWEEP = [((3,), (7, 5)), ((3,), (2, 4)), ((2, 3), (5, 7)), ((3, 2), (7, 5)), ((2, 2, 2), (3, 5))]


def _pairs(mesh, shape, n, seed):
    pls = all_placements(len(mesh), len(shape))
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        src, dst = rng.choice(pls), rng.choice(pls)
        order = nondefault_order(src) if rng.random() < 0.3 else None
        out.append((src, dst, order))
    return out


def _identity(x):
    return x


@pytest.mark.parametrize("mesh,shape", SWEEP, ids=[f"{m}-{s}" for m, s in SWEEP])
def test_uneven_identity_programs(mesh, shape):
    """Explicit uneven ``input_placements`` / ``output_placements`` (Partial and non-default shard
    orders included): the program keeps both as asked and is exact on simulated ranks."""
    spec_mesh = fxshard.MeshSpec(mesh)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    uneven = 0
    for src, dst, order in _pairs(mesh, shape, 24, seed=hash((mesh, shape)) % 1000):
        given = ShardingSpec.make(spec_mesh, src, shape, torch.float32, order)
        prog = fxshard.shard(
            _identity, spec_mesh, example_inputs=(full,), input_placements=[given],
            output_placements=[dst],
        )  # fmt: skip
        assert not prog.warnings, prog.warnings
        (ph,) = prog.placeholders
        assert info(ph).spec == given
        assert tuple(prog.output_specs[0].placements) == tuple(dst)
        uneven += prog.uneven
        got = prog.simulate(full)
        what = f"{placements_str(src)} (order {order}) -> {placements_str(dst)}"
        if any(p.is_partial() for p in (*src, *dst)):
            torch.testing.assert_close(got, full, rtol=1e-6, atol=1e-6, msg=what)
        else:
            assert torch.equal(got, full), what
    assert uneven, "no sampled pair was uneven"


# ---- ops over uneven dims ----------------------------------------------------------------------


def _ops(x):
    a = x.softmax(0) * x.cumsum(1)
    return (
        a.reshape(-1),
        a.sum(0) + x.amax(1).sum(),
        x.mean(0),
        x.argmax(0),
        x.sort(1).values,
        x.topk(2, 0).values,
        (x.t() @ x).tanh(),
    )


@pytest.mark.parametrize(
    "mesh,placements",
    [((3,), (Shard(0),)), ((3,), (Shard(1),)), ((2, 3), (Shard(0), Shard(1))),
     ((3, 2), (Shard(1), Shard(0))), ((2, 2, 2), (Shard(0), Replicate(), Shard(1)))],
    ids=str,
)  # fmt: skip
def test_reductions_and_contractions_over_uneven_dims(mesh, placements):
    """Softmax, cumsum, sum, max, mean, argmax, sort, topk, a contraction and a flattening view
    over dims split 3, 3, 1 (7 rows on 3 ranks) and 2, 2, 1: equal to single device."""
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    prog = fxshard.shard(
        _ops, fxshard.MeshSpec(mesh), example_inputs=(x,), input_placements=[placements]
    )
    assert not prog.warnings and prog.uneven
    for got, want in zip(prog.simulate(x), _ops(x)):
        if want.dtype == torch.long:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- models -------------------------------------------------------------------------------------


class WithLoss(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels):
        return F.cross_entropy(self.model(tokens).flatten(0, 1), labels.flatten())


def _prefixed(plan, prefix="model."):
    return {prefix + k: v for k, v in plan.items()}


def _check_model(model, plan, mesh, tokens, caplog):
    """Forward and training equal single device, with no fallback and every parameter placed as
    the plan says; returns the training program."""
    labels = torch.randint(0, model.cfg.vocab_size, tokens.shape, generator=torch.Generator())
    wrapped = WithLoss(model)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        fwd = fxshard.shard(model, mesh, plan, example_inputs=(tokens,))
        train = fxshard.shard(
            wrapped, mesh, _prefixed(plan), example_inputs=(tokens, labels), training=True
        )
    assert not fwd.warnings and not train.warnings
    assert "replicat" not in caplog.text.lower(), caplog.text
    with torch.no_grad():
        torch.testing.assert_close(fwd.simulate(tokens), model(tokens), rtol=1e-5, atol=1e-5)
    loss, grads = train.simulate(tokens, labels)
    wrapped.zero_grad()
    ref = wrapped(tokens, labels)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    for fqn, p in wrapped.named_parameters():
        torch.testing.assert_close(grads[fqn], p.grad, rtol=1e-4, atol=1e-6, msg=fqn)
    return fwd, train


def _spec(prog, fqn):
    return next(info(p).spec for p in prog.placeholders if info(p).fqn == fqn)


def test_uneven_llama_on_tp4(caplog):
    """Vocabulary 1001, hidden 96, 6 heads (3 kv heads), ffn 250 on 4 ranks, vocab-parallel
    embedding and lm_head: every plan entry's placement, unevenly, exact forward and gradients."""
    model = zoo.init_weights(zoo.Llama(zoo.uneven_config()))
    tokens = torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(2))
    mesh = fxshard.MeshSpec((4,), ("tp",))
    fwd, train = _check_model(model, zoo.vocab_parallel_plan(), mesh, tokens, caplog)
    assert fwd.uneven and train.uneven
    emb = _spec(fwd, "tok_embeddings.weight")
    assert placements_str(emb.placements) == "S(0)"
    assert [emb.local_shape((r,))[0] for r in range(4)] == [251, 251, 251, 248]
    w1 = _spec(fwd, "layers.0.feed_forward.w1.weight")
    assert [w1.local_shape((r,))[0] for r in range(4)] == [63, 63, 63, 61]
    assert placements_str(_spec(fwd, "output.weight").placements) == "S(0)"
    text = fwd.explain()
    assert "[d0 251x3,248]" in text and "per-rank graphs" in text


def test_uneven_batch_on_dp_tp(caplog):
    """A batch of 3 on dp=2 (2 and 1 rows) with tensor parallelism on the other mesh dim."""
    model = zoo.init_weights(zoo.Llama(zoo.uneven_config()))
    tokens = torch.randint(0, 1001, (3, 8), generator=torch.Generator().manual_seed(3))
    mesh = fxshard.MeshSpec((2, 2), ("dp", "tp"))
    fwd, _ = _check_model(model, zoo.megatron_tp_plan(), mesh, tokens, caplog)
    (tok,) = [p for p in fwd.placeholders if info(p).kind == "input"]
    assert placements_str(info(tok).spec.placements) == "S(0)R"
    assert [info(tok).spec.local_shape((c, 0))[0] for c in range(2)] == [2, 1]


def test_sequence_length_one_under_sequence_parallelism(caplog):
    """A decode step (sequence length 1) under the sequence-parallel plan on 4 ranks: the
    sequence-sharded activations hold 1, 0, 0, 0 positions; ops that cannot run on an empty shard
    take another placement; exact."""
    model = zoo.init_weights(zoo.Llama(zoo.uneven_config()))
    tokens = torch.randint(0, 1001, (2, 1), generator=torch.Generator().manual_seed(4))
    mesh = fxshard.MeshSpec((4,), ("tp",))
    fwd, _ = _check_model(model, zoo.sequence_parallel_plan(), mesh, tokens, caplog)
    assert fwd.uneven


def test_vocab_parallel_embedding_of_50257_rows():
    """GPT-2's vocabulary on 4 ranks (12565 x 3 + 12562 rows): the masked lookups and the
    gradient of every row equal single device."""
    model = zoo.init_weights(nn.Sequential(nn.Embedding(50257, 8), nn.Linear(8, 3)))
    ids = torch.tensor([[0, 12564, 12565, 50256], [37695, 37694, 25130, 50000]])
    plan = {"0": RowwiseParallel(input_layouts=Replicate())}
    prog = fxshard.shard(model, fxshard.MeshSpec((4,)), plan, example_inputs=(ids,), training=True)
    assert not prog.warnings
    w = _spec(prog, "0.weight")
    assert [w.local_shape((r,))[0] for r in range(4)] == [12565] * 3 + [12562]
    g = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(5))
    out, grads = prog.simulate(ids, grad_outputs=[g])
    model.zero_grad()
    ref = model(ids)
    ref.backward(g)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads["0.weight"], model[0].weight.grad, rtol=1e-6, atol=1e-6)
    assert grads["0.weight"][ids.flatten()].abs().sum() > 0


def test_uneven_programs_lower_per_rank():
    """Ranks whose local shapes differ get their own per-rank graph (lowered with their
    coordinate); ranks with equal shapes share one; collectives pad to the largest chunk."""
    x = torch.randn(7, 5)
    prog = fxshard.shard(
        lambda x: x * 2, fxshard.MeshSpec((3,)), example_inputs=(x,),
        input_placements=[(Shard(0),)], output_placements=[(Replicate(),)],
    )  # fmt: skip
    assert prog.uneven
    assert prog.local_shape_classes() == [[(0,), (1,)], [(2,)]]
    g0, g2 = prog.local_graph_on(None, (0,)), prog.local_graph_on(None, (2,))
    shapes = [
        [tuple(n.meta["val"].shape) for n in g.graph.nodes if n.op == "placeholder"][1]
        for g in (g0, g2)
    ]
    assert shapes == [(3, 5), (1, 5)]
    (c,) = prog.collectives()
    assert c.kind == "all_gather" and c.padding == 13  # 60 B buffers, 46.7 B of data on average
    even = fxshard.shard(
        lambda x: x * 2, fxshard.MeshSpec((3,)), example_inputs=(torch.randn(6, 5),),
        input_placements=[(Shard(0),)], output_placements=[(Replicate(),)],
    )  # fmt: skip
    assert not even.uneven and even.collectives()[0].padding == 0
    assert "uneven" not in even.explain()


@pytest.mark.slow
def test_uneven_model_on_gloo_ranks():
    """4 real gloo ranks, Inductor: the uneven Llama's compiled forward shard, two SGD steps through
    the backend under loss.backward() (forward and backward), and fxshard.parallelize's DTensor
    parameters and outputs in torch's own uneven layout, all equal to single device."""
    import e2e_workers

    from fxshard.runtime.launch import spawn

    with tempfile.TemporaryDirectory() as d:
        results = spawn(4, e2e_workers.uneven_model, d, timeout=600)
    for rank, r in enumerate(results):
        rows = 248 if rank == 3 else 251
        assert r["program"]["uneven"] and r["program"]["local"] == (2, 8, rows)
        assert r["program"]["err"] < 1e-5, r
        a, b, c, d = r["train"]["losses"]
        assert abs(a - b) < 1e-5 * abs(a) and abs(c - d) < 1e-5 * abs(c), r["train"]
        assert r["train"]["rel"] < 1e-5, r["train"]
        p = r["parallelize"]
        assert p["local_rows"] == rows and p["same_as_torch"], p
        assert p["logits"] == ((2, 8, rows), (2, 8, 1001)) and p["err"] < 1e-5, p
        d = r["dcp"]  # a torch checkpoint's uneven shards line up with fxshard's, both ways
        assert d["from_torch_err"] < 1e-5 and d["into_torch_err"] == 0.0 and d["keys"] >= 10, d


@pytest.mark.parametrize("rows", [(12, 6), (10, 7)], ids=["even", "uneven"])
def test_gather_with_a_shorter_index_is_not_split_alike(rows):
    """``x.gather(1, idx)`` with fewer index rows than ``x`` rows: DTensor's rule splits both along
    the rows, so each rank would gather from rows its index does not address; those candidates are
    excluded (inputs split along one dim by one mesh dim must share its size)."""
    g = torch.Generator().manual_seed(0)
    x, idx = torch.randn(rows[0], 5, generator=g), torch.randint(0, 5, (rows[1], 2), generator=g)

    def f(x, idx):
        return x.gather(1, idx) * 2

    prog = fxshard.shard(
        f, fxshard.MeshSpec((3,)), example_inputs=(x, idx),
        input_placements=[(Shard(0),), (Shard(0),)], output_placements=[(Shard(0),)],
    )  # fmt: skip
    assert torch.equal(prog.simulate(x, idx), f(x, idx))


# ---- ops a review found failing on uneven shards -------------------------------------------------


def _view_bf16(x):
    return x.view(torch.bfloat16) * 2


def _fresh_strided(x):
    return x.new_empty_strided((5, 4), (4, 1)).fill_(1.0) + x


def _take_along(x, i):
    return torch.take_along_dim(x, i, dim=1)


@pytest.mark.parametrize(
    "fn,inputs,placements",
    [
        (_view_bf16, [(4, 5)], [(Shard(1),)]),  # 3, 2 float columns are 6, 4 bf16 ones, not 5, 5
        (_view_bf16, [(5, 4)], [(Shard(0),)]),
        (_fresh_strided, [(5, 4)], [(Shard(0),)]),  # local strides of per-rank sizes
        (_take_along, [(5, 4), "index"], [(Shard(0),), (Shard(0),)]),
    ],
    ids=["view-dtype-cols", "view-dtype-rows", "new-empty-strided", "take-along-dim"],
)
def test_ops_on_uneven_shards_equal_single_device(fn, inputs, placements):
    g = torch.Generator().manual_seed(0)
    xs = [
        torch.randint(0, 4, (5, 3), generator=g) if s == "index" else torch.randn(s, generator=g)
        for s in inputs
    ]
    for mesh in ((2,), (3,)):
        prog = fxshard.shard(
            fn, fxshard.MeshSpec(mesh), example_inputs=tuple(xs), input_placements=placements
        )
        torch.testing.assert_close(prog.simulate(*xs), fn(*xs))


def test_bf16_grouped_mm_shards_keep_16_byte_rows():
    """aten._grouped_mm refuses operands whose row stride is not a multiple of 16 bytes: a weight
    with 32 bf16 output features splits over 2 and 4 ranks, not over 8 or unevenly over 3 (those
    meshes compute its output another way)."""

    def experts(a, w, offs):
        return torch._grouped_mm(a, w, offs=offs) * 2

    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 32, generator=g).bfloat16()
    w = torch.randn(2, 32, 32, generator=g).bfloat16()
    offs = torch.tensor([4, 8], dtype=torch.int32)
    for mesh, dim in (((2,), 2), ((4,), 2), ((8,), 2), ((8,), 1), ((3,), 2)):
        prog = fxshard.shard(
            experts, fxshard.MeshSpec(mesh), example_inputs=(a, w, offs),
            input_placements=[None, (Shard(dim),), None],
        )  # fmt: skip
        torch.testing.assert_close(prog.simulate(a, w, offs), experts(a, w, offs))
