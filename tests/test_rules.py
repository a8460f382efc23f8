"""fxshard's expansion of DTensor's single-mesh-dim rules over the mesh gives exactly DTensor's
own."""

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard import rules
from tests.models import Llama, LlamaConfig, example_input


def _candidates_both_ways(monkeypatch, op, args, kwargs, mesh, placements):
    ref = rules.dtensor_candidates(
        op, args, kwargs, mesh, placements, drop_strided_shard=True, reference=True
    )
    got = rules.dtensor_candidates(op, args, kwargs, mesh, placements, drop_strided_shard=True)
    # compared by repr: DTensor's _MaskPartial equals only itself (a fresh mask buffer per rule
    # call)
    return repr(ref), repr(got)


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4)])
def test_expansion_equals_dtensor_on_a_training_graph(monkeypatch, mesh_shape):
    """Every op of a Llama training step (forward and backward) that DTensor rules per mesh dim,
    under several input placements (replicated, sharded, partial, uneven): the same candidates, in
    the same order."""
    model = Llama(
        LlamaConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48)
    )
    c = fxshard.capture(
        model,
        example_input(model, batch=2, seq=6),
        mesh=fxshard.MeshSpec(mesh_shape),
        training=True,
        reuse_layers=False,
    )
    mesh = rules.rules_mesh(mesh_shape)
    M = len(mesh_shape)
    seen_ops, compared = set(), 0
    for node in c.gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not rules.has_single_dim_rule(op):
            continue
        val = lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a  # noqa: E731
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), val)
        tensors = [
            x for x in fxshard._torch.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)
        ]
        if not tensors or (op, tuple(t.ndim for t in tensors)) in seen_ops:
            continue
        seen_ops.add((op, tuple(t.ndim for t in tensors)))
        first = tensors[0]
        seeds = [
            (Replicate(),) * M,
            (Shard(0),) + (Replicate(),) * (M - 1),
            (Replicate(),) * (M - 1) + (Shard(first.ndim - 1),),
            (Partial(),) + (Shard(0),) * (M - 1),
        ]
        for seed in seeds:
            placements = [seed if t.ndim == first.ndim else (Replicate(),) * M for t in tensors]
            ref, got = _candidates_both_ways(monkeypatch, op, args, kwargs, mesh, placements)
            assert got == ref, (op, seed)
            compared += 1
    # torch 2.11 rules only mm, addmm, bmm and baddbmm per mesh dim; 2.12+ most ops
    enough = 10 if rules.single_dim_rule_count() > 100 else 1
    assert compared >= 4 * enough and len(seen_ops) >= enough, (compared, seen_ops)


def test_expansion_keeps_dtensors_filters(monkeypatch):
    """Uneven and too-small dims (a dim of 3 on 4 shards) and mixed partial kinds are dropped as
    DTensor drops them; an in-place op keeps self's placement."""
    mesh = rules.rules_mesh((2, 4))
    a, b = torch.empty(3, 8, device="meta"), torch.empty(8, 5, device="meta")
    image, kernel = torch.empty(4, 2, 6, 8, device="meta"), torch.empty(4, 2, 3, 3, device="meta")
    cases = [
        (torch.ops.aten.mm.default, (a, b), {}),
        (torch.ops.aten.add.Tensor, (a, torch.empty(3, 8, device="meta")), {}),
        (torch.ops.aten.mul_.Tensor, (a, torch.empty(3, 8, device="meta")), {}),
        # ops with an op-specific full-mesh filter in torch 2.14+ (uneven mean, conv's width)
        (torch.ops.aten.mean.dim, (a, [0, 1]), {}),
        (torch.ops.aten.convolution.default, (image, kernel, None, [1, 2], [0, 0], [1, 1]), {}),
    ]
    for op, args, kwargs in cases:
        if op is torch.ops.aten.convolution.default:
            args = args + (False, [0, 0], 1)
        n = sum(isinstance(x, torch.Tensor) for x in args)
        for plc in itertools.product(
            [Replicate(), Shard(0), Shard(1), Partial(), Partial("max")], repeat=2
        ):
            placements = [plc] + [(Replicate(), Replicate())] * (n - 1)
            ref, got = _candidates_both_ways(monkeypatch, op, args, kwargs, mesh, placements)
            assert got == ref, (op, plc)


