"""Programs that used to come out silently wrong, one test per cause: each compares the sharded
program (simulated ranks) with single device, or expects a clear error."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard

M2 = fxshard.MeshSpec((2,))
M22 = fxshard.MeshSpec((2, 2), names=("dp", "tp"))


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- 1. scans over a sharded dim, the dim written negatively ---------------------------------
class Scan(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.op = op

    def forward(self, x):
        h = self.fc(x)  # colwise: h is sharded on its last dim
        if self.op == "cumsum":
            return h.cumsum(-1)
        if self.op == "cumprod":
            return (h * 0.1).cumprod(-1)
        return h.logcumsumexp(-1)


@pytest.mark.parametrize("op", ["cumsum", "cumprod", "logcumsumexp"])
def test_a_scan_with_a_negative_dim_over_a_sharded_dim(op):
    torch.manual_seed(0)
    model, x = Scan(op), _x(4, 8)
    prog = fxshard.shard(model, M2, {"fc": ColwiseParallel()}, example_inputs=(x,))
    torch.testing.assert_close(prog.simulate(x), model(x).detach(), rtol=1e-5, atol=1e-5)


def test_a_norm_over_a_sharded_dim():
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 16)

        def forward(self, x):
            h = self.fc(x)
            return torch.linalg.vector_norm(h, dim=-1), h.norm(), torch.linalg.vector_norm(h, 3.0)

    torch.manual_seed(0)
    model, x = Norm(), _x(4, 8)
    prog = fxshard.shard(model, M2, {"fc": ColwiseParallel()}, example_inputs=(x,))
    for got, want in zip(prog.simulate(x), model(x)):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


# ---- 2. random ops -------------------------------------------------------------------------------
class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


class DropLoss(DropMLP):
    def forward(self, x):
        return super().forward(x).pow(2).sum()


def test_dropout_draws_what_single_device_draws_for_the_same_seed():
    torch.manual_seed(0)
    model, x = DropMLP().train(), _x(8, 8)
    prog = fxshard.shard(model, M22, PLAN, example_inputs=(x,))
    torch.manual_seed(5)
    got = prog.simulate(x)
    torch.manual_seed(5)
    torch.testing.assert_close(got, model(x).detach(), rtol=1e-5, atol=1e-5)


def test_dropout_masks_of_two_shards_are_not_the_same():
    class Mask(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, training=True)

    x = torch.ones(8, 64)
    prog = fxshard.shard(Mask(), M2, {}, example_inputs=(x,), input_placements=[(Shard(1),)])
    assert prog.output_specs[0].placements == (Shard(1),)  # the mask is drawn sharded
    torch.manual_seed(3)
    out = prog.simulate(x)
    left, right = out[:, :32], out[:, 32:]
    assert not torch.equal(left, right)
    torch.manual_seed(3)
    assert torch.equal(out, F.dropout(x, 0.5, training=True))


def test_dropout_in_training_gives_single_device_gradients():
    torch.manual_seed(0)
    model, x = DropLoss().train(), _x(8, 8)
    prog = fxshard.shard(model, M22, PLAN, example_inputs=(x,), training=True)
    torch.manual_seed(5)
    loss, grads = prog.simulate(x)
    torch.manual_seed(5)
    want = model(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5)


# ---- 3. tied parameters ----------------------------------------------------------------------
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids)))).logsumexp(-1).sum()


def test_tied_weights_get_one_gradient_under_both_names():
    torch.manual_seed(0)
    model = Tied()
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    prog = fxshard.shard(
        model, M2, {"mid": ColwiseParallel(output_layouts=Replicate())},
        example_inputs=(ids,), training=True,
    )  # fmt: skip
    _, grads = prog.simulate(ids)
    model(ids).sum().backward()
    torch.testing.assert_close(grads["embed.weight"], model.embed.weight.grad)
    torch.testing.assert_close(grads["head.weight"], model.embed.weight.grad)


def test_two_plan_entries_that_place_one_tied_tensor_apart_are_an_error():
    ids = torch.randint(0, 32, (4, 6))
    # the one (32, 16) tensor: rows sharded as the embedding, columns as the head's weight
    plan = {"embed": RowwiseParallel(), "head": RowwiseParallel()}
    with pytest.raises(
        ValueError, match=r"embed\.weight.*head\.weight|head\.weight.*embed\.weight"
    ):
        fxshard.shard(Tied(), M2, plan, example_inputs=(ids,))


# ---- 5. signatures -------------------------------------------------------------------------------
def test_simulate_with_another_input_shape_or_dtype_is_an_error():
    model, x = DropMLP().eval(), _x(4, 8)
    prog = fxshard.shard(model, M2, PLAN, example_inputs=(x,))
    with pytest.raises(ValueError, match=r"input 0 \(x\) has shape \(6, 8\).*traced for shape"):
        prog.simulate(_x(6, 8))
    with pytest.raises(ValueError, match=r"dtype torch.float64"):
        prog.simulate(_x(4, 8).double())
    with pytest.raises(TypeError, match="takes 1 inputs"):
        prog.simulate(x, x)


# ---- 6. a forward that updates a buffer in place -------------------------------------------------
class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            self.seen.add_(x.sum(0))
        return self.fc(x)


def test_an_in_place_buffer_update_in_forward_is_applied():
    torch.manual_seed(0)
    model, ref, x = Counting(), Counting(), _x(4, 8)
    ref.load_state_dict(model.state_dict())
    prog = fxshard.shard(model, M22, {"fc": ColwiseParallel()}, example_inputs=(x,))
    out = prog.simulate(x)
    prog.simulate(x)
    want = ref(x)
    ref(x)
    torch.testing.assert_close(out, want.detach())
    torch.testing.assert_close(model.seen, ref.seen)
    assert model.seen.abs().sum() > 0


# ---- 8. Partial(avg) of integers ------------------------------------------------------------
def test_partial_avg_of_integers_is_refused():
    # it used to come back float32; no integer dtype holds the mean of integers ([1, 2] -> 1.5)
    with pytest.raises(ValueError, match=r"Partial\('avg'\) of a torch.int64 tensor"):
        fxshard.plan_redistribute(M2, (Partial("avg"),), (Replicate(),), (4,), dtype=torch.int64)
    plan = fxshard.plan_redistribute(M2, (Partial("sum"),), (Replicate(),), (4,), dtype=torch.int64)
    assert [s.collective for s in plan.steps] == ["all_reduce"]


# ---- 9. what the trace baked in ---------------------------------------------------------------
class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.scale = 2.0

    def forward(self, x):
        return self.fc(x) * self.scale


def test_an_attribute_changed_after_sharding_is_an_error():
    model, x = Scaled(), _x(4, 8)
    prog = fxshard.shard(model, M2, {"fc": ColwiseParallel()}, example_inputs=(x,))
    prog.simulate(x)
    model.scale = 3.0
    with pytest.raises(ValueError, match=r"scale.*2\.0.*3\.0|changed since it was sharded"):
        prog.simulate(x)
    model.scale = 2.0
    model.eval()
    with pytest.raises(ValueError, match="changed since it was sharded"):
        prog.simulate(x)
    model.train()
    prog.simulate(x)  # as traced again
    model.fc.weight = nn.Parameter(model.fc.weight.detach() * 2)
    with pytest.raises(ValueError, match="fc.weight is another tensor than when traced"):
        prog.simulate(x)


# ---- lowering: ops whose arguments carry global shapes ----------------------------------------
def test_group_norm_with_a_sharded_batch():
    class GN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, padding=1)
            self.norm = nn.GroupNorm(2, 8)

        def forward(self, x):
            return self.norm(self.conv(x)).sum()

    torch.manual_seed(0)
    model, x = GN(), _x(4, 4, 6, 6)
    prog = fxshard.shard(model, M22, {}, example_inputs=(x,), training=True)  # dp: batch split
    norms = [n for n in prog.global_graph.graph.nodes if "group_norm" in str(n.target)]
    assert norms and all(n.meta["fxshard"].spec[0].placements[0] == Shard(0) for n in norms)
    loss, grads = prog.simulate(x)
    model(x).backward()
    torch.testing.assert_close(loss, model(x).detach(), rtol=1e-5, atol=1e-4)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-4)


def test_squeeze_keeps_a_shard_of_size_one():
    def f(x):
        return (x * 2).squeeze()  # (2, 1, 8): dim 0 sharded over 2 ranks is size 1 locally

    x = _x(2, 1, 8)
    prog = fxshard.shard(f, M2, None, example_inputs=(x,), input_placements=[(Shard(0),)])
    torch.testing.assert_close(prog.simulate(x), f(x))


def test_python_scalar_example_inputs():
    def f(x, alpha, n):
        return x * alpha + n

    x = _x(4, 8)
    prog = fxshard.shard(f, M2, None, example_inputs=(x, 0.5, 3))
    torch.testing.assert_close(prog.simulate(x, 0.5, 3), f(x, 0.5, 3))
    with pytest.raises(ValueError, match="baked into it"):
        prog.simulate(x, 0.25, 3)


def test_simulated_replicas_are_copies_of_the_callers_tensor():
    from fxshard.runtime.simulate import SimulatedMesh

    x = torch.zeros(4)
    spec = fxshard.ShardingSpec.make(M22, (Replicate(), Replicate()), (4,), torch.float32)
    with SimulatedMesh((2, 2)) as sim:
        local = sim.distribute(x, spec)
        local.add_(1)  # once per rank: on one shared buffer that would add 4 to the caller's x
        got = sim.assemble(local, spec)
    assert torch.equal(x, torch.zeros(4)) and torch.equal(got, torch.ones(4))


def test_an_empty_tensor_is_planned_without_hanging():
    def f(x):
        return x.view(4, 2, 0, 0, 0)  # DTensor's view rule never returns for this one

    x = torch.randn(4, 0)
    prog = fxshard.shard(f, M2, None, example_inputs=(x,))
    assert prog.simulate(x).shape == (4, 2, 0, 0, 0)


def test_a_foreach_rule_places_every_list_element():
    from fxshard.runtime import rulecheck

    a, b = _x(4, 8), _x(4, 8, seed=2)
    report = rulecheck.check_rule(
        torch.ops.aten._foreach_norm.Scalar, [(([a, b], 1), {})], exclude=False
    )
    assert report.checked >= 8 and report.wrong == [], str(report)


# ---- the same through the torch.compile backend (simulated ranks) ------------------------------
def _compiled(model, plan, mesh=M22):
    torch._dynamo.reset()
    return torch.compile(
        model, backend="fxshard", options={"mesh": mesh, "plan": plan, "simulate": True}
    )


def test_backend_dropout_and_its_gradients_equal_single_device():
    torch.manual_seed(0)
    model, x = DropLoss().train(), _x(8, 8)
    f = _compiled(model, PLAN)
    torch.manual_seed(5)
    loss = f(x)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    torch.manual_seed(5)
    want = model(x)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5)


def test_backend_tied_weights_get_the_single_device_gradient():
    torch.manual_seed(0)
    model = Tied()
    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(1))
    f = _compiled(model, {"mid": ColwiseParallel(output_layouts=Replicate())}, M2)
    f(ids).backward()
    got = model.embed.weight.grad.clone()
    model.zero_grad()
    model(ids).backward()
    torch.testing.assert_close(got, model.embed.weight.grad)


def test_backend_applies_an_in_place_buffer_update():
    torch.manual_seed(0)
    model, ref, x = Counting(), Counting(), _x(4, 8)
    ref.load_state_dict(model.state_dict())
    f = _compiled(model, {"fc": ColwiseParallel()})
    with torch.no_grad():
        f(x)
        f(x)
        ref(x)
        ref(x)
    torch.testing.assert_close(model.seen, ref.seen)


# ---- reshapes of strided shards (packed weights' outputs, merged dims) -------------------------


def _strided_view_states(x, shape, mesh_shape, placements):
    """Every legal state of ``x.view(shape)`` with ``x`` in ``placements``, run on simulated ranks
    through the lowering's interpreter against single device: (strided states, wrong ones)."""
    from fxshard.core.cost import CostModel
    from fxshard.core.spec import ShardingSpec
    from fxshard.placement.constraints import resolve_plan
    from fxshard.placement.problem import PlacementProblem
    from fxshard.runtime import rulecheck
    from fxshard.runtime.simulate import SimulatedMesh

    op = torch.ops.aten.view.default
    want = op(x, list(shape))
    gm, node, tensors = rulecheck._one_node_graph(op, (x, list(shape)), {}, [want])
    mesh = fxshard.MeshSpec(mesh_shape)
    problem = PlacementProblem(mesh, CostModel(mesh), resolve_plan(None, None, mesh))
    given = ShardingSpec.make(mesh, placements, x.shape, x.dtype)
    states = problem.legal_states(node, [given])
    n, wrong = 0, []
    with SimulatedMesh(mesh_shape) as sim:
        for ins, outs in states.states:
            if ins[0] != given:
                continue
            n += 1
            why = rulecheck._run_state(sim, gm, node, tensors, ins, outs, [want])
            if why:
                wrong.append((outs[0].placements, why))
    return n, wrong


