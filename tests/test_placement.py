"""The placement stage: the placement problem (legal states, placeholder options, boundary and
output requirements) read alike by the greedy annotator, the global solver and set_placement."""

import logging

import pytest
import torch
from models import MLP, example_input, init_weights, mlp_plan
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel

import fxshard
from fxshard.ir import NodeKind, info, tensor_args
from fxshard.placement.constraints import resolve_plan
from fxshard.placement.problem import PlacementProblem

M1_2 = fxshard.MeshSpec((2,))
M2_22 = fxshard.MeshSpec((2, 2), names=("dp", "tp"))


@torch.library.custom_op("fxshard_test::cumulative", mutates_args=())
def cumulative(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) * 1.5


@cumulative.register_fake
def _(x):
    return torch.empty_like(x)


def _problem(captured, **kw):
    kw.setdefault("training", captured.training)
    return PlacementProblem(captured.mesh, captured.cost_model, captured.constraints, **kw)


def test_legal_states_are_even_plain_and_place_what_is_read():
    """Every legal state of every op of a small model: input and output specs divide evenly, no
    strided or non-sum partial inputs, every read output placed; the replicated state is among
    them."""
    model = init_weights(MLP())
    c = fxshard.capture(model, example_input(model), mesh=M2_22, plan=mlp_plan())
    p = _problem(c)
    ops = [n for n in c.gm.graph.nodes if n.op == "call_function" and info(n).kind == NodeKind.OP]
    assert ops
    for n in ops:
        cur = [p.replicated(a.meta["val"]) for a in tensor_args(n)]
        legal = p.legal_states(n, cur)
        assert legal.source in ("rule", "factory"), n
        rep = (
            tuple(cur),
            tuple(
                p.replicated(v) if isinstance(v, torch.Tensor) else None
                for v in (
                    n.meta["val"] if isinstance(n.meta["val"], (tuple, list)) else (n.meta["val"],)
                )
            ),
        )
        assert legal.source == "factory" or rep in legal.states, n
        for ins, outs in legal.states:
            assert all(fxshard.core.spec.is_even(s) for s in (*ins, *outs) if s is not None), n
            assert not any(
                type(pl).__name__ == "_StridedShard" for s in ins for pl in s.placements
            ), n
        # the states of a matmul include a contraction sharded on both sides (a partial output)
        if n.target is torch.ops.aten.addmm.default:
            assert any(isinstance(o[0].placements[1], Partial) for _, o in legal.states)


def test_placeholder_options_say_what_is_fixed():
    """A planned parameter fixes the plan dim and leaves the others free; an unplanned one and a
    plain input are free everywhere; explicit input placements fix everything."""
    model = init_weights(MLP())
    c = fxshard.capture(model, example_input(model), mesh=M2_22, plan=mlp_plan())
    p = _problem(c)
    by_fqn = {info(n).fqn: n for n in c.gm.graph.nodes if n.op == "placeholder" and info(n).fqn}
    w1 = p.placeholder_options(by_fqn["fc1.weight"])
    assert w1.requested.placements == (Replicate(), Shard(0)) and w1.free == (0,)
    assert "ColwiseParallel" in w1.provenance
    x = next(n for n in c.gm.graph.nodes if info(n).kind == NodeKind.INPUT)
    opts = p.placeholder_options(x)
    assert opts.free == (0, 1) and opts.requested.placements[0] == Shard(0)  # data parallel on dp
    fixed = _problem(c, input_placements=[(Replicate(), Replicate())]).placeholder_options(x)
    assert fixed.free == () and fixed.provenance == "input_placements[0]"
    # every even option keeps what is fixed
    opts = p.even_options(by_fqn["fc1.weight"].meta["val"], {1: Shard(0)})
    assert opts and all(s.placements[1] == Shard(0) for s in opts)


