"""The capture stage: planned module boundaries marked, repeated layers found once for every stage
that uses them, and (reuse_layers) traced once and stitched: the result must be the very graph a
plain trace gives, node for node, and compute the same values."""

import logging

import others
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fxshard
from fxshard import zoo
from fxshard.capture import alike_layers, capture_joint
from fxshard.ir import GRAD_TAG, info


def _tiny(n_layers=4):
    torch.manual_seed(0)
    cfg = zoo.LlamaConfig(
        dim=32,
        n_layers=n_layers,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        ffn_hidden=48,
        max_seq_len=16,
    )
    return zoo.init_weights(zoo.Llama(cfg)), torch.randint(0, 64, (2, 8))


def _canon(gm: fx.GraphModule) -> list:
    """Every node: op, target, arguments by position, value shape/dtype, joint-graph role,
    module."""
    idx = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: i for n, i in idx.items()}
    out = []
    for n in gm.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", idx[a]))
        if len(n.args) > 1 and isinstance(n.args[1], str) and n.args[1].startswith(GRAD_TAG):
            args = (
                args[0][0],
                GRAD_TAG + str(by_name[n.args[1][len(GRAD_TAG) :]]),
            )  # names differ, nodes not
        v = n.meta.get("val")
        rec = info(n)
        out.append(
            (
                n.op,
                rec.fqn if n.op == "placeholder" else str(n.target),
                repr(args),
                (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
                n.meta.get("partitioner_tag"),
                rec.kind,
                rec.module,
            )
        )
    return out


def _run(c, tokens):
    args = []
    for p in c.gm.graph.nodes:
        if p.op == "placeholder":
            rec = info(p)
            args.append(
                c.state[rec.fqn]
                if rec.kind in ("param", "buffer")
                else tokens
                if rec.kind == "input"
                else torch.ones(p.meta["val"].shape)
            )
    return c.gm(*args)


def test_reuse_layers_gives_the_plain_trace_node_for_node(caplog):
    m, x = _tiny()
    blocks = {f"layers.{i}": (16, 1) for i in range(4)}  # plan="auto" marks every layer like this
    plain = capture_joint(m, [x], boundaries=blocks)
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        stitched = capture_joint(m, [x], boundaries=blocks, reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text  # really stitched
    assert _canon(stitched.gm) == _canon(plain.gm)
    a, b = _run(plain, x), _run(stitched, x)
    assert len(a) == len(b) and all(
        u is None and v is None or torch.equal(u, v) for u, v in zip(a, b)
    )


def test_a_layer_with_its_own_state_is_traced_inline(caplog):
    m, x = _tiny()
    m.layers[2].attention.window = 4  # an attribute the others lack: layer 2 is not like them
    groups = alike_layers(m)
    assert [[f for f, _ in g] for g in groups] == [["layers.0", "layers.1", "layers.3"]]
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        stitched = capture_joint(m, [x], reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text
    assert _canon(stitched.gm) == _canon(capture_joint(m, [x]).gm)


class _KwargLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(input=x)
        return x.sum()


class _Scale:
    def __init__(self, s):
        self.s = s


class _ObjectArgLayer(nn.Linear):
    def forward(self, x, how):
        return super().forward(x) * how.s


class _ObjectArgLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_ObjectArgLayer(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, _Scale(2.0))
        return x.sum()


def test_keyword_and_nested_tensor_arguments_are_stitched(caplog):
    m, x = _KwargLayers(), torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        c = capture_joint(m, [x], reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text
    assert _canon(c.gm) == _canon(capture_joint(m, [x]).gm)
    # Hugging Face's structure: model.layers.N called with position_embeddings=(cos, sin), a mask
    m = others.init(others.HFLlama(others.Config(n_layers=3)))
    tokens = torch.randint(0, 128, (2, 8))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        stitched = capture_joint(m, [tokens], reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text
    plain = capture_joint(m, [tokens])
    assert _canon(stitched.gm) == _canon(plain.gm)
    a, b = _run(plain, tokens), _run(stitched, tokens)
    assert all(u is None and v is None or torch.equal(u, v) for u, v in zip(a, b))


def test_calls_it_cannot_represent_fall_back_to_the_plain_trace(caplog):
    m, x = _ObjectArgLayers(), torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        c = capture_joint(m, [x], reuse_layers=True)
    assert "is called with a _Scale argument" in caplog.text
    assert _canon(c.gm) == _canon(capture_joint(m, [x]).gm)
    assert all("forward" not in vars(layer) for layer in m.layers)  # the class's forward again


def test_auto_plan_on_a_stitched_capture_matches_single_device():
    m = zoo.init_weights(zoo.Llama(zoo.LlamaConfig(n_layers=3)))
    x = zoo.example_input(m, batch=4)
    prog = fxshard.shard(
        m,
        fxshard.MeshSpec((2, 2), names=("dp", "tp")),
        plan="auto",
        example_inputs=x,
        training=True,
        reuse_layers=True,
    )
    assert prog.captured.auto.shared_layers == 2
    ref = m(*x)
    out, grads = prog.simulate(*x, grad_outputs=(torch.ones_like(ref),))
    ref.backward(torch.ones_like(ref))
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for fqn, p in m.named_parameters():
        assert ((grads[fqn] - p.grad).abs().max() / p.grad.abs().max()).item() < 1e-5, fqn


# ---- the cases an independent review found (each once a silent miscompile or a corrupted model) --


def _compare(m, xs, hooked=None):
    """(stitched or fell back, values equal, stitched outputs): both captures, with ``hooked``
    boundary markers, run on the same inputs and tangents; the graphs must also match node for node
    where the stitched capture fell back."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("fxshard.stitch")
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.DEBUG)
    try:
        stitched = capture_joint(m, xs, boundaries=hooked, reuse_layers=True)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    plain = capture_joint(m, xs, boundaries=hooked)

    def run(c):
        g = torch.Generator().manual_seed(0)
        args = []
        for p in c.gm.graph.nodes:
            if p.op == "placeholder":
                rec = info(p)
                v = p.meta["val"]
                args.append(
                    c.state[rec.fqn]
                    if rec.kind in ("param", "buffer", "constant")
                    else xs[rec.input_index]
                    if rec.kind == "input"
                    else torch.randn(v.shape, generator=g)
                )
        return c.gm(*args)

    a, b = run(plain), run(stitched)
    same = len(a) == len(b) and all(
        u is None and v is None or torch.allclose(u, v, atol=1e-6) for u, v in zip(a, b)
    )
    fell_back = any("does not apply" in r.getMessage() for r in records)
    if fell_back:
        same = same and _canon(stitched.gm) == _canon(plain.gm)
    return fell_back, same, b


class _PassOn(
    nn.Module
):  # hands its position input on to the next block: an output aliasing an input
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h, pos):
        return h + torch.tanh(self.lin(h + pos)), pos


class _PosModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(4, 8)
        self.layers = nn.ModuleList(_PassOn() for _ in range(3))

    def forward(self, h):
        pos = self.pos(torch.arange(4))
        for layer in self.layers:
            h, pos = layer(h, pos)
        return h.sum()


def test_outputs_aliasing_inputs_keep_their_gradients():
    torch.manual_seed(0)
    for m in (
        _PosModel(),
        nn.Sequential(
            nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8)
        ),
    ):
        fell_back, same, _ = _compare(m, [torch.randn(4, 8)])
        assert fell_back and same


class _ConstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.a(x)) * torch.tensor([0.5] * 8)


class _ConstModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_ConstLayer() for _ in range(3))

    def forward(self, x):
        # a model constant of the same generated name as the layer's
        x = x + torch.tensor([3.0] * 8)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_layer_constants_stay_the_layers_own():
    torch.manual_seed(0)
    fell_back, same, _ = _compare(_ConstModel(), [torch.randn(4, 8)])
    assert not fell_back and same


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.a(x)), (self.b(x), x * 2)


class _NestedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Nested() for _ in range(3))

    def forward(self, x):
        acc = 0
        for layer in self.layers:
            out = layer(x)
            x, acc = out[0], acc + out[1][0].sum()
        return x.sum() + acc


def test_nested_outputs_fall_back():
    torch.manual_seed(0)
    fell_back, same, _ = _compare(_NestedModel(), [torch.randn(4, 8)])
    assert fell_back and same


class _Aux(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        p = torch.softmax(
            self.a(x).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1)[:4], float("-inf")), -1
        )
        return torch.tanh(self.a(x)) + p, torch.log(p)


class _AuxModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_Aux() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x, _discarded = layer(x)
        return x.sum()


def test_a_discarded_output_is_not_differentiated():
    torch.manual_seed(0)
    fell_back, same, out = _compare(_AuxModel(), [torch.randn(4, 8)])
    assert fell_back and same  # zeros fed to log's backward would give NaN gradients
    assert all(torch.isfinite(t).all() for t in out if t is not None)


class _Sliced(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.first_half = self.layers[:2]  # the same modules in a second container

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_layers_in_two_containers_and_the_model_left_as_it_was():
    torch.manual_seed(0)
    m, x = _Sliced(), torch.randn(4, 8)
    ref = m(x)
    fell_back, same, _ = _compare(m, [x])
    assert not fell_back and same
    assert all("forward" not in vars(layer) for layer in m.layers)
    # AOT's swap undone on shared paths too
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert torch.equal(m(x), ref)


def test_a_layer_with_a_forward_of_its_own_is_not_reused():
    m, _ = _tiny()
    m.layers[1].forward = lambda x, cos, sin: x  # an instance forward: the class's is not what runs
    assert [[f for f, _ in g] for g in alike_layers(m)] == [["layers.0", "layers.2", "layers.3"]]


def test_plan_markers_inside_layers_are_renamed_per_copy(caplog):
    """A Megatron plan marks modules inside every layer; the copies carry their own layer's tags."""
    from fxshard.core.mesh import MeshSpec
    from fxshard.placement.constraints import resolve_plan

    m, x = _tiny()
    hooked = resolve_plan(zoo.megatron_tp_plan(), m, MeshSpec((2,)), None).hooked
    plain = capture_joint(m, [x], boundaries=hooked)
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        stitched = capture_joint(m, [x], boundaries=hooked, reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text
    assert _canon(stitched.gm) == _canon(plain.gm)  # tags included
    tags = {n.args[1] for n in stitched.gm.graph.nodes if info(n).kind == "boundary"}
    assert {"layers.3.attention.wo:out:0", "layers.1.feed_forward.w2:in:0"} <= tags


def test_layers_sharing_a_submodule_fall_back_with_their_markers_intact():
    """A submodule shared by all layers: its markers are named after its first owner in the plain
    trace, and every copy would otherwise be named after whichever layer AOT named it by."""
    m, x = _tiny(n_layers=3)
    for layer in m.layers[1:]:
        layer.attention.wo = m.layers[0].attention.wo
    hooked = {f"layers.{i}.feed_forward.w2": (1, 1) for i in range(3)} | {
        "layers.0.attention.wo": (1, 1)
    }
    fell_back, same, _ = _compare(m, [x], hooked)
    assert fell_back and same


def test_layer_groups_in_lists_dicts_and_nested_containers():
    """One finder for every stage: siblings of one class and parameter shapes in a ModuleList, a
    ModuleDict (torchtitan), or nested one level down (HF's model.model.layers); odd ones out stay
    out, and groups inside a repeated layer are shared through the outer one."""
    from fxshard.capture import layer_groups

    def block(d=8):
        return nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([block() for _ in range(3)] + [block(4)])
            self.lm_head = nn.Linear(8, 8)

    class Titan(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleDict({str(i): block() for i in range(4)})

    assert [[f for f, _ in g] for g in layer_groups(HF())] == [
        ["model.layers.0", "model.layers.1", "model.layers.2"]
    ]
    assert [[f for f, _ in g] for g in layer_groups(Titan())] == [[f"layers.{i}" for i in range(4)]]
    assert layer_groups(nn.Linear(2, 2)) == [] and layer_groups(None) == []


def test_plan_boundaries_are_marked_with_their_tags():
    m = zoo.init_weights(zoo.Llama(zoo.LlamaConfig(n_layers=1)))
    (x,) = zoo.example_input(m)
    c = fxshard.capture(m, (x,), mesh=fxshard.MeshSpec((2,)), plan=zoo.megatron_tp_plan())
    tags = {info(n).tag for n in c.gm.graph.nodes if info(n).kind == "boundary"}
    assert {
        "layers.0.attention.wq:in:0",
        "layers.0.attention.wq:out:0",
        "layers.0.attention.wo:out:0",
    } <= tags
    assert all(info(n).module for n in c.gm.graph.nodes if info(n).kind == "boundary")


_BEHAVIOUR: dict = {}  # outside the layers' state: what the reuse_layers proof must catch


class _GlobalGrad(torch.autograd.Function):
    """Identity forward; its backward scales by a global: a difference only backward shows."""

    @staticmethod
    def forward(ctx, x, key):
        ctx.key = key
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * _BEHAVIOUR.get(ctx.key, 1.0), None


class _Scaled(nn.Module):
    def __init__(self, how: str = "scalar"):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        y = self.lin(x)
        scale = _BEHAVIOUR.get(id(self), 1.0)
        if self.how == "scalar":
            return y * scale
        if self.how == "constant":  # a tensor made from Python values as it runs
            return y * torch.tensor([scale] * 8)
        return _GlobalGrad.apply(y, id(self))  # "backward"


@pytest.mark.parametrize("how", ["scalar", "constant", "backward"])
def test_layers_alike_in_state_but_not_in_behaviour_are_traced_plainly(caplog, how):
    """Equal state is not proof: a forward reading something outside its state (here a global
    keyed by the module: a scalar, a tensor made of it, a custom backward reading it) runs
    differently for the second layer, and stitching is refused."""

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_Scaled(how) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).sum()

    torch.manual_seed(0)
    m, x = M(), torch.randn(4, 8)
    _BEHAVIOUR[id(m.layers[1])] = 3.0
    try:
        with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
            prog = fxshard.shard(m, fxshard.MeshSpec((2,)), {}, example_inputs=(x,), training=True)
        assert "trace to different graphs" in caplog.text
        loss, grads = prog.simulate(x)
        m.zero_grad()
        ref = m(x)
        ref.backward()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
        for name, p in m.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-5)
    finally:
        _BEHAVIOUR.clear()