@pytest.mark.parametrize(
    "mesh,shape,view",
    [((2, 3), (4, 120), (48, 10)), ((2, 2), (4, 120), (480,)), ((2,), (4, 120), (4, 2, 60)),
     ((2, 3), (2, 3, 24), (2, 3, 2, 12)), ((3, 2), (6, 8), (48,))],
)  # fmt: skip
def test_reshapes_of_strided_shards_are_right_on_every_rank(mesh, shape, view):
    """DTensor's view rule turns some strided shards into wrong ones (``x[4, 120]`` split in 2
    strided pieces over 2 ranks, viewed as ``(48, 10)``, keeps ``_S(1, 2)`` on dim 0): every state
    fxshard still offers, from every strided input placement, equals single device; the kept
    ones include the strided ones packed projections need."""
    from fxshard._torch import StridedShard

    x = _x(*shape)
    kept = 0
    for d in range(len(shape)):
        for sf in (2, 3):
            for m in range(len(mesh)):
                plc = [Replicate()] * len(mesh)
                plc[m] = StridedShard(d, split_factor=sf)
                try:
                    n, wrong = _strided_view_states(x, view, mesh, tuple(plc))
                except ValueError:  # a placement these sizes do not take
                    continue
                assert not wrong, (plc, wrong)
                kept += n
    assert kept


