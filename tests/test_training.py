"""Training: the joint forward+backward graph sharded as one program.

Breadth on simulated ranks (loss, every parameter gradient and the input gradient against single
device), collective counts against DTensor's, awkward models; end to end on gloo: optimizers on
local shards (``fxshard.parallelize``) give single-device weights.
"""

from collections import Counter

import e2e_workers
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import MLP, ConvNet, Llama, example_input, init_weights, megatron_tp_plan, mlp_plan
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils.checkpoint import checkpoint

import fxshard
from fxshard import zoo
from fxshard.runtime.launch import spawn


def _reference(model, x, grad_outputs=None):
    model.zero_grad()
    out = model(*x)
    out.backward(grad_outputs if grad_outputs is not None else torch.ones_like(out))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for i, t in enumerate(x):
        if isinstance(t, torch.Tensor) and t.grad is not None:
            grads[f"input:{i}"] = t.grad.clone()
    return out.detach(), grads


def _check(model, mesh, plan, x, grad_outputs=None):
    want_out, want = _reference(model, x, grad_outputs)
    prog = fxshard.shard(model, mesh, plan, example_inputs=x, training=True)
    out, grads = prog.simulate(*x, grad_outputs=grad_outputs)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert set(grads) == set(want)
    for k in want:
        torch.testing.assert_close(grads[k], want[k], rtol=1e-5, atol=1e-5, msg=f"gradient of {k}")
    return prog


def _scalar_loss(model):
    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *x):
            return self.model(*x).float().pow(2).mean()

    return Loss()


def _prefixed(plan, prefix="model."):
    return {prefix + k: v for k, v in plan.items()}


CASES = [
    ("mlp tp", lambda: init_weights(MLP()), (2,), None, mlp_plan),
    ("mlp dp x tp", lambda: init_weights(MLP()), (2, 2), ("dp", "tp"), mlp_plan),
    ("llama tp", lambda: init_weights(Llama()), (4,), None, megatron_tp_plan),
    ("llama sp", lambda: init_weights(Llama()), (4,), None, zoo.sequence_parallel_plan),
    ("llama dp x tp", lambda: init_weights(Llama()), (2, 4), ("dp", "tp"), megatron_tp_plan),
    (
        "llama sp dp x tp",
        lambda: init_weights(Llama()),
        (2, 2),
        ("dp", "tp"),
        zoo.sequence_parallel_plan,
    ),
    ("convnet dp", lambda: init_weights(ConvNet()), (2,), ("dp",), dict),
]


@pytest.mark.parametrize("name,make,shape,names,plan", CASES, ids=[c[0] for c in CASES])
def test_loss_and_gradients_match_single_device(name, make, shape, names, plan):
    model = _scalar_loss(make())
    x = example_input(model.model)
    if x[0].is_floating_point():
        x = (x[0].clone().requires_grad_(),)  # the input gradient is checked too
    _check(model, fxshard.MeshSpec(shape, names=names), _prefixed(plan()), x)


def _phase_counts(prog):
    out = {"forward": Counter(), "backward": Counter()}
    for c in prog.collectives():
        out[c.phase][c.kind] += 1
    return {k: dict(v) for k, v in out.items()}


def test_megatron_backward_sums_partial_gradients_before_reducing():
    """Plain Colwise/Rowwise (no PrepareModuleInput): DTensor + torch.compile emits 10 backward
    all-reduces on this model (one per q/k/v/w1/w3 input gradient); the q/k/v (and w1/w3) partial
    gradients meet at one value, so fxshard sums them and reduces once: 2 per layer."""
    model = _scalar_loss(init_weights(Llama()))
    prog = _check(
        model, fxshard.MeshSpec((4,)), _prefixed(megatron_tp_plan()), example_input(model.model)
    )
    assert _phase_counts(prog) == {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 4}}


