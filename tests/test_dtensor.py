"""DTensor at program boundaries (``fxshard.runtime.boundary``): DTensor arguments and outputs of
compiled graphs, a KV cache kept sharded across decode calls, ``fxshard.parallelize``'s DTensor
parameters with DCP checkpoints and torch optimizers.

The layout checks run DTensor itself on simulated ranks (``LocalTensorMode`` over a fake process
group); the end-to-end checks run on real gloo ranks (slow)."""

from __future__ import annotations

import e2e_workers
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard._torch import StridedShard, local_tensor_mode, local_tensor_values
from fxshard.backend import BackendOptions
from fxshard.runtime.boundary import spec_of, wrap_output
from fxshard.runtime.launch import spawn

LAYOUTS = [
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((4,), [Replicate()]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(1), Shard(1)]),
    ((2, 2), [Shard(0), Shard(0)]),
    ((2, 2), [Replicate(), Shard(2)]),
    # mesh dim 1 splits dim 0 first, then mesh dim 0: DTensor's encoding of that shard order
    ((2, 2), [StridedShard(0, split_factor=2), Shard(0)]),
    ((2, 2), [Shard(0), Partial()]),
]


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shape,placements", LAYOUTS, ids=lambda v: str(v))
def test_dtensor_layouts_are_fxshard_layouts(fake_world, shape, placements):
    """Every rank's DTensor local tensor is fxshard's local shard of the same spec, and a local
    shard wrapped back is that DTensor again (placements, shape, values on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = torch.arange(8 * 4 * 8, dtype=torch.float32).view(8, 4, 8)
    weight = torch.randn(8, 4, 8)
    with local_tensor_mode(4):
        dm = init_device_mesh("cpu", shape)
        # redistributed from replicated: torch 2.13's distribute_tensor mislays _StridedShard
        # (two ranks get the same rows), its redistribute does not
        plain = [Replicate() if isinstance(p, Partial) else p for p in placements]
        dt = distribute_tensor(full, dm, [Replicate()] * len(shape)).redistribute(dm, plain)
        if plain != placements:  # a Partial dim: every rank holds half, the halves sum to full
            dt = DTensor.from_local(dt.to_local() / 2, dm, placements, run_check=False)
        mesh = fxshard.MeshSpec(shape)
        spec = spec_of(dt, mesh)
        locals_ = local_tensor_values(dt.to_local(), 4)
        back = wrap_output(dt.to_local(), dm, spec)
        again = local_tensor_values(back.to_local(), 4)
        # one layout, maybe spelled another way (a shard order, or the strided shards encoding it)
        assert spec_of(back, mesh) == spec and back.shape == dt.shape
        # ... that DTensor's own ops and autograd read right
        assert torch.equal((back * 2).sum(-1).full_tensor(), (full * 2).sum(-1))
        leaf = dt.to_local().detach().clone().requires_grad_(True)
        w = distribute_tensor(weight, dm, [Replicate()] * len(shape))
        (wrap_output(leaf, dm, spec) * w).sum().backward()
        grads = local_tensor_values(leaf.grad, 4)
        w_plain = local_tensor_values(w.redistribute(dm, plain).to_local(), 4)
        assert torch.equal(back.full_tensor(), full) and torch.equal(dt.full_tensor(), full)
    coords = [
        tuple(int(i) for i in c)
        for c in torch.cartesian_prod(*[torch.arange(k) for k in shape]).view(-1, len(shape))
    ]
    partial = any(isinstance(p, Partial) for p in placements)
    for rank, coord in enumerate(coords):
        if partial:
            assert locals_[rank].shape == spec.local_shape(coord)
        else:
            assert torch.equal(locals_[rank], spec.local_of(full, coord)), (rank, coord, spec)
        assert torch.equal(again[rank], locals_[rank])
        # d(sum(x * w))/dx: this rank's shard of w (a Partial output: its share, w / 2 here)
        want = spec.local_of(weight, coord) if not partial else w_plain[rank] / 2
        assert torch.allclose(grads[rank], want), (rank, coord, spec)


def test_a_dtensor_of_another_mesh_is_refused(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    with local_tensor_mode(4):
        dt = distribute_tensor(torch.randn(8, 4), init_device_mesh("cpu", (4,)), [Shard(0)])
        with pytest.raises(ValueError, match=r"mesh of shape \(4,\).*redistribute it"):
            spec_of(dt, fxshard.MeshSpec((2, 2)), "argument 0")


def test_dtensor_outputs_need_a_device_mesh():
    with pytest.raises(ValueError, match="DTensor outputs"):
        BackendOptions.parse({"mesh": (2,), "plan": {}, "simulate": True, "outputs": "dtensor"})
    with pytest.raises(ValueError, match="outputs must be one of"):
        BackendOptions.parse({"mesh": (2,), "plan": {}, "simulate": True, "outputs": "local"})


@pytest.mark.slow
def test_backend_takes_and_returns_dtensors():
    """Elementwise on a Shard(0) DTensor: no collective, a Shard(0) DTensor back.  A colwise layer,
    a graph break, a rowwise layer: with DTensor outputs the two graphs run exactly the one-graph
    program's collectives (the break costs none); with global outputs the break costs an
    all-gather.  A DTensor input that requires grad gets its gradient as a DTensor placed like
    it."""
    for rank, r in enumerate(spawn(2, e2e_workers.dtensor_backend, timeout=600)):
        e = r["elementwise"]
        assert e["type"] == "DTensor" and e["placements"] == (Shard(0),), e
        assert e["collectives"] == [[]] and e["local_shape"] == (4, 6) and e["err"] == 0.0, e
        # 7 rows on 2 ranks: 4 and 3, run as they are (no gather at entry)
        assert r["uneven"] == {
            "type": "DTensor",
            "local_rows": (4, 6) if rank == 0 else (3, 6),
            "collectives": [[]],
            "err": 0.0,
        }, r["uneven"]
        assert r["rowwise_input"]["collectives"] == [["all_reduce"]], r["rowwise_input"]
        assert r["rowwise_input"]["err"] < 1e-5
        g = r["graph_break"]
        assert g["one graph"]["collectives"] == [["all_reduce"]], g
        assert g["dtensor"]["collectives"] == [[], ["all_reduce"]], g
        assert g["global"]["collectives"] == [["all_gather"], ["all_reduce"]], g
        for mode in g.values():
            assert mode["err"] < 1e-5 and mode["again"] < 1e-5, g
        t = r["train"]
        assert t["grad_type"] == "DTensor" and t["grad_placements"] == (Shard(0),), t
        assert t["err"] < 1e-5, t


@pytest.mark.slow
def test_decode_keeps_the_kv_cache_sharded(tmp_path):
    """Greedy decoding with a static KV cache on 2 ranks: the cache comes back and goes in as
    heads-sharded DTensors, a token costs the plan's 2 all-reduces per layer of (batch, 1, dim)
    and nothing on the cache, every step's logits equal single device, two programs in all."""
    for r in spawn(2, e2e_workers.decode_cache, str(tmp_path), timeout=600):
        p = r["parallelize"]
        assert r["varied"] > 2  # the test model's tokens change from step to step
        assert p["same_tokens"] and p["err"] < 1e-3, p
        assert p["cache"] == [("DTensor", (Shard(1),))] * 2, p
        batch, dim, layers = 2, 64, 2
        assert p["decode"] == [("all_reduce", batch * dim * 4)] * (2 * layers), p
        assert p["programs"] == 2, p


