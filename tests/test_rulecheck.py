"""The rule checker: every strategy fxshard would use for the ops of real training steps (Llama,
GPT-2, a mixture of experts, a CNN) agrees with single device on simulated ranks; a wrong rule is
caught, excluded, and no longer planned."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.placement_types import Replicate, Shard

import fxshard
from fxshard import rules, zoo
from fxshard.rules import dims, excluded
from fxshard.runtime import rulecheck


def _hf(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "gpt2":  # Conv1D layers, gelu_new, learned positions, tied embeddings
        cfg = transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:  # Mixtral: top-2 routing over 4 experts (grouped matmuls), GQA attention
        cfg = transformers.MixtralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
            max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(cfg)
    return model, (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)),)


def _model(name):
    if name in ("gpt2", "moe"):
        return _hf(name)
    model = zoo.init_weights(zoo.Llama(zoo.LlamaConfig()) if name == "llama" else zoo.ConvNet())
    return model, zoo.example_input(model, generator=torch.Generator().manual_seed(1))


def _step(model, inputs):
    def run():
        out = model(*inputs)
        out = getattr(out, "logits", out)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()

    return run


def _with_negative_dims(calls):
    out = list(calls)
    for op, a, k in calls:
        na, nk = dims.negate_dims(op, a, k)
        if (na, nk) != (tuple(a), dict(k)):
            out.append((op, na, nk))
    return out


@pytest.mark.parametrize("name", ["llama", "gpt2", "moe", "convnet"])
def test_the_strategies_of_a_training_step_are_right(name):
    model, inputs = _model(name)
    calls = rulecheck.unique_calls(rulecheck.record_calls(_step(model, inputs)), per_op=2)
    # what fxshard offers: DTensor's rules less the table of strategies found wrong
    # (``scripts/rule_check.py --merge --write`` on each release; torch 2.11's layer-norm backward
    # rule proposes some)
    report = rulecheck.check_calls(_with_negative_dims(calls), exclude=True)
    assert report.wrong == [], str(report)
    # the check ran: many ops, and many non-replicated strategies of each
    assert len(report.ops) >= 19 and report.checked >= 20 * len(report.ops), str(report)


def test_dim_normalisation_is_what_makes_a_negative_dim_scan_right(monkeypatch):
    x = torch.randn(4, 8)
    cumsum = torch.ops.aten.cumsum.default
    assert rulecheck.check_rule(cumsum, [((x, -1), {})], exclude=False).wrong == []
    # DTensor's scan rule sees the raw dim: without normalising it, the checker sees shards that
    # scan alone
    monkeypatch.setattr(rules, "normalize_dims", lambda op, a, k: (tuple(a), dict(k)))
    wrong = rulecheck.check_rule(cumsum, [((x, -1), {})], exclude=False).wrong
    if not wrong and rules.dtensor_candidates(
        cumsum, (x, -1), {}, rules.rules_mesh((2,)), [(Replicate(),)]
    ) == rules.dtensor_candidates(cumsum, (x, 1), {}, rules.rules_mesh((2,)), [(Replicate(),)]):
        pytest.skip("this torch release's scan rule normalises the dim itself (2.14+)")
    assert any("S(1)" in w.strategy for w in wrong), wrong


torch.library.define("fxshard_test::rowcumsum", "(Tensor x) -> Tensor")


@torch.library.impl("fxshard_test::rowcumsum", "CompositeExplicitAutograd")
def _rowcumsum(x):
    return x.cumsum(1)


@torch.library.register_fake("fxshard_test::rowcumsum")
def _rowcumsum_fake(x):
    return torch.empty_like(x)


class _RowCumsum(nn.Module):
    def forward(self, x):
        return torch.ops.fxshard_test.rowcumsum(x * 2)


def test_a_wrong_user_rule_is_caught_excluded_and_not_planned():
    op = torch.ops.fxshard_test.rowcumsum.default
    # rows may shard (right); the scanned dim may not (wrong: each shard would scan alone)
    fxshard.register_rule(op, [((Shard(0),), (Shard(0),)), ((Shard(1),), (Shard(1),))])
    try:
        x = torch.randn(4, 8)
        report = fxshard.check_rule(op, [((x,), {})])
        assert [w.strategy for w in report.wrong if w.mesh == (2,)] == ["in: [S(1)] out: [S(1)]"]
        assert "[S(0)]" not in str(report)
        assert excluded.is_excluded(op, (((Shard(1),),), ((Shard(1),),))) is not None
        assert excluded.is_excluded(op, (((Shard(0),),), ((Shard(0),),))) is None
        # planned with the input sharded on the scanned dim: the op now moves it, and is right
        prog = fxshard.shard(
            _RowCumsum(), (2,), {}, example_inputs=(x,), input_placements=[(Shard(1),)]
        )
        assert torch.allclose(prog.simulate(x), _RowCumsum()(x), atol=1e-5)
        node = next(n for n in prog.global_graph.graph.nodes if n.target is op)
        assert node.meta["fxshard"].spec.placements != (Shard(1),)
        # a rule registered anew is checked anew
        fxshard.register_rule(op, [((Shard(0),), (Shard(0),)), ((Replicate(),), (Replicate(),))])
        assert excluded.excluded(op) == {str(op): {}}
    finally:
        fxshard.unregister_rule(op)


def test_the_committed_exclusions_are_loaded():
    table = excluded.excluded()
    # fill_ of a Partial value fills every addend (k times the value): found by the op_db sweep
    assert any("fill_" in op for op in table), sorted(table)
    plc = (torch.distributed.tensor.placement_types.Partial(),)
    assert excluded.is_excluded(torch.ops.aten.fill_.Scalar, ((plc,), (plc,))) is not None


def test_the_grouped_matmul_stand_ins_rules_are_right():
    """fxshard's traceable stand-ins for transformers' grouped_mm_fallback (its forward and the
    two ops of its backward) against single device, every strategy, experts with no rows
    included."""
    from fxshard.rules.ops import GROUPED_MM, GROUPED_MM_WEIGHT_GRAD

    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(12, 8, generator=g), torch.randn(12, 16, generator=g)
    w = torch.randn(3, 8, 16, generator=g)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)  # expert 1 gets nothing, rows 10+ none
    for op, args in ((GROUPED_MM, (x, w, offs)), (GROUPED_MM_WEIGHT_GRAD, (x, dy, offs))):
        report = rulecheck.check_rule(op, [(args, {})], meshes=[(2,), (2, 2)], exclude=False)
        assert report.checked > 0 and not report.wrong, report