@pytest.mark.parametrize(
    "op, shapes, expected",
    [
        ("mm", [(8, 16), (16, 32)], 64),
        ("addmm", [(32,), (8, 16), (16, 32)], 64),
        ("bmm", [(4, 8, 16), (4, 16, 32)], 81),
        ("baddbmm", [(4, 8, 32), (4, 8, 16), (4, 16, 32)], 81),
    ],
)
def test_matmuls_have_every_candidate(op, shapes, expected):
    """A canary for torch-version drift: DTensor's matmul rules moved between registries across
    releases (and a keyword they take changed in 2.12); losing them is silent (every matmul would
    run replicated), so the count is pinned: the same on torch 2.11 to 2.15."""
    mesh = rules.rules_mesh((2, 2))
    args = [torch.empty(s, device="meta") for s in shapes]
    rr = (Replicate(), Replicate())
    got = rules.candidates(getattr(torch.ops.aten, op).default, args, {}, mesh, [rr] * len(args))
    assert got is not None and len(got) == expected, got


@pytest.mark.parametrize(
    "op, args",
    [
        ("add.Tensor", [(4, 8), (4, 8)]),
        ("mul.Tensor", [(4, 8), (4, 8)]),
        ("_to_copy.default", [(4, 8)]),
        ("view.default", [(4, 8), [32]]),
        ("native_layer_norm.default", [(4, 8), [8], (8,), (8,), 1e-5]),
        ("cumsum.default", [(4, 8), 1]),
        ("_softmax.default", [(4, 8), 1, False]),
        ("sum.dim_IntList", [(4, 8), [1]]),
        ("squeeze.dims", [(4, 1, 8), [1]]),
        ("max_pool2d_with_indices.default", [(2, 4, 8, 8), [2, 2]]),
        ("index_select.default", [(8, 4), 0, "index"]),
    ],
)
def test_common_ops_have_a_sharded_candidate(op, args):
    """Every op of the zoo's models shards on some input on every supported torch release (torch
    2.11 has no DTensor rule for squeeze.dims and max_pool2d: fxshard's own rules cover them)."""
    name, overload = op.split(".")
    target = getattr(getattr(torch.ops.aten, name), overload)
    conv = lambda a: (  # noqa: E731
        torch.empty(a, device="meta")
        if isinstance(a, tuple)
        else torch.zeros(3, dtype=torch.long, device="meta")
        if a == "index"
        else a
    )
    args = [conv(a) for a in args]
    n = sum(isinstance(a, torch.Tensor) for a in args)
    got = rules.candidates(target, args, {}, rules.rules_mesh((2,)), [(Replicate(),)] * n)
    assert got, f"{op}: no rule"
    assert any(p != (Replicate(),) for ins, _ in got for p in ins if p), f"{op}: only replicated"


def test_register_rule_overrides_builtin_and_unregister_restores():
    def f(x):
        return torch.relu(x) * 3

    x = torch.randn(8, 4)
    kw = dict(example_inputs=(x,), input_placements=[(Shard(0),)], output_placements=[(Shard(0),)])
    base = fxshard.shard(f, fxshard.MeshSpec((2,)), **kw)
    assert not base.collectives()
    # a (silly) rule that only lets relu run replicated: fxshard must now gather before it
    fxshard.register_rule(torch.ops.aten.relu.default, [((Replicate(),), (Replicate(),))])
    try:
        prog = fxshard.shard(f, fxshard.MeshSpec((2,)), **kw)
        assert [c.kind for c in prog.collectives()] == ["all_gather"]
        torch.testing.assert_close(prog.simulate(x), f(x))
    finally:
        fxshard.unregister_rule(torch.ops.aten.relu.default)
    assert not fxshard.shard(f, fxshard.MeshSpec((2,)), **kw).collectives()


