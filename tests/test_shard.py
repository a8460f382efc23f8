"""fxshard.shard on the model zoo: simulated sharded results equal single device."""

import logging
from collections import Counter

import pytest
import torch
from models import (
    MLP,
    ConvNet,
    Llama,
    MegatronMLP,
    MultiHeadAttention,
    UnevenMLP,
    attention_plan,
    example_input,
    init_weights,
    megatron_mlp_plan,
    megatron_tp_plan,
    mlp_plan,
    sequence_parallel_plan,
    vocab_parallel_plan,
)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import fxshard
from fxshard.core.spec import placements_str
from fxshard.ir import info

M1_2 = fxshard.MeshSpec((2,))
M1_4 = fxshard.MeshSpec((4,))
M2_22 = fxshard.MeshSpec((2, 2), names=("dp", "tp"))
M2_24 = fxshard.MeshSpec((2, 4), names=("dp", "tp"))


def check(model, plan, mesh, inputs=None, **kw):
    model = init_weights(model)
    inputs = inputs or example_input(model, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(*inputs)
    prog = fxshard.shard(model, mesh, plan, example_inputs=inputs, **kw)
    out = prog.simulate(*inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return prog


def counts(prog, mesh_dims=None):
    return Counter(
        c.kind for c in prog.collectives() if mesh_dims is None or c.mesh_dims == mesh_dims
    )


ZOO = [
    ("mlp", MLP, mlp_plan),
    ("megatron_mlp", MegatronMLP, megatron_mlp_plan),
    ("attention", lambda: MultiHeadAttention(dim=32, n_heads=8), attention_plan),
]


@pytest.mark.parametrize("mesh", [M1_2, M1_4, M2_22, M2_24], ids=str)
@pytest.mark.parametrize("name,factory,plan", ZOO, ids=[z[0] for z in ZOO])
def test_zoo_tp(name, factory, plan, mesh):
    prog = check(factory(), plan(), mesh)
    assert not prog.warnings
    assert counts(prog) == Counter({"all_reduce": 1})


@pytest.mark.parametrize("mesh", [M1_2, M1_4, M2_22, M2_24], ids=str)
def test_llama_megatron(mesh):
    prog = check(Llama(), megatron_tp_plan(), mesh)
    assert not prog.warnings
    # exactly 2 all-reduces per layer, all on the plan's mesh dim
    tp = (mesh.ndim - 1,)
    assert counts(prog) == Counter({"all_reduce": 4})
    assert counts(prog, tp) == Counter({"all_reduce": 4})


@pytest.mark.parametrize("mesh", [M1_2, M1_4, M2_22, M2_24], ids=str)
def test_llama_sequence_parallel(mesh):
    prog = check(Llama(), sequence_parallel_plan(), mesh)
    assert not prog.warnings
    # 2 all-gathers + 2 reduce-scatters per layer, plus the embedding's reduce-scatter
    # (vocab-parallel lookup handed on sequence-sharded) and the lm_head's all-gather of its
    # sequence-sharded input
    assert counts(prog) == Counter({"all_gather": 2 * 2 + 1, "reduce_scatter": 2 * 2 + 1})


@pytest.mark.parametrize("mesh", [M1_4, M2_24], ids=str)
def test_llama_vocab_and_loss_parallel(mesh):
    prog = check(Llama(), vocab_parallel_plan(), mesh)
    assert not prog.warnings
    # the vocab-parallel embedding adds one all-reduce; the loss-parallel lm_head keeps its output
    # sharded on the vocab dim (no gather)
    assert counts(prog) == Counter({"all_reduce": 4 + 1})
    out_spec = (
        [n for n in prog.global_graph.graph.nodes if n.op == "output"][0]
        .meta["fxshard"]
        .input_specs[0]
    )
    assert out_spec.placements[-1] == Shard(2)


@pytest.mark.parametrize("mesh", [M1_2, M2_22], ids=str)
def test_pure_data_parallel(mesh):
    names = mesh.names
    dp_mesh = fxshard.MeshSpec(
        mesh.shape, names=tuple("dp" + str(i) for i in range(mesh.ndim)) if names else None
    )
    model = Llama()
    prog = check(
        model,
        None,
        dp_mesh,
        input_placements=[tuple(Shard(0) if i == 0 else Replicate() for i in range(mesh.ndim))],
    )
    assert counts(prog) == Counter()


def test_convnet_dp_and_tp_head():
    check(ConvNet(), None, M1_2, input_placements=[(Shard(0),)])
    prog = check(ConvNet(), {"fc": ColwiseParallel()}, M2_22)
    assert counts(prog) == Counter()  # batch on dp, the colwise head's output stays sharded on tp
    prog = check(ConvNet(), {"fc": ColwiseParallel(output_layouts=Replicate())}, M2_22)
    assert counts(prog) == Counter({"all_gather": 1})


def test_plain_callable_with_explicit_placements():
    w = torch.randn(16, 8)

    def f(x):
        return torch.relu(x @ w).sum(dim=1, keepdim=True) * 2.0

    x = torch.randn(8, 16)
    prog = fxshard.shard(
        f,
        M2_22,
        example_inputs=(x,),
        input_placements=[(Shard(0), Shard(1))],
        output_placements=[(Shard(0), Replicate())],
    )
    torch.testing.assert_close(prog.simulate(x), f(x), rtol=1e-5, atol=1e-5)


def test_uneven_model_shards_as_planned(caplog):
    """Features 10 -> 14 -> 10 on 4 ranks: the plan's placements, unevenly (torch.chunk's layout:
    14 rows as 4, 4, 4, 2), the even program's one all-reduce, and no fallback."""
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = check(UnevenMLP(), mlp_plan(), M1_4, inputs=(torch.randn(3, 5, 10),))
    assert not prog.warnings and "replicat" not in caplog.text
    assert prog.uneven and counts(prog) == Counter({"all_reduce": 1})
    by_fqn = {info(p).fqn: info(p).spec for p in prog.placeholders if info(p).fqn}
    w1 = by_fqn["fc1.weight"]
    assert placements_str(w1.placements) == "S(0)"
    assert [w1.local_shape((r,)) for r in range(4)] == [(4, 10)] * 3 + [(2, 10)]
    assert placements_str(by_fqn["fc2.weight"].placements) == "S(1)"


# ---- errors --------------------------------------------------------------------------------------


def test_unknown_fqn_lists_closest():
    with pytest.raises(ValueError, match=r"matches no module.*closest existing FQNs: \['fc1'"):
        fxshard.shard(MLP(), M1_2, {"fc_1": ColwiseParallel()}, example_inputs=example_input(MLP()))


def test_style_that_cannot_apply():
    with pytest.raises(ValueError, match="ColwiseParallel applies to nn.Linear"):
        fxshard.shard(
            Llama(), M1_2, {"norm": ColwiseParallel()}, example_inputs=example_input(Llama())
        )


def test_shard_dim_out_of_range():
    with pytest.raises(ValueError, match="tensor dim 3, out of range for a 2-D tensor"):
        fxshard.shard(
            lambda x: x * 2,
            M1_2,
            example_inputs=(torch.randn(4, 4),),
            input_placements=[(Shard(3),)],
        )


def test_placement_count_mismatch():
    with pytest.raises(ValueError, match="1 placements for a 2-D mesh"):
        fxshard.shard(
            lambda x: x * 2,
            M2_22,
            example_inputs=(torch.randn(4, 4),),
            input_placements=[(Shard(0),)],
        )


def test_two_d_mesh_plan_needs_names():
    with pytest.raises(ValueError, match="needs named mesh dims"):
        fxshard.shard(
            MLP(), fxshard.MeshSpec((2, 2)), mlp_plan(), example_inputs=example_input(MLP())
        )


def test_llama_sequence_on_two_mesh_dims_fuses():
    """On a 2-D (dp, tp) mesh with the sequence sharded over both dims (dp x cp-like), gathers and
    scatters run over the flattened mesh: fewer collectives, same numbers."""
    model = init_weights(Llama())
    x = example_input(model, batch=2, seq=16)
    mesh = fxshard.MeshSpec((2, 2), names=("dp", "tp"))
    kw = dict(example_inputs=x, input_placements=[(Shard(1), Shard(1))])
    plain = fxshard.shard(model, mesh, None, multi_dim_collectives=False, **kw)
    fused = fxshard.shard(model, mesh, None, **kw)
    before, after = len(plain.collectives()), len(fused.collectives())
    if any(c.mesh_dims == (0, 1) for c in fused.collectives()):  # fused: one instead of two
        assert after < before
    else:  # torch 2.11's rules plan this one with no value moved on both dims: nothing to fuse
        assert after == before and not torch.__version__.startswith("2.13")
    ref = model(*x)
    torch.testing.assert_close(fused.simulate(*x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.simulate(*x), ref, rtol=1e-5, atol=1e-5)
    # (the unfused program's own plan now moves the strided (batch * seq) views by all-to-all, and
    # has no fusion left to miss; the fused one must not report any)
    assert "missed fusion" not in fused.explain()