def test_a_packed_projection_viewed_into_heads_equals_single_device():
    """A packed (gate, up) output strided over 2 ranks, viewed to split off the pieces, then used:
    the program equals single device (it was wrong: the view kept a strided shard on the merged
    dim)."""
    from fxshard._torch import StridedShard

    def f(x):
        return x.view(48, 10) * 3.0

    x = _x(4, 120)
    for mesh in ((2, 3), (2,)):
        spec = fxshard.MeshSpec(mesh)
        plc = (StridedShard(1, split_factor=2),) + (Replicate(),) * (len(mesh) - 1)
        prog = fxshard.shard(f, spec, example_inputs=(x,), input_placements=[plc])
        torch.testing.assert_close(prog.simulate(x), f(x))

    def pieces(x):  # the packed split: (4, 2, 60) takes the strided dim apart, no collective
        return x.view(4, 2, 60) * 3.0

    prog = fxshard.shard(
        pieces, M2, example_inputs=(x,), input_placements=[(StridedShard(1, split_factor=2),)],
        output_placements=[(Shard(2),)],
    )  # fmt: skip
    torch.testing.assert_close(prog.simulate(x), pieces(x))
    assert not prog.collectives()


# ---- selects of a Partial value and zeros stay Partial ------------------------------------------


class MaskedRowwise(nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.up, self.down, self.fill = nn.Linear(8, 16), nn.Linear(16, 8, bias=False), fill

    def forward(self, x, mask):
        y = self.down(torch.relu(self.up(x)))  # Partial under a rowwise down
        if self.fill == "where0":
            y = torch.where(mask, 0.0, y)
        elif self.fill == "where_tensor0":
            y = torch.where(mask, torch.zeros((), dtype=y.dtype), y)
        elif self.fill == "masked_fill":
            y = y.masked_fill(mask, 0.0)
        elif self.fill == "masked_fill_1":  # not a zero: the sum of 1s on every rank is not 1
            y = y.masked_fill(mask, 1.0)
        elif self.fill == "where5":  # nor is 5
            y = torch.where(mask, 5.0, y)
        return (y * 2.0).sum(0)


@pytest.mark.parametrize(
    "fill", ["where0", "where_tensor0", "masked_fill", "masked_fill_1", "where5"]
)
def test_a_zero_select_of_a_partial_value_stays_partial(fill):
    """``where(mask, 0, y)`` / ``y.masked_fill(mask, 0)`` of a Partial ``y`` is Partial (each
    rank's select of its addend sums to the select of the sum): one all-reduce at the end, after
    the reduction, not one before the select; a fill that is not 0 must reduce first."""
    torch.manual_seed(0)
    model = MaskedRowwise(fill)
    x, mask = _x(6, 8), _x(6, 1) > 0
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Partial())}
    prog = fxshard.shard(model, M2, plan, example_inputs=(x, mask))
    torch.testing.assert_close(prog.simulate(x, mask), model(x, mask))
    reduced = [c for c in prog.collectives() if c.kind == "all_reduce"]
    assert len(prog.collectives()) == 1 and reduced
    if fill not in ("masked_fill_1", "where5"):
        assert reduced[0].bytes == 8 * 4, prog.explain()  # the (8,) sum, not the (6, 8) rows