def test_bad_rule_is_rejected_when_registered():
    with pytest.raises(ValueError, match="has 2 tensor inputs and 1 tensor outputs"):
        fxshard.register_rule(torch.ops.aten.add.Tensor, [((Shard(0),), (Shard(0),))])
    with pytest.raises(ValueError, match="is not a placement"):
        fxshard.register_rule(torch.ops.aten.relu.default, [(("S0",), (Shard(0),))])
    with pytest.raises(TypeError, match="expected a torch operator"):
        fxshard.register_rule(lambda x: x, [])
    assert not fxshard.rules.has_rule(torch.ops.aten.add.Tensor)


def test_rules_that_answer_for_given_inputs_are_asked_with_inputs_placed_alike():
    """A follow-the-input or legacy rule answers for the placements it is asked about: the seeds
    place inputs of one rank alike, enumerated from the largest (``where(cond, x, y)`` with a
    broadcast ``cond`` that no shard fits: x and y together; torch 2.11's plan="auto" missed the
    hand plan without it)."""
    from fxshard.rules.dtensor import _seeds

    cond, x = torch.empty(1, 1, 2, device="meta"), torch.empty(4, 8, 2, device="meta")
    r = (Replicate(),)
    seeds = _seeds([cond, x, x], rules.rules_mesh((4,)), [r, r, r])
    for d in (0, 1):
        assert [r, (Shard(d),), (Shard(d),)] in seeds, seeds


def test_fxshards_rules_for_older_releases_are_right(monkeypatch):
    """The rules fxshard uses where a torch release's DTensor has none, or a wrong one (2.11's
    convolution, index_put, pooling, group norm, squeeze.dims): checked on every release by
    hiding DTensor's rules, against single device on simulated ranks."""
    from fxshard.runtime import rulecheck

    aten = torch.ops.aten
    hidden = {
        aten.convolution.default,
        aten.convolution_backward.default,
        aten.index_put.default,
        aten.max_pool2d_with_indices.default,
        aten.native_group_norm.default,
        aten.squeeze.dims,
    }
    real = rules.has_single_dim_rule
    monkeypatch.setattr(rules, "has_single_dim_rule", lambda op: op not in hidden and real(op))
    monkeypatch.setattr(
        rules, "dtensor_candidates", lambda op, *a, **k: None if op in hidden else orig(op, *a, **k)
    )
    orig = rules.dtensor.dtensor_candidates
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, 8, 8, generator=g), torch.randn(8, 3, 3, 3, generator=g)
    y = torch.nn.functional.conv2d(x, w, padding=1)
    conv = (x, w, torch.randn(8, generator=g), [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    conv_bw = (y, x, w, [8], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
    self_, mask = torch.randn(4, 6, 8, generator=g), torch.zeros(4, 6, dtype=torch.bool)
    mask[1] = True  # 6 values: as many as self's dim 1, which the mask covers
    values = torch.randn(6, 8, generator=g)
    idx = torch.tensor([0, 2, 3])
    samples = {
        aten.convolution.default: [(conv, {})],
        aten.convolution_backward.default: [(conv_bw, {})],
        aten.index_put.default: [
            ((self_, [mask], values, True), {}),  # a mask covers two dims: only dim 2 shards
            ((self_, [None, idx], torch.randn(4, 3, 8, generator=g), False), {}),
        ],
        aten.max_pool2d_with_indices.default: [((x, [2, 2], [2, 2], [0, 0], [1, 1], True), {})],
        aten.native_group_norm.default: [((y, None, None, 4, 8, 64, 2, 1e-5), {})],
        aten.squeeze.dims: [((torch.randn(4, 1, 8, 1, generator=g), [-1, 1]), {})],
    }
    for op, calls in samples.items():
        report = rulecheck.check_rule(op, calls, exclude=False)
        assert report.wrong == [] and report.checked >= 2, (op, str(report))