def test_sequence_parallel_needs_no_more_than_dtensor():
    model = _scalar_loss(init_weights(Llama()))
    prog = _check(
        model,
        fxshard.MeshSpec((4,)),
        _prefixed(zoo.sequence_parallel_plan()),
        example_input(model.model),
    )
    counts = _phase_counts(prog)
    # DTensor: 6 AG + 5 RS forward, 5 AG + 5 RS backward.  fxshard does not gather the vocab-sharded
    # logits: the loss is computed on the shards and only its scalar is all-reduced (loss parallel);
    # the 5 small backward all-reduces are the replicated norm weights' gradients, which DTensor
    # leaves Partial for the optimizer step.
    assert counts["forward"] == {"all_gather": 5, "reduce_scatter": 5, "all_reduce": 1}
    assert (
        counts["backward"].get("all_gather", 0) <= 5
        and counts["backward"].get("reduce_scatter", 0) <= 5
    )
    assert set(counts["backward"]) <= {"all_gather", "reduce_scatter", "all_reduce"}


def test_data_parallel_gradients_are_reduced_in_the_graph():
    model = _scalar_loss(init_weights(MLP()))
    prog = _check(
        model,
        fxshard.MeshSpec((2, 2), names=("dp", "tp")),
        _prefixed(mlp_plan()),
        example_input(model.model),
    )
    dp_reductions = [
        c for c in prog.planned_collectives() if c.phase == "backward" and c.mesh_dims == (0,)
    ]
    assert {c.kind for c in dp_reductions} == {"all_reduce"} and len(
        dp_reductions
    ) == 4  # every parameter
    # the per-rank graph runs them bucketed: one all-reduce carrying all four
    (run,) = [c for c in prog.collectives() if c.phase == "backward" and c.mesh_dims == (0,)]
    assert run.kind == "all_reduce" and sorted(run.carries, key=str) == sorted(
        dp_reductions, key=str
    )


def test_non_scalar_output_takes_grad_outputs():
    model = init_weights(MLP())
    x = example_input(model)
    g = torch.randn(model(*x).shape, generator=torch.Generator().manual_seed(3))
    _check(model, fxshard.MeshSpec((2,)), mlp_plan(), x, grad_outputs=[g])
    prog = fxshard.shard(model, fxshard.MeshSpec((2,)), mlp_plan(), example_inputs=x, training=True)
    with pytest.raises(ValueError, match="not a scalar loss: pass grad_outputs="):
        prog.simulate(*x)


def test_frozen_parameter_inside_a_sharded_layer():
    model = init_weights(MLP())
    model.fc1.bias.requires_grad_(False)
    model = _scalar_loss(model)
    prog = _check(model, fxshard.MeshSpec((2,)), _prefixed(mlp_plan()), example_input(model.model))
    out, grads = prog.simulate(*example_input(model.model))
    assert "model.fc1.bias" not in grads and "model.fc1.weight" in grads