def test_a_select_of_a_nonzero_number_is_not_partial():
    """``where.ScalarSelf(c, 5, y)``: 5 would be added once per rank, so no Partial candidate;
    with 0 the value is Partial-able."""
    import torch.fx as fx

    from fxshard.placement.problem import zero_filled

    for number, want in ((5.0, None), (0.0, ("c", "x"))):
        g = fx.Graph()
        c, y = g.placeholder("c"), g.placeholder("y")
        c.meta["val"], y.meta["val"] = torch.ones(2, dtype=torch.bool), torch.ones(2)
        n = g.call_function(torch.ops.aten.where.ScalarSelf, (c, number, y))
        n.meta["val"] = torch.ones(2)
        assert zero_filled(n) == want


# ---- rules that older torch releases get wrong -------------------------------------------------


def test_a_strided_candidate_is_offered_only_where_its_plain_one_is():
    """A rule that tests ``isinstance(p, Shard)`` takes a ``_StridedShard`` for an unsharded dim:
    torch 2.11's ``cat`` passed ``_S(2,2)`` inputs through a cat on dim 2 as an ``_S(2,2)`` output
    (a packed gate/up weight's gradient came out wrong).  Such a candidate is dropped; one whose
    plain form the rule offers (a cat on another dim) is kept."""
    from fxshard._torch import StridedShard
    from fxshard.rules import dtensor as dt
    from fxshard.rules import rules_mesh

    a = torch.randn(4, 8, 32)
    mesh = rules_mesh((4,))
    s = (StridedShard(2, split_factor=2),)
    cat = torch.ops.aten.cat.default
    wrong = ((s, s), (s,))
    assert dt._strided_as_plain(cat, ([a, a], 2), {}, mesh, [s, s], [wrong]) == []
    right = ((s, s), (s,))  # a cat on dim 0 keeps dim 2's shards
    assert dt._strided_as_plain(cat, ([a, a], 0), {}, mesh, [s, s], [right]) == [right]
    # and what this release's rules offer for the cat on dim 2 has no output strided on dim 2
    # with strided inputs (the cat of plain shards into pieces is fxshard's own strided cat)
    for ins, outs in fxshard.rules.candidates(cat, ([a, a], 2), {}, mesh, [s, s]):
        if any(isinstance(p, StridedShard) for p in ins[0]):
            assert not any(isinstance(p, StridedShard) and p.dim == 2 for p in outs[0]), (ins, outs)


