"""plan="auto": the global solve against hand plans, memory budgets, partial plans, explanations."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import fxshard
from fxshard import zoo
from fxshard.passes.capture import PARAM, info


def _llama():
    m = zoo.init_weights(zoo.Llama())
    return m, zoo.example_input(m, batch=4)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _params(prog):
    return {info(n).fqn: info(n).spec for n in prog.graph.graph.nodes if info(n).kind == PARAM}


@pytest.mark.parametrize("training", [False, True])
def test_budget_forces_sharding_and_beats_megatron(training):
    m, x = _llama()
    mesh = fxshard.MeshSpec((4,))
    hand = fxshard.shard(m, mesh, plan=zoo.megatron_tp_plan(), example_inputs=x, training=training)
    hc = hand.modelled_cost()
    full = sum(p.numel() * p.element_size() for p in m.parameters()) + \
        sum(b.numel() * b.element_size() for b in m.buffers())
    budget = hc["state_bytes"] * (4 if training else 1)  # training: + gradient + 2 Adam states
    assert hc["state_bytes"] < full  # the budget really forces sharding
    prog = fxshard.shard(m, mesh, plan="auto", example_inputs=x, training=training,
                         auto_options=fxshard.AutoOptions(memory_budget=budget))
    ac = prog.modelled_cost()
    assert ac["total_us"] <= hc["total_us"] + 1e-6
    assert ac["state_bytes"] <= hc["state_bytes"] + 1e-6
    assert prog.captured.auto.memory_bytes <= budget
    assert prog.captured.auto.shared_layers == 1  # layer 1 takes layer 0's decisions
    assert any(s.num_shards > 1 for s in _params(prog).values())
    ref = m(*x)
    if training:
        out, grads = prog.simulate(*x, grad_outputs=(torch.ones_like(ref),))
        ref.backward(torch.ones_like(ref))
        for fqn, p in m.named_parameters():
            assert _rel(grads[fqn], p.grad) < 1e-5, fqn
    else:
        out = prog.simulate(*x)
    assert _rel(out, ref) < 1e-5


def test_no_budget_on_1d_mesh_costs_nothing_for_inference():
    m, x = _llama()
    prog = fxshard.shard(m, fxshard.MeshSpec((4,)), plan="auto", example_inputs=x)
    assert prog.modelled_cost()["comm_us"] == 0.0  # batch-sharded inputs, replicated weights
    assert _rel(prog.simulate(*x), m(*x)) < 1e-5


def test_dp_tp_at_most_the_best_hand_plan():
    m, x = _llama()
    mesh = fxshard.MeshSpec((2, 4), names=("dp", "tp"))
    hands = {}
    for name, plan in [("megatron", zoo.megatron_tp_plan()), ("sequence_parallel", zoo.sequence_parallel_plan()),
                       ("vocab_parallel", zoo.vocab_parallel_plan()), ("data_parallel", None)]:
        hands[name] = fxshard.shard(m, mesh, plan=plan, example_inputs=x).modelled_cost()
    prog = fxshard.shard(m, mesh, plan="auto", example_inputs=x)
    assert prog.modelled_cost()["total_us"] <= min(h["total_us"] for h in hands.values()) + 1e-6
    assert _rel(prog.simulate(*x), m(*x)) < 1e-5
    # under the smallest hand plan's memory as the budget, auto still beats every hand plan that fits it
    budget = min(h["state_bytes"] for h in hands.values())
    fits = [h["total_us"] for h in hands.values() if h["state_bytes"] <= budget]
    prog = fxshard.shard(m, mesh, plan="auto", example_inputs=x, auto_options=fxshard.AutoOptions(memory_budget=budget))
    assert prog.modelled_cost()["state_bytes"] <= budget
    assert prog.modelled_cost()["total_us"] <= min(fits) + 1e-6
    assert _rel(prog.simulate(*x), m(*x)) < 1e-5


def test_infeasible_budget_names_budget_and_minimum():
    m, x = _llama()
    with pytest.raises(fxshard.AutoInfeasible) as e:
        fxshard.shard(m, fxshard.MeshSpec((4,)), plan="auto", example_inputs=x,
                      auto_options=fxshard.AutoOptions(memory_budget=1000))
    msg = str(e.value)
    assert "memory_budget 1000 B per rank is too small" in msg and "need at least 88.56 KiB" in msg, msg
    full = sum(p.numel() * 4 for p in m.parameters()) + sum(b.numel() * 4 for b in m.buffers())
    with pytest.raises(fxshard.AutoInfeasible, match="parameters \\+ gradients \\+ optimizer states"):
        fxshard.shard(m, fxshard.MeshSpec((4,)), plan="auto", example_inputs=x, training=True,
                      auto_options=fxshard.AutoOptions(memory_budget=full / 2))


def test_partial_plan_keeps_fixed_entries():
    m, x = _llama()
    mesh = fxshard.MeshSpec((4,))
    plan = {"output": ColwiseParallel(output_layouts=Replicate()), "*": "auto"}
    prog = fxshard.shard(m, mesh, plan=plan, example_inputs=x,
                         auto_options=fxshard.AutoOptions(memory_budget=150_000))
    assert _params(prog)["output.weight"].placements == (Shard(0),)
    assert _rel(prog.simulate(*x), m(*x)) < 1e-5


def test_explain_shows_runner_up_and_is_deterministic():
    m, x = _llama()
    mesh = fxshard.MeshSpec((4,))
    opts = fxshard.AutoOptions(memory_budget=150_000)
    a = fxshard.shard(m, mesh, plan="auto", example_inputs=x, auto_options=opts)
    b = fxshard.shard(m, mesh, plan="auto", example_inputs=x, auto_options=opts)
    assert "runner-up" in a.explain()
    provs = [info(n).provenance for n in a.graph.graph.nodes if info(n).provenance.startswith("auto")]
    assert any("runner-up" in p and " us" in p for p in provs)
    assert any("follows its input" in p for p in provs)
    assert fxshard.diff(a, b).count("@@") == 0
    assert [str(info(n).spec) for n in a.graph.graph.nodes] == [str(info(n).spec) for n in b.graph.graph.nodes]


def test_auto_options_need_auto_plan():
    m, x = _llama()
    with pytest.raises(ValueError, match="auto_options applies to plan='auto'"):
        fxshard.shard(m, fxshard.MeshSpec((4,)), plan=zoo.megatron_tp_plan(), example_inputs=x,
                      auto_options=fxshard.AutoOptions())
    with pytest.raises(ValueError, match="plan='nonsense'"):
        fxshard.shard(m, fxshard.MeshSpec((4,)), plan="nonsense", example_inputs=x)