class CheckpointedBlocks(nn.Module):
    """Activation checkpointing around each block and a no_grad statistic inside forward."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MLP() for _ in range(2))
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=False)
        with torch.no_grad():
            norm = x.detach().pow(2).mean().sqrt()
        return F.gelu(x / norm) * self.scale


def test_checkpoint_and_no_grad_regions():
    model = _scalar_loss(init_weights(CheckpointedBlocks()))
    plan = {f"model.blocks.{i}.{k}": v for i in range(2) for k, v in mlp_plan().items()}
    x = (example_input(MLP())[0].requires_grad_(),)
    _check(model, fxshard.MeshSpec((2,)), plan, x)


# ---- end to end on gloo: optimizers on local shards ----------------------------------------------


@pytest.mark.slow
def test_local_shard_training_matches_single_device():
    # SGD: weights agree to fp32 noise.  AdamW divides each gradient element by its own running
    # magnitude, so elements with gradients near zero (~1e-9) amplify reduction-order differences to
    # ~lr x 1e-2; weights agree to ~1e-3 of their scale there.
    for r in spawn(2, e2e_workers.train_parallel, (2,), ("tp",), "llama", False, 3, "sgd"):
        assert r["rel"] < 1e-5, r
    for r in spawn(2, e2e_workers.train_parallel, (2,), ("tp",), "llama", False, 3, "adamw"):
        assert r["rel"] < 2e-3, r
    for r in spawn(4, e2e_workers.train_parallel, (2, 2), ("dp", "tp"), "llama", True, 3, "sgd"):
        assert r["rel"] < 1e-5, r


# ---- the torch.compile backend under loss.backward() ---------------------------------------------


@pytest.mark.parametrize("model_cls", [Llama, zoo.GraphBreakLlama])
def test_backend_backward_gives_single_device_gradients(model_cls):
    model = init_weights(model_cls())
    ref = init_weights(model_cls())
    x = example_input(model)
    ref(*x).float().pow(2).mean().backward()
    torch._dynamo.reset()
    f = torch.compile(
        model,
        backend="fxshard",
        options={
            "mesh": fxshard.MeshSpec((2, 2), names=("dp", "tp")),
            "plan": megatron_tp_plan(),
            "simulate": True,
        },
    )
    loss = f(*x).float().pow(2).mean()
    loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
    with torch.no_grad():  # inference after training: the forward-only program, no gradients
        torch.testing.assert_close(f(*x), ref(*x), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_backend_training_on_gloo_matches_single_device():
    for rel in spawn(4, e2e_workers.backend_train, (2, 2), ("dp", "tp"), True):
        assert rel < 1e-5


# ---- regressions from review: one rank of a real (gloo) group, eager per-rank graphs -------------


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.runtime.launch import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


class MaskAndValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return (y > 0).to(y.dtype), y  # the first output has no gradient (no tangent)


def test_gradients_match_outputs_by_index_not_position(one_rank_mesh):
    model, ref = MaskAndValue(), MaskAndValue()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    ref(x)[1].sum().backward()
    torch._dynamo.reset()
    f = torch.compile(
        model, backend="fxshard", options={"mesh": one_rank_mesh, "plan": {}, "inductor": False}
    )
    mask, y = f(x)
    assert not mask.requires_grad
    y.sum().backward()
    torch.testing.assert_close(model.fc.weight.grad, ref.fc.weight.grad)


def test_double_backward_is_an_error(one_rank_mesh):
    model = init_weights(MLP())
    torch._dynamo.reset()
    f = torch.compile(
        model, backend="fxshard", options={"mesh": one_rank_mesh, "plan": {}, "inductor": False}
    )
    x = example_input(model)[0].requires_grad_()
    with pytest.raises(Exception, match="double backward"):
        torch.autograd.grad(f(x).sum(), x, create_graph=True)


def test_parallelize_follows_freezing_eval_mode_and_tied_weights(one_rank_mesh):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.drop = nn.Dropout(0.5)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t):
            return {"logits": self.head(self.drop(self.emb(t)))}

    model = Tied()
    t = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(0))
    ref = model.eval()(t)["logits"].detach()
    pm = fxshard.parallelize(model.train(), one_rank_mesh, {}, inductor=False)
    assert pm.module.head.weight is pm.module.emb.weight
    with torch.no_grad():
        pm.train()
        pm(t)
        pm.eval()
        out = pm(t)  # a new program: dropout off
    assert isinstance(out, dict)
    torch.testing.assert_close(out["logits"], ref)
    pm.module.emb.weight.requires_grad_(False)
    assert not pm(t)["logits"].requires_grad  # frozen: the inference program, as eagerly
    pm.module.emb.weight.requires_grad_(True)
    pm(t)["logits"].sum().backward()  # unfrozen: a new program that computes its gradient
    assert pm.module.emb.weight.grad is not None


def test_float_arguments_are_part_of_the_signature():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, scale: float):
            return self.fc(x) * scale

    model = Scaled()
    x = torch.randn(2, 4)
    for dynamic in (None, True):
        torch._dynamo.reset()
        f = torch.compile(
            model,
            backend="fxshard",
            dynamic=dynamic,
            options={"mesh": fxshard.MeshSpec((2,)), "plan": {}, "simulate": True},
        )
        with torch.no_grad():
            for scale in (2.0, 3.0, 5.0):
                torch.testing.assert_close(f(x, scale), model(x, scale))


def test_batchnorm_running_stats_update_is_an_error():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    torch._dynamo.reset()
    f = torch.compile(
        model,
        backend="fxshard",
        options={"mesh": fxshard.MeshSpec((2,)), "plan": {}, "simulate": True},
    )
    with pytest.raises(Exception, match=r"1\.running_mean.*do not apply in-place"):
        f(torch.randn(8, 4)).sum().backward()


class _VocabLoss(nn.Module):
    """Hidden states -> a vocab-parallel head -> a loss people train with."""

    def __init__(self, loss, dim=32, vocab=2000):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.loss = loss

    def forward(self, h, y):
        logits = self.head(self.norm(h)).float()
        return self.loss(logits.flatten(0, 1), y.flatten())


_LOSSES = {
    "ce": lambda z, y: F.cross_entropy(z, y),
    "ce_ignore_smoothing": lambda z, y: F.cross_entropy(
        z, y, ignore_index=-100, label_smoothing=0.1
    ),
    "ce_sum": lambda z, y: F.cross_entropy(z, y, reduction="sum"),
    "ce_none": lambda z, y: F.cross_entropy(z, y, reduction="none", ignore_index=-100).sum(),
    "log_softmax_nll": lambda z, y: F.nll_loss(F.log_softmax(z, -1), y, ignore_index=-100),
}


@pytest.mark.parametrize("loss", list(_LOSSES))
@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_a_loss_on_vocab_sharded_logits_is_computed_on_the_shards(loss, mesh):
    """Loss parallel found by the compiler: a cross-entropy (or log_softmax + nll_loss) of logits
    left vocab-sharded by the plan takes each row's max and sum of exponentials across ranks and
    the target's logit from the rank holding it, so no collective moves a (tokens x vocab)
    tensor, forward or backward (it moved the logits by all-to-all, twice); loss and gradients are
    single device's (targets on every shard, some ignored)."""
    torch.manual_seed(0)
    model = _VocabLoss(_LOSSES[loss])
    h = torch.randn(4, 32, 32)
    y = torch.randint(0, 2000, (4, 32))
    if loss in ("ce_ignore_smoothing", "ce_none", "log_softmax_nll"):
        y[0, :3] = -100
    # (2, 2): the plan on the last mesh dim (tp), batch on the other
    plan = {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    prog = _check(model, fxshard.MeshSpec(mesh, names=("dp", "tp")[-len(mesh) :]), plan, (h, y))
    shard_bytes = 4 * 32 * 2000 * 4 // mesh[-1]  # logits of 1 MB: moving them costs
    tp = len(mesh) - 1  # (on the batch dim the planner may gather a gradient for its weight's)
    moved = [c for c in prog.collectives() if tp in c.mesh_dims and c.bytes >= shard_bytes // 4]
    assert not moved, prog.explain()


def test_parallelize_is_called_as_the_model_is(one_rank_mesh):
    """Keywords, keyword-only arguments, None, flags and dicts of tensors reach the model's forward
    as they were passed (transformers models are called ``model(input_ids=x, labels=y)``); each
    distinct set of constants is its own program; an object a program cannot take is a clear
    TypeError naming it."""

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, mask=None, *, extra=None, scale: float = 1.0, square=False):
            y = self.fc(x) * scale
            if mask is not None:
                y = y * mask
            if extra is not None:
                y = y + extra["bias"]
            return {"y": y * y if square else y}

    torch.manual_seed(0)
    model = Keywords()
    ref = Keywords()
    ref.load_state_dict(model.state_dict())
    pm = fxshard.parallelize(model, one_rank_mesh, {}, inductor=False)
    x, mask, bias = torch.randn(3, 4), (torch.rand(3, 4) > 0.5).float(), torch.randn(4)
    calls = [
        ((x,), {}),
        ((x,), {"mask": mask}),
        ((), {"x": x, "extra": {"bias": bias}, "scale": 2.0}),
        ((x, None), {"scale": 2.0, "square": True}),
        ((x,), {"scale": 3.0}),
    ]
    for args, kwargs in calls:
        with torch.no_grad():
            torch.testing.assert_close(pm(*args, **kwargs)["y"], ref(*args, **kwargs)["y"])
    assert len(pm._programs) == len(calls)  # the constants are part of each program
    # under autograd: the parameters' gradients of a keyword call
    pm(x, mask=mask, extra={"bias": bias}, square=True)["y"].sum().backward()
    ref(x, mask=mask, extra={"bias": bias}, square=True)["y"].sum().backward()
    torch.testing.assert_close(pm.module.fc.weight.grad.full_tensor(), ref.fc.weight.grad)

    class Cache:  # an object pytree does not know (a transformers cache)
        pass

    with pytest.raises(TypeError, match="called with a Cache.*use_cache=False"):
        pm(x, extra=Cache())


def test_parallelize_returns_the_objects_the_model_returns(one_rank_mesh):
    """A forward that returns an object pytree does not know (transformers' default call returns
    a DynamicCache; a user's state object): the program hands back a new object of its class
    holding the program's tensors (shared references kept shared), with and without autograd,
    and a loss that reads it trains exactly.  A parallelize program failed on it before (gloo
    ranks, where the cache stays sharded: test_user_paths)."""

    class Layer:
        def __init__(self, keys, step):
            self.keys, self.step = keys, step

    class State:  # an object pytree does not know, holding tensors at depth
        def __init__(self, layers):
            self.layers = layers
            self.first = layers[0]
            self.name = "state"

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            return {"y": h.sum(-1), "state": State([Layer(h * 2, 0), Layer(h.relu(), 1)])}

    torch.manual_seed(0)
    model, ref = Stateful(), Stateful()
    ref.load_state_dict(model.state_dict())
    pm = fxshard.parallelize(model, one_rank_mesh, {}, inductor=False)
    x = torch.randn(3, 4)
    with torch.no_grad():
        got, want = pm(x), ref(x)
        again = pm(x)
    state = got["state"]
    assert type(state) is State and [type(layer) for layer in state.layers] == [Layer, Layer]
    assert state.first is state.layers[0] and state.name == "state" and state.layers[1].step == 1
    assert again["state"] is not state  # every call its own object, as eager
    for a, b in zip(state.layers, want["state"].layers):
        torch.testing.assert_close(a.keys, b.keys)
    # under autograd: a loss that reads the returned object
    for m in (pm, ref):
        out = m(x)
        (out["y"].sum() + out["state"].layers[1].keys.pow(2).sum()).backward()
    torch.testing.assert_close(pm.module.fc.weight.grad.full_tensor(), ref.fc.weight.grad)


def test_a_compiled_call_does_not_rebuild_the_device_mesh(one_rank_mesh, monkeypatch):
    """A call of a compiled graph reads no DeviceMesh.mesh once its program is built: the
    property rebuilds the mesh's rank tensor each time (about 25 us here), and the backend read
    it several times per call (the mesh as a MeshSpec, the agreement checks' group), about 0.3 ms
    of a tiny model's 7 ms decode step on 2 ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    from fxshard import kept

    class Cached(nn.Module):  # a decode step's shape: state stored into an object, read back
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, cache):
            cache.value = self.fc(x) + cache.value
            return cache.value.sum()

    class Cache:
        pass

    torch._dynamo.reset()
    model = Cached()
    f = torch.compile(model, backend="fxshard", options={"mesh": one_rank_mesh, "plan": {}})
    cache = Cache()
    cache.value = kept(torch.zeros(2, 4))
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(2):  # compiles (the second call's cache holds a KeptTensor now)
            f(x, cache)
        reads = [0]
        mesh = DeviceMesh.mesh

        def counted(self):
            reads[0] += 1
            return mesh.fget(self)

        monkeypatch.setattr(DeviceMesh, "mesh", property(counted))
        for _ in range(3):
            f(x, cache)
    assert reads[0] == 0, reads