def test_output_requirements_of_a_training_graph():
    """Forward outputs of a joint graph are handed back replicated; gradients are placed like their
    parameters, or replicated when the program hands gradients back global (the backend)."""

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = init_weights(MLP())

        def forward(self, a):
            return self.m(a).sum()

    model = Loss()
    c = fxshard.capture(model, example_input(model.m), mesh=M1_2, training=True)
    out = next(n for n in c.gm.graph.nodes if n.op == "output")
    reqs = [r for r in _problem(c).output_requirements(out) if r is not None]
    assert reqs[0].kind == "fixed" and reqs[0].role == ("output", 0)
    assert {r.kind for r in reqs[1:]} == {"like"} and all(
        r.role.kind == "grad_param" for r in reqs[1:]
    )
    glob = [r for r in _problem(c, replicate_grads=True).output_requirements(out) if r is not None]
    assert {r.kind for r in glob[1:]} == {"fixed"}


def test_greedy_and_auto_read_the_same_states(monkeypatch):
    """One enumerator: both annotators ask the placement problem, never the rules directly."""
    from fxshard.placement import problem as problem_mod

    calls = {"n": 0}
    real = problem_mod.PlacementProblem.legal_states

    def counted(self, node, cur, *rest, **kw):
        calls["n"] += 1
        return real(self, node, cur, *rest, **kw)

    monkeypatch.setattr(problem_mod.PlacementProblem, "legal_states", counted)
    model = init_weights(MLP())
    x = example_input(model)
    for plan in (mlp_plan(), "auto"):
        calls["n"] = 0
        prog = fxshard.shard(model, M1_2, plan, example_inputs=x)
        assert calls["n"] > 0, plan
        torch.testing.assert_close(prog.simulate(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_constraints_of_a_plan():
    model = MLP()
    cons = resolve_plan(mlp_plan(), model, M2_22)
    assert (
        cons.dim == 1
        and cons.params["fc1.weight"][0] == Shard(0)
        and cons.params["fc2.weight"][0] == Shard(1)
    )
    assert cons.boundaries["fc2:out:0"][0] == Replicate() and cons.hooked == {
        "fc1": (1, 1),
        "fc2": (1, 1),
    }


def test_op_without_rule_warns_and_replicates(caplog):
    boundaries = torch.tensor([-1.0, 0.0, 0.5, 2.0])

    def f(x):
        return torch.searchsorted(boundaries, x * 2).float() + x

    x = torch.randn(8, 4)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = fxshard.shard(f, M1_2, example_inputs=(x,), input_placements=[(Shard(0),)])
    assert "aten.searchsorted.Tensor" in caplog.text and "has no sharding rule" in caplog.text
    assert "test_placement.py" in caplog.text  # names the source line
    torch.testing.assert_close(prog.simulate(x), f(x))


@pytest.mark.parametrize("plan", [None, "auto"])
def test_an_op_without_rule_warns_once_per_line_and_only_where_it_costs(caplog, plan):
    edges = torch.tensor([-1.0, 0.0, 0.5, 2.0])

    def f(x, y):
        out = x
        for i in range(3):  # three nodes at one source line: one warning that counts them
            out = out + torch.searchsorted(edges, x + i)
        return out, torch.searchsorted(edges, y)  # y replicated: as on one device, no warning

    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = fxshard.shard(
            f, M1_2, plan, example_inputs=(x, y), input_placements=[(Shard(0),), (Replicate(),)]
        )
    assert len(prog.warnings) == 1, prog.warnings
    assert "aten.searchsorted.Tensor" in prog.warnings[0]
    assert "(and 2 more nodes there)" in prog.warnings[0]
    assert "fallback: aten.searchsorted.Tensor" in prog.explain()
    for got, want in zip(prog.simulate(x, y), f(x, y)):
        torch.testing.assert_close(got, want)


class Casts(torch.nn.Module):
    """An HF-style casting norm: every ``.to(dtype)`` leaves an ``_assert_tensor_metadata`` check in
    the exported graph, which has no rule and used to gather its input."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (self.fc(h.to(torch.bfloat16).to(torch.float32)) * 2).pow(2).mean()


@pytest.mark.parametrize("training", [False, True])
def test_metadata_checks_never_force_a_collective(caplog, training):
    model, x = Casts(), torch.randn(8, 8)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = fxshard.shard(
            model, M1_2, {}, example_inputs=(x,), input_placements=[(Shard(0),)], training=training
        )
    targets = {str(n.target) for n in prog.global_graph.graph.nodes}
    assert "aten._assert_tensor_metadata.default" not in targets
    fallbacks = [c for c in prog.collectives() if "fallback" in c.provenance]
    assert fallbacks == [] and prog.warnings == [] and "no sharding rule" not in caplog.text
    assert [c.kind for c in prog.collectives() if c.phase == "forward"] == ["all_reduce"]  # mean
    got = prog.simulate(x)
    torch.testing.assert_close(got[0] if training else got, model(x))


def test_custom_op_without_rule_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"custom op with no sharding rule; register one, e.g. fxshard.register_rule",
    ):
        fxshard.shard(
            lambda x: cumulative(x * 2) + 1,
            M1_2,
            example_inputs=(torch.randn(8, 4),),
            input_placements=[(Shard(0),)],
        )


def test_rule_leaving_a_read_output_unplaced_is_skipped(monkeypatch, caplog):
    """A rule (torch versions differ here) that gives a tensor output no placement cannot be chosen
    when something reads that output: the next candidate, or the replicated fallback, is taken
    instead of handing consumers nothing (seen as a crash on torch 2.11)."""
    from fxshard import rules

    real = rules.candidates
    relu = torch.ops.aten.relu.default

    def patched(op, args, kwargs, device_mesh, input_placements):
        out = real(op, args, kwargs, device_mesh, input_placements)
        if op is relu and out not in (None, "factory"):
            return [(ins, (None,)) for ins, _ in out]  # every candidate leaves the output unplaced
        return out

    monkeypatch.setattr(rules, "candidates", patched)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    m = M()
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        prog = fxshard.shard(
            m, fxshard.MeshSpec((2,)), plan={"fc": ColwiseParallel()}, example_inputs=(x,)
        )
    assert any("relu" in r.getMessage() and "replicated" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(prog.simulate(x), m(x), rtol=1e-5, atol=1e-5)


def test_set_placement_between_stages_changes_plan_and_stays_correct():
    model = init_weights(MLP())
    x = example_input(model)
    c = fxshard.annotate(fxshard.capture(model, x, mesh=fxshard.MeshSpec((2,)), plan=mlp_plan()))
    relu = next(n for n in c.gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    assert info(relu).spec.placements == (Shard(2),)
    fxshard.set_placement(relu, (Replicate(),))
    assert info(relu).provenance == "set_placement"
    prog = fxshard.program(fxshard.redistribute(c))
    base = fxshard.shard(model, fxshard.MeshSpec((2,)), mlp_plan(), example_inputs=x)
    assert "relu" in fxshard.diff(base, prog)
    torch.testing.assert_close(prog.simulate(*x), model(*x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="allows no strategy with output"):
        fxshard.set_placement(
            next(n for n in c.gm.graph.nodes if n.target is torch.ops.aten.addmm.default),
            (Partial("max"),),
        )


def test_compute_us_of_every_state_at_once_equals_compute_us():
    """plan="auto" prices every legal state of every op with ``compute_us_states`` (per-spec terms
    looked up once): the very floats ``compute_us`` gives state by state (a training graph, a 2-D
    mesh, the default cost model)."""
    from fxshard.placement.problem import compute_us, compute_us_states

    model = init_weights(MLP())
    c = fxshard.capture(model, example_input(model), mesh=M2_22, plan=mlp_plan(), training=True)
    p = _problem(c)
    specs: list = []
    ids: dict = {}
    terms: dict = {}
    checked = 0
    for n in c.gm.graph.nodes:
        if n.op != "call_function" or info(n).kind != NodeKind.OP:
            continue
        cur = [p.replicated(a.meta["val"]) for a in tensor_args(n)]
        states = p.legal_states(n, cur).states
        packed = [
            (
                tuple(ids.setdefault(s, len(ids)) for s in ins),
                tuple(-1 if s is None else ids.setdefault(s, len(ids)) for s in outs),
            )
            for ins, outs in states
        ]
        specs[:] = sorted(ids, key=ids.get)
        got = compute_us_states(n, packed, specs, terms, c.cost_model)
        want = [
            compute_us(n, list(ins), [s for s in outs if s is not None], c.cost_model)
            for ins, outs in states
        ]
        assert got == want, n
        checked += sum(x > 0 for x in got)
    assert checked > 50
