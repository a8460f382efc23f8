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
    return Counter(c.kind for c in prog.collectives() if mesh_dims is None or c.mesh_dims == mesh_dims)


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
    # 2 all-gathers + 2 reduce-scatters per layer, plus the embedding's reduce-scatter (vocab-parallel
    # lookup handed on sequence-sharded) and the lm_head's all-gather of its sequence-sharded input
    assert counts(prog) == Counter({"all_gather": 2 * 2 + 1, "reduce_scatter": 2 * 2 + 1})


@pytest.mark.parametrize("mesh", [M1_4, M2_24], ids=str)
def test_llama_vocab_and_loss_parallel(mesh):
    prog = check(Llama(), vocab_parallel_plan(), mesh)
    assert not prog.warnings
    # the vocab-parallel embedding adds one all-reduce; the loss-parallel lm_head keeps its output
    # sharded on the vocab dim (no gather)
    assert counts(prog) == Counter({"all_reduce": 4 + 1})
    out_spec = [n for n in prog.graph.graph.nodes if n.op == "output"][0].meta["fxshard"].input_specs[0]
    assert out_spec.placements[-1] == Shard(2)


@pytest.mark.parametrize("mesh", [M1_2, M2_22], ids=str)
def test_pure_data_parallel(mesh):
    names = mesh.names
    dp_mesh = fxshard.MeshSpec(mesh.shape, names=tuple("dp" + str(i) for i in range(mesh.ndim)) if names else None)
    model = Llama()
    prog = check(model, None, dp_mesh, input_placements=[tuple(Shard(0) if i == 0 else Replicate()
                                                                for i in range(mesh.ndim))])
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
    prog = fxshard.shard(f, M2_22, example_inputs=(x,), input_placements=[(Shard(0), Shard(1))],
                         output_placements=[(Shard(0), Replicate())])
    torch.testing.assert_close(prog.simulate(x), f(x), rtol=1e-5, atol=1e-5)


def test_uneven_model_falls_back_with_warnings(caplog):
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = check(UnevenMLP(), mlp_plan(), M1_4, inputs=(torch.randn(3, 5, 10),))
    assert any("does not divide evenly" in w for w in prog.warnings)
    assert "fc1.weight" in caplog.text


# ---- errors ---------------------------------------------------------------------------------------

def test_unknown_fqn_lists_closest():
    with pytest.raises(ValueError, match=r"matches no module.*closest existing FQNs: \['fc1'"):
        fxshard.shard(MLP(), M1_2, {"fc_1": ColwiseParallel()}, example_inputs=example_input(MLP()))


def test_style_that_cannot_apply():
    with pytest.raises(ValueError, match="ColwiseParallel applies to nn.Linear"):
        fxshard.shard(Llama(), M1_2, {"norm": ColwiseParallel()}, example_inputs=example_input(Llama()))


def test_shard_dim_out_of_range():
    with pytest.raises(ValueError, match="tensor dim 3, out of range for a 2-D tensor"):
        fxshard.shard(lambda x: x * 2, M1_2, example_inputs=(torch.randn(4, 4),), input_placements=[(Shard(3),)])


def test_placement_count_mismatch():
    with pytest.raises(ValueError, match="1 placements for a 2-D mesh"):
        fxshard.shard(lambda x: x * 2, M2_22, example_inputs=(torch.randn(4, 4),), input_placements=[(Shard(0),)])


def test_two_d_mesh_plan_needs_names():
    with pytest.raises(ValueError, match="needs named mesh dims"):
        fxshard.shard(MLP(), fxshard.MeshSpec((2, 2)), mlp_plan(), example_inputs=example_input(MLP()))


def test_op_without_rule_warns_and_replicates(caplog):
    boundaries = torch.tensor([-1.0, 0.0, 0.5, 2.0])

    def f(x):
        return torch.searchsorted(boundaries, x * 2).float() + x

    x = torch.randn(8, 4)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = fxshard.shard(f, M1_2, example_inputs=(x,), input_placements=[(Shard(0),)])
    assert "aten.searchsorted.Tensor" in caplog.text and "has no sharding rule" in caplog.text
    assert "test_shard.py" in caplog.text  # names the source line
    torch.testing.assert_close(prog.simulate(x), f(x))


@torch.library.custom_op("fxshard_test::cumulative", mutates_args=())
def cumulative(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) * 1.5


@cumulative.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_op_without_rule_is_an_error():
    with pytest.raises(ValueError, match=r"custom op with no sharding rule; register one, e.g. fxshard.register_rule"):
        fxshard.shard(lambda x: cumulative(x * 2) + 1, M1_2, example_inputs=(torch.randn(8, 4),),
                      input_placements=[(Shard(0),)])


def test_rule_leaving_a_read_output_unplaced_is_skipped(monkeypatch, caplog):
    """A rule (torch versions differ here) that gives a tensor output no placement cannot be chosen
    when something reads that output: the next candidate, or the replicated fallback, is taken
    instead of handing consumers nothing (seen as a crash on torch 2.11)."""
    from fxshard import strategies

    real = strategies.candidates
    relu = torch.ops.aten.relu.default

    def patched(op, args, kwargs, device_mesh, input_placements):
        out = real(op, args, kwargs, device_mesh, input_placements)
        if op is relu and out not in (None, "factory"):
            return [(ins, (None,)) for ins, _ in out]  # every candidate leaves the output unplaced
        return out

    monkeypatch.setattr(strategies, "candidates", patched)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    m = M()
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = fxshard.shard(m, fxshard.MeshSpec((2,)), plan={"fc": ColwiseParallel()}, example_inputs=(x,))
    assert any("relu" in r.getMessage() and "replicated" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(prog.simulate(x), m(x), rtol=1e-5, atol=1e-5)