@pytest.mark.slow
def test_parallelize_state_is_dtensors_for_dcp_and_optimizers(tmp_path):
    """state_dict() is DTensors under the model's FQNs; DCP save/load round-trips, reshards into
    another plan, and loads both ways between fxshard and torch's parallelize_module; AdamW
    (foreach) with clip_grad_norm_ on the DTensor parameters tracks single device."""
    for r in spawn(2, e2e_workers.dtensor_state, str(tmp_path), timeout=600):
        sd = r["state_dict"]
        assert sd["keys_match"] and sd["all_dtensors"], sd
        assert sd["wq"] == (Shard(0),) and sd["wo"] == (Shard(1),), sd
        for k in ("forward_err", "reload_err", "resharded_err", "from_torch_err", "into_torch_err"):
            assert r[k] < 1e-5, (k, r)
        a = r["adamw"]
        assert a["grad_type"] == "DTensor"
        norms = a["norms"]
        assert abs(norms[0] - norms[2]) < 1e-5 * norms[0] and abs(norms[1] - norms[3]) < 1e-4
        assert a["rel"] < 2e-3, a  # AdamW amplifies reduction-order noise (see test_training)


def test_input_placements_may_leave_an_input_to_the_default():
    """A None entry of input_placements (what the backend passes for plain arguments next to
    DTensor ones) keeps that input's default placement; a ShardingSpec entry is taken as it is,
    shard order included."""
    from fxshard.core.spec import ShardingSpec
    from fxshard.ir import INPUT, info

    mesh = fxshard.MeshSpec((2, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    order = ShardingSpec.make(mesh, (Shard(0), Shard(0)), (8, 4), torch.float32, {0: (1, 0)})
    even = ShardingSpec.make(mesh, (Shard(0), Shard(1)), (8, 4), torch.float32)
    for given in (order, even):
        prog = fxshard.shard(
            lambda a, b: a * 2 + b,
            mesh,
            example_inputs=(x, y),
            input_placements=[None, given],
            output_placements=[given],
        )
        specs = [info(p).spec for p in prog.placeholders if info(p).kind == INPUT]
        assert specs[0].placements == (Replicate(), Replicate()) and specs[1] == given
        assert torch.equal(prog.simulate(x, y), x * 2 + y)
    # the default order: a * 2 sliced locally, b and the output as they are.  (A non-default
    # order costs an all-to-all here: elementwise rules offer default-order states only.)
    assert prog.collectives() == []


def test_parallelize_state_dict_keys_are_the_models_here_and_nested(fake_world):
    """The state dict carries the model's own FQNs (no wrapper prefix) with DTensor values, and
    loads back, also when the parallelized module sits inside another module."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fxshard import zoo

    dm = init_device_mesh("cpu", (4,))
    pm = fxshard.parallelize(zoo.MLP(), dm, zoo.mlp_plan())
    sd = pm.state_dict()
    assert sorted(sd) == sorted(zoo.MLP().state_dict()) and all(
        isinstance(v, DTensor) for v in sd.values()
    )
    assert sd["fc1.weight"].placements == (Shard(0),) and sd["fc2.weight"].placements == (Shard(1),)
    pm.load_state_dict(sd)
    outer = torch.nn.Module()
    outer.pm = pm
    nested = outer.state_dict()
    assert sorted(nested) == sorted(f"pm.{k}" for k in sd)
    outer.load_state_dict(nested)  # strict: every key found


@pytest.mark.slow
def test_a_users_cache_object_stays_sharded_between_calls():
    """state="sharded": a user's cache object (tensors as attributes, updated in place) stays
    heads-sharded between decode calls, so a step costs the plan's one all-reduce of (2, 1, 64)
    and nothing on the cache (state="global" gathers it every call); outputs equal single device;
    an eager read of the attribute gathers the cache (single device's) and the next call goes on
    from it; a cache tensor a list also holds stays global (the list reads the value); a write to
    the tensor behind its object's back is an error on the next call, not a stale read."""
    for r in spawn(2, e2e_workers.own_cache_state, timeout=600):
        assert r["err"] < 1e-5 and r["after_read"] < 1e-5, r
        assert r["held"] == [((Shard(1),), (2, 2, 8, 16))] * 4, r
        assert r["decode"] == [("all_reduce", 2 * 64 * 4)], r
        assert r["programs"] == 2, r  # global cache in (first call), then its shard
        assert r["type"] == "CacheLayer"  # the hook keeps the user's class name
        assert r["eager_k"] == 0.0 and r["dropped"], r
        assert r["listed"] == {"err": r["listed"]["err"], "kept": False, "read": 0.0}, r
        assert r["listed"]["err"] < 1e-5
        assert "written to directly" in r["behind"] and "L['layer'].v" in r["behind"], r
        g = r["global"]  # state="global": gathered every call, and said once
        assert g["err"] < 1e-5 and not g["kept"], g
        assert g["kinds"] == ["all_gather", "all_gather", "all_reduce"], g
        assert len(g["hint"]) == 1 and "L['layer'].k" in g["hint"][0], g


@pytest.mark.slow
def test_hf_static_cache_stays_sharded_in_generate():
    """transformers' Llama under its own tp_plan, generate(cache_implementation="static") with
    state="sharded": greedy tokens equal single device on two generations (the second resets
    the cache: gathered, zeroed, reused), sampled tokens too for one seed; a decode step costs
    the plan's 2 all-reduces per layer + the head's gather and nothing on the cache; between
    direct calls the StaticCache layers hold their heads' shard, and reading them eagerly gives
    single device's cache."""
    for r in spawn(2, e2e_workers.hf_static_cache_state, timeout=900):
        assert r["greedy"] == [True, True] and r["sampled"], r
        assert r["varied"] > 3, r
        batch, hidden, vocab = 2, 64, 128
        want = [("all_reduce", batch * hidden * 4)] * 4 + [("all_gather", batch * vocab * 4 // 2)]
        assert r["decode"] == want, r
        assert r["programs"] == 3, r  # prefill, first decode (global cache in), decode
        d = r["direct"]
        assert d["err"] < 1e-5 and d["keys"] < 1e-6 and d["dropped"], d
        assert d["held"] == ((Shard(1),), (2, 2, 12, 8)), d


def test_state_option_and_which_arguments_are_state():
    from fxshard.backend import _attribute

    with pytest.raises(ValueError, match="state must be one of"):
        BackendOptions.parse({"mesh": (2,), "plan": {}, "simulate": True, "state": "local"})
    assert _attribute("L['kwargs']['past_key_values'].layers[0].keys", {}) == "keys"
    assert _attribute("L['cache'].layers[1].__dict__['values']", {}) == "values"
    for src in (
        "L['x']",
        "L['args'][2]",
        "L['self']._modules['fc']._parameters['weight']",
        "L['self']._modules['m']._buffers['cache']",
        "G['table'].k",
    ):
        assert _attribute(src, {}) is None, src


def test_the_state_hook_reads_through_in_compiled_code():
    """The class hook runtime.state puts on a cache object: the object keeps its class's name and
    behaviour (an instance of it), compiled code reads the attribute as it is (no gather traced),
    eager code with nothing held reads it too; only plain objects own state (a module's tensor
    attribute is not hooked)."""
    from fxshard.runtime import state

    class Layer:
        def __init__(self):
            self.k = torch.arange(6.0).reshape(2, 3)

        def bump(self):
            self.k.add_(1)
            return self.k.sum()

    class Guarded:  # its own property for the name: reads are not the instance dict's
        @property
        def k(self):
            return self.__dict__["k"]

        @k.setter
        def k(self, v):
            self.__dict__["k"] = v

    layer, guarded = Layer(), Guarded()
    guarded.k = torch.zeros(2)
    assert state._owners(layer.k, "k") == [layer]
    mod = torch.nn.Module()
    mod.k = torch.zeros(2)
    assert state._owners(mod.k, "k") == [] and state._owners(guarded.k, "k") == []
    state._hook(layer, "k")
    hooked = type(layer)
    assert hooked.__name__ == "Layer" and isinstance(layer, Layer)
    assert hooked is not Layer and "k" in hooked._fxshard_kept
    assert state._owners(layer.k, "k") == [layer]  # hooked already: still an owner
    state._hook(layer, "k")
    fresh = Layer()
    state._hook(fresh, "k")
    assert type(layer) is hooked and type(fresh) is hooked  # once per class: one subclass
    graphs = []

    def backend(gm, example):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    bump = torch.compile(lambda obj: obj.bump(), backend=backend)
    assert float(bump(layer)) == 21.0 and float(layer.k.sum()) == 21.0
    assert len(graphs) == 1  # no graph break at the property
    assert not any("gather" in str(n.target) for n in graphs[0].graph.nodes)
    layer.k = torch.zeros(3)  # the setter stores the new tensor
    assert layer.__dict__["k"] is layer.k and state.kept(layer.k) is None