def test_an_index_reduction_is_never_partial():
    """A position found in one rank's shard is a local index: no reduction of the ranks' indices
    is the global one (torch 2.11 offered ``argmax`` along a sharded dim as ``Partial(max)``)."""
    from fxshard import rules

    x = torch.randn(6, 4)
    mesh = rules.rules_mesh((2,))
    fake = [(((Shard(0),),), ((Partial("max"),),)), (((Shard(1),),), ((Shard(0),),))]
    assert rules._no_partial_indices(torch.ops.aten.argmax.default, fake) == fake[1:]
    both = [(((Shard(0),),), ((Partial("max"),), (Partial("max"),)))]
    assert rules._no_partial_indices(torch.ops.aten.max.dim, both) == []
    for op in (torch.ops.aten.argmax.default, torch.ops.aten.argmin.default):
        for _, outs in rules.candidates(op, (x, 0), {}, mesh, [(Shard(0),)]):
            assert not any(p.is_partial() for p in outs[0]), (op, outs)
    prog = fxshard.shard(
        lambda t: t.argmax(0), fxshard.MeshSpec((2,)), example_inputs=(x,),
        input_placements=[(Shard(0),)],
    )  # fmt: skip
    assert torch.equal(prog.simulate(x), x.argmax(0))


def test_a_pointwise_op_keeps_a_strided_input_strided():
    """A packed gate/up output (``_S(1,2)``) masked by ``where``: the result stays strided, no
    collective (torch 2.11's pointwise rules propose only plain shards)."""
    from fxshard import rules
    from fxshard._torch import StridedShard

    cond, y = torch.rand(32, 1) > 0.5, torch.randn(32, 128)
    s = (StridedShard(1, split_factor=2),)
    found = rules.candidates(
        torch.ops.aten.where.self, (cond, torch.tensor(0.0), y), {}, rules.rules_mesh((4,)),
        [(Replicate(),), (Replicate(),), s],
    )  # fmt: skip
    assert (((Replicate(),), (Replicate(),), s), (s,)) in found, found


def test_a_cast_to_integers_is_never_partial():
    """``cumsum(x, 0, dtype=torch.int32)`` of a float Partial truncates each addend: the sum of
    the truncated addends is not the truncated sum (torch 2.14 offers ``P -> P``).  Integer
    inputs stay linear."""
    from fxshard import rules

    mesh = rules.rules_mesh((2,))
    cumsum = torch.ops.aten.cumsum.default
    for x, partial_ok in ((torch.randn(4), False), (torch.tensor([1, 0, 2, 1]), True)):
        fake = [(((Partial(),),), ((Partial(),),)), (((Shard(0),),), ((Shard(0),),))]
        kept = rules._no_partial_casts((x, 0), {"dtype": torch.int32}, fake)
        assert kept == (fake if partial_ok else fake[1:]), (x.dtype, kept)
        found = rules.candidates(cumsum, (x, 0), {"dtype": torch.int32}, mesh, [(Partial(),)])
        for ins, _ in found:
            assert partial_ok or not ins[0][0].is_partial(), ins
