"""Compile it: the torch.compile backend, prog.compile() and local-shard modules.

Breadth runs in this process (the backend's ``simulate`` option: every rank, exact collectives);
the end-to-end checks run Inductor's output on real gloo process groups (2 and 4 ranks, slow).
"""

import copy
from collections import Counter

import e2e_workers
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from models import MLP, ConvNet, Llama, example_input, init_weights, megatron_tp_plan, mlp_plan
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard
from fxshard import zoo
from fxshard.backend import ShardedGraph, compiled_programs, programs_built
from fxshard.ir import info
from fxshard.runtime.launch import spawn

MESH_TP = fxshard.MeshSpec((4,), names=("tp",))
MESH_DP_TP = fxshard.MeshSpec((2, 2), names=("dp", "tp"))


def _compile(model, mesh, plan, **kw):
    """The backend in simulate mode, called for inference (under autograd it shards the joint graph:
    tests/test_training.py)."""
    torch._dynamo.reset()
    f = torch.compile(
        model, backend="fxshard", options={"mesh": mesh, "plan": plan, "simulate": True}, **kw
    )

    def call(*args):
        with torch.no_grad():
            return f(*args)

    return call


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _kinds(prog):
    return dict(Counter(c.kind for c in prog.collectives()))


@pytest.mark.parametrize(
    "name,mesh,plan,expect",
    [
        ("mlp", MESH_TP, mlp_plan, {"all_reduce": 1}),
        # the dp dim's batch shards are gathered at the end: a graph hands back global values
        ("llama", MESH_DP_TP, megatron_tp_plan, {"all_reduce": 4, "all_gather": 1}),
        # sequence parallel: DTensor's 5 AG + 5 RS, plus the gather of the vocab-sharded logits
        ("llama_sp", MESH_TP, zoo.sequence_parallel_plan, {"all_gather": 6, "reduce_scatter": 5}),
    ],
)
def test_backend_matches_single_device(name, mesh, plan, expect):
    model = init_weights(MLP() if name == "mlp" else Llama())
    x = example_input(model)
    f = _compile(model, mesh, plan())
    _close(f(*x), model(*x))
    prog = compiled_programs()[-1]
    assert _kinds(prog) == expect
    # the same program as fxshard.shard builds from torch.export, bar the final gathers
    direct = _kinds(fxshard.shard(model, mesh, plan(), example_inputs=x))
    for kind, n in direct.items():
        assert expect.get(kind, 0) >= n


@pytest.mark.parametrize("training", [False, True])
def test_backend_plan_auto_matches_single_device(training):
    """plan="auto" through torch.compile: dynamo's capture marks the repeated layers too (layer 1
    shares layer 0's decisions), a memory budget forces parameter sharding, outputs (and, under
    autograd, the joint graph's parameter gradients) equal single device."""
    model = init_weights(Llama())
    ref = copy.deepcopy(model)
    x = example_input(model)
    hand = fxshard.shard(
        model, MESH_TP, megatron_tp_plan(), example_inputs=x, training=training
    ).modelled_cost()
    budget = hand["state_bytes"] * (4 if training else 1)
    torch._dynamo.reset()
    f = torch.compile(
        model,
        backend="fxshard",
        options={
            "mesh": MESH_TP,
            "plan": "auto",
            "simulate": True,
            "auto_options": fxshard.AutoOptions(memory_budget=budget),
        },
    )
    with torch.set_grad_enabled(training):
        out, want = f(*x), ref(*x)
    _close(out, want)
    if training:
        out.float().pow(2).mean().backward()
        want.float().pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            _close(p.grad, q.grad)
    prog = compiled_programs()[-1]
    rep = prog.captured.auto
    assert rep is not None and rep.shared_layers == 1 and rep.memory_bytes <= budget, str(rep)
    assert any(
        info(n).spec.num_shards > 1
        for n in prog.global_graph.graph.nodes
        if info(n).kind == "param"
    )


def test_backend_without_plan_entries_replicates_and_matches():
    model = init_weights(ConvNet())
    x = example_input(model)
    _close(_compile(model, fxshard.MeshSpec((2,)), {})(*x), model(*x))


def test_graph_break_gives_the_same_result():
    model = init_weights(zoo.GraphBreakLlama())
    plain = init_weights(Llama())
    x = example_input(model)
    f = _compile(model, MESH_DP_TP, megatron_tp_plan())
    n_before = programs_built()
    _close(f(*x), plain(*x))
    progs = compiled_programs(n_before)
    # dynamo compiles each layer's frame on its own after a break in the loop (and may reuse one
    # layer's graph for the next: placements are then layer 0's, values layer 1's, still correct):
    # parameters are found by FQN in the whole model, so the plan applies, 2 all-reduces per layer
    layers = [
        p
        for p in progs
        if any((info(n).fqn or "").endswith("attention.wq.weight") for n in p.placeholders)
    ]
    assert layers and all(_kinds(p).get("all_reduce") == 2 for p in layers)
    assert all(
        info(n).fqn.startswith("layers.") for p in layers for n in p.placeholders if info(n).fqn
    )


def _wrapped(forward):
    """A forward wrapped as transformers' decorators wrap it (``def inner(*args, **kwargs)``):
    dynamo then reads the module as ``L['args'][0]``."""
    import functools

    @functools.wraps(forward)
    def inner(*args, **kwargs):
        return forward(*args, **kwargs)

    return inner


class WrappedMLP(MLP):
    forward = _wrapped(MLP.forward)


class WrappedOuter(nn.Module):
    """The plan's FQNs go through a wrapped outer forward into a wrapped inner one."""

    def __init__(self):
        super().__init__()
        self.model = WrappedMLP()

    @_wrapped
    def forward(self, x):
        # a tensor constant in the code (as HF's cache and mask helpers make): traced as get_attr
        return self.model(x) * torch.tensor([2.0])


@pytest.mark.parametrize("outer", [False, True])
def test_wrapped_forwards_and_traced_constants(outer):
    """Parameters of a module whose forward is wrapped are found (``L['args'][0]._modules``), so
    the plan applies: the Megatron all-reduce, forward and backward equal single device."""
    model = init_weights(WrappedOuter() if outer else WrappedMLP())
    ref = copy.deepcopy(model)
    plan = {f"{'model.' if outer else ''}{k}": v for k, v in mlp_plan().items()}
    (x,) = example_input(model.model if outer else model)
    f = _compile(model, MESH_TP, plan)
    n_before = programs_built()
    _close(f(x), ref(x))
    (prog,) = compiled_programs(n_before)
    assert _kinds(prog) == {"all_reduce": 1}, prog.explain()
    # under autograd: the joint program, single-device gradients
    torch._dynamo.reset()
    g = torch.compile(
        model, backend="fxshard", options={"mesh": MESH_TP, "plan": plan, "simulate": True}
    )
    out, want = g(x), ref(x)
    _close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):  # fp32, another reduction order
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)


def test_function_of_a_list_of_modules_without_a_plan():
    """Modules handed to a function in a list (``L['mods'][0]._parameters``) are frame roots of
    their own: with no plan there is nothing to place, and each keeps its own FQNs."""
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4), nn.Linear(4, 4)]
    x = torch.randn(2, 4)

    def f(t, ms):
        return ms[1](torch.relu(ms[0](t)))

    torch._dynamo.reset()
    g = torch.compile(f, backend="fxshard", options={"mesh": MESH_TP, "plan": {}, "simulate": True})
    n_before = programs_built()
    with torch.no_grad():
        _close(g(x, mods), f(x, mods))
    (prog,) = compiled_programs(n_before)
    fqns = sorted(info(p).fqn for p in prog.placeholders if info(p).fqn)
    assert fqns == ["ms[0].bias", "ms[0].weight", "ms[1].bias", "ms[1].weight"], fqns  # frame names


def test_hugging_face_llama_default_call_with_its_tp_plan():
    """transformers' own LlamaForCausalLM (wrapped forwards, a DynamicCache made by the default
    call: tensor constants) compiled with its tp_plan: 2 all-reduces per layer, the logits gathered
    by colwise_gather_output, equal to single device."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,  # divisible by the 4 ranks (fewer kv heads is issue 20's uneven)
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits
        f = _compile(model, MESH_TP, model.tp_plan)
        n_before = programs_built()
        _close(f(x).logits, want)
    (prog,) = compiled_programs(n_before)
    kinds = _kinds(prog)
    # 4 all-reduces (2 layers x attention, mlp) and the gathered logits; the default call's
    # DynamicCache hands its keys and values back global (simulated ranks): one all-gather each
    # per layer, all five in one bucket (independent, at the end of the graph)
    assert kinds == {"all_reduce": 4, "all_gather": 1}, kinds
    (gather,) = [c for c in prog.collectives() if c.kind == "all_gather"]
    assert len(gather.carries) == 5, gather
    # model.compile(backend=...) (HF's own entry) and greedy generate() with its DynamicCache:
    # the tokens of single device
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    model.compile(
        backend="fxshard", options={"mesh": MESH_TP, "plan": model.tp_plan, "simulate": True}
    )
    mask = torch.ones_like(x)
    with torch.no_grad():
        tokens = model.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
        want_tokens = ref.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, want_tokens)
    # training as HF users train: labels=, the default call; loss and gradients of single device
    model = ref
    ref = copy.deepcopy(model).train()
    model.train()
    want = ref(x, labels=x).loss
    want.backward()
    torch._dynamo.reset()
    g = torch.compile(
        model, backend="fxshard", options={"mesh": MESH_TP, "plan": model.tp_plan, "simulate": True}
    )
    loss = g(x, labels=x).loss
    loss.backward()
    _close(loss, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_gpt2_conv1d_is_a_transposed_linear():
    """GPT-2's Conv1D (weight stored (in, out)) under Colwise / Rowwise: the output features are
    weight dim 1, so colwise shards weight dim 1 and the bias, rowwise weight dim 0: one
    all-reduce per MLP, equal to single device."""
    transformers = pytest.importorskip("transformers")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cfg = transformers.GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=64,
        n_layer=2,
        n_head=4,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    x = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    plan = {
        "transformer.h.*.mlp.c_fc": ColwiseParallel(),
        "transformer.h.*.mlp.c_proj": RowwiseParallel(),
    }
    with torch.no_grad():
        want = model(x).logits
    f = _compile(model, MESH_TP, plan)
    n_before = programs_built()
    _close(f(x).logits, want)
    (prog,) = compiled_programs(n_before)
    assert _kinds(prog) == {"all_reduce": 2}, prog.explain()
    specs = {info(p).fqn: str(info(p).spec) for p in prog.placeholders if info(p).fqn}
    assert specs["transformer.h.0.mlp.c_fc.weight"] == "S(1)"
    assert specs["transformer.h.0.mlp.c_fc.bias"] == "S(0)"
    assert specs["transformer.h.0.mlp.c_proj.weight"] == "S(0)"
    assert specs["transformer.h.0.mlp.c_proj.bias"] == "R"


def test_fullgraph_on_the_zoo():
    for model, plan in (
        (init_weights(Llama()), megatron_tp_plan()),
        (init_weights(MLP()), mlp_plan()),
    ):
        x = example_input(model)
        _close(_compile(model, MESH_TP, plan, fullgraph=True)(*x), model(*x))


@pytest.mark.parametrize("dynamic", [None, False, True])
def test_recompiles_on_new_shapes(dynamic):
    model = init_weights(Llama())
    f = _compile(model, MESH_DP_TP, megatron_tp_plan(), dynamic=dynamic)
    for batch, seq in ((4, 8), (2, 8), (2, 4), (4, 8)):
        x = example_input(model, batch=batch, seq=seq)
        _close(f(*x), model(*x))


def test_backend_is_registered_by_entry_point():
    assert "fxshard" in torch._dynamo.list_backends()


@pytest.mark.parametrize(
    "options,match",
    [
        (
            {},
            "missing option\\(s\\) \\['mesh', 'plan'\\].*options=\\{\"mesh\": device_mesh, "
            '"plan": plan\\}',
        ),
        ({"mesh": MESH_TP}, "missing option\\(s\\) \\['plan'\\]"),
        ({"mesh": MESH_TP, "plan": {}}, 'a MeshSpec only works with "simulate": True'),
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "bucket": 1},
            "unknown option\\(s\\) \\['bucket'\\]",
        ),
        (
            {"mesh": MESH_TP, "plan": {"fc9": "colwise"}, "simulate": True},
            "'fc9' matches no module of MLP",
        ),
        # every option's type and range, when the options are read
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "bucket_bytes": "25MB"},
            r"'bucket_bytes' takes a number of bytes >= 0 .*25 \* 2\*\*20",
        ),
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "bucket_bytes": -1},
            "'bucket_bytes' takes a number of bytes >= 0",
        ),
        ({"mesh": 4, "plan": {}}, "'mesh' takes a DeviceMesh"),
        ({"mesh": MESH_TP, "plan": {}, "simulate": "yes"}, "'simulate' takes True or False"),
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "auto_options": {"time_budget_s": 1}},
            "auto_options applies to plan='auto'",
        ),
        (
            {"mesh": MESH_TP, "plan": "auto", "simulate": True, "auto_options": {"memory": 1}},
            r"unknown field\(s\) \['memory'\]",
        ),
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "output_placements": Shard(0)},
            r"output_placements takes a list with one placements tuple per output.*\[\(Shard",
        ),
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "output_placements": [Shard(0)]},
            r"output_placements\[0\] = Shard\(dim=0\): each output takes a tuple",
        ),
        (
            {"mesh": MESH_TP, "plan": {}, "simulate": True, "search": "best"},
            '\'search\' takes "global" or "greedy"',
        ),
    ],
)
def test_backend_errors_say_what_to_pass(options, match):
    model = init_weights(MLP())
    torch._dynamo.reset()
    f = torch.compile(model, backend="fxshard", options=options)
    with pytest.raises(Exception, match=match):
        f(*example_input(model))


def test_backend_without_options_says_what_to_pass():
    model = init_weights(MLP())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="missing option"):
        torch.compile(model, backend="fxshard")(*example_input(model))


def test_parameter_shards_are_cached_and_refreshed():
    """Slice once; a replaced parameter or an in-place update (version counter) slices again."""
    g = ShardedGraph.__new__(ShardedGraph)
    g._shards = {}
    spec = fxshard.ShardingSpec.make(MESH_TP, (fxshard._torch.Shard(0),), (8, 2), torch.float32)
    calls = []

    class Fake:
        coord_ints = (1,)

        def local_of(self, t, s):
            calls.append(t)
            return s.local_of(t, (1,))

    w = torch.randn(8, 2)
    a = g._cached_shard(0, w, spec, Fake())
    b = g._cached_shard(0, w, spec, Fake())
    assert a is b and len(calls) == 1
    w.mul_(2)  # in place: version moves
    c = g._cached_shard(0, w, spec, Fake())
    assert len(calls) == 2 and torch.equal(c, w[2:4])
    w2 = w.clone()  # replaced: a new object
    g._cached_shard(0, w2, spec, Fake())
    assert len(calls) == 3
    w2.data = torch.randn(8, 2)  # new storage behind the same object (no version bump)
    d = g._cached_shard(0, w2, spec, Fake())
    assert len(calls) == 4 and torch.equal(d, w2[2:4])


def test_compile_needs_a_process_group_and_mesh():
    model = init_weights(MLP())
    prog = fxshard.shard(model, MESH_TP, mlp_plan(), example_inputs=example_input(model))
    with pytest.raises(ValueError, match="needs a DeviceMesh"):
        prog.compile()


def test_parallelize_meta_model_holds_only_local_shards():
    """4 ranks' worth of parameters on a fake process group: rank 0 allocates only its shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0
            self.storages = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # new storages only: views (a DTensor's local tensor handed to from_local) are free
            for t in out if isinstance(out, (tuple, list)) else (out,):
                real = isinstance(t, torch.Tensor) and t.device.type != "meta"
                if real and not isinstance(t, DTensor):
                    s = t.untyped_storage()
                    if s.data_ptr() not in self.storages:
                        self.storages.add(s.data_ptr())
                        self.bytes += s.nbytes()
            return out

    cfg = zoo.LlamaConfig(dim=256, n_heads=4, n_kv_heads=4, ffn_hidden=1024, vocab_size=64)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dm = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = zoo.Llama(cfg)
        total = sum(p.numel() * 4 for p in model.parameters())
        with Allocations() as alloc:
            pm = fxshard.parallelize(model, dm, megatron_tp_plan())
        sharded = sum(
            pm.specs[f].shape.numel()
            if hasattr(pm.specs[f].shape, "numel")
            else torch.Size(pm.specs[f].shape).numel()
            for f, p in pm.module.named_parameters()
            if any(pm.specs[f].levels)
        )
        held = sum(p.to_local().numel() * 4 for p in pm.parameters())  # DTensors
        assert held == total - sharded * 4 * 3 // 4  # sharded weights: a quarter each
        assert held < 0.35 * total
        assert alloc.bytes <= pm.local_bytes() * 1.01  # nothing global was ever materialised
        with pytest.raises(RuntimeError, match="load_full_state_dict"):
            pm(*example_input(Llama(cfg)))
    finally:
        dist.destroy_process_group()


# ---- end to end on real process groups (gloo, loopback) ------------------------------------------


@pytest.mark.slow
def test_compiled_on_four_gloo_ranks():
    cases = [
        ("llama", (4,), ("tp",), "program"),
        ("llama", (4,), ("tp",), "backend"),
        ("llama", (2, 2), ("dp", "tp"), "program"),
        ("llama", (2, 2), ("dp", "tp"), "backend"),
        ("mlp", (4,), ("tp",), "backend"),
    ]
    results = spawn(4, e2e_workers.compile_zoo, cases)
    for rank_results in results:
        assert len(rank_results) == len(cases)
        for name, shape, path, rel in rank_results:
            assert rel < 1e-5, (name, shape, path, rel)


@pytest.mark.slow
def test_compiled_on_two_gloo_ranks():
    cases = [
        ("mlp", (2,), ("tp",), "program"),
        ("mlp", (2,), ("tp",), "backend"),
        ("mlp", (2,), ("tp",), "backend_eager"),
        ("graph_break", (2,), ("tp",), "backend"),
        ("mlp", (2,), ("tp",), "backend_updates"),
    ]
    for rank_results in spawn(2, e2e_workers.compile_zoo, cases):
        for name, shape, path, rel in rank_results:
            assert rel < 1e-5, (name, shape, path, rel)
    for r in spawn(2, e2e_workers.parallelize_meta, True):
        assert r["rel"] < 1e-5 and r["roundtrip"]
        assert r["held"] < r["total"]


def test_models_module_is_importable_by_workers():
    assert isinstance(e2e_workers.MODELS["mlp"][0](), nn.Module)


def test_every_tp_plan_style_of_the_pinned_transformers_is_known():
    """Each style string transformers' ParallelInterface registers is either placed by fxshard or
    refused with what it would need (a new transformers style fails this test until classified)."""
    transformers = pytest.importorskip("transformers")
    from transformers.distributed.tensor_parallel import ParallelInterface

    from fxshard.placement.constraints import HF_STYLES, HF_STYLES_NOT_YET

    styles = set(ParallelInterface._global_mapping)
    assert styles, transformers.__version__
    assert not styles - set(HF_STYLES) - set(HF_STYLES_NOT_YET), sorted(
        styles - set(HF_STYLES) - set(HF_STYLES_NOT_YET)
    )
    model = zoo.MLP()
    with pytest.raises(NotImplementedError, match="MegaMoE"):
        fxshard.shard(
            model, MESH_TP, {"fc1": "megamoe_experts"}, example_inputs=example_input(model)
        )
    with pytest.raises(ValueError, match="fused experts' weight parameters"):  # a module entry
        fxshard.shard(model, MESH_TP, {"fc1": "grouped_gemm"}, example_inputs=example_input(model))


class FusedMLP(nn.Module):
    """gate and up projections fused into one weight (packed), a norm between."""

    def __init__(self, dim=16, hidden=32):
        super().__init__()
        self.norm = zoo.RMSNorm(dim)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return self.proj(self.down(torch.nn.functional.silu(gate) * up))


@pytest.mark.parametrize(
    "plan",
    [
        {"gate_up": "packed_colwise", "down": "rowwise", "norm": "replicated_with_grad_allreduce"},
        {"gate_up": "colwise_rep", "down": "rowwise_rep", "proj": "all_reduce"},
        {"gate_up": "colwise", "down": "packed_rowwise", "norm": "replicate"},
    ],
    ids=["packed_colwise", "rep", "packed_rowwise"],
)
def test_tp_plan_styles_match_single_device(plan):
    model = init_weights(FusedMLP())
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    prog = fxshard.shard(model, MESH_TP, plan, example_inputs=(x,))
    _close(prog.simulate(x), model(x))
    train = fxshard.shard(model, MESH_TP, plan, example_inputs=(x,), training=True)
    out, grads = train.simulate(x, grad_outputs=[torch.ones(4, 8, 16)])
    model(x).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hidden", [32, 30], ids=["even", "uneven"])
def test_packed_colwise_splits_gate_from_up_for_free(hidden):
    """A packed gate/up weight's output stays strided (as transformers hands it on), so the split
    into gate and up, and the cat of their gradients, move nothing: the fused MLP runs the one
    all-reduce forward and one backward, as an unfused one does (30 hidden features: 8, 8, 8, 6
    of each of gate and up per rank)."""
    model = init_weights(FusedMLP(hidden=hidden))
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    plan = {"gate_up": "packed_colwise", "down": "rowwise"}
    prog = fxshard.shard(model, MESH_TP, plan, example_inputs=(x,))
    assert [c.kind for c in prog.collectives()] == ["all_reduce"]
    _close(prog.simulate(x), model(x))
    train = fxshard.shard(model, MESH_TP, plan, example_inputs=(x,), training=True)
    assert [c.kind for c in train.collectives()] == ["all_reduce", "all_reduce"]
    _, grads = train.simulate(x, grad_outputs=[torch.ones(4, 8, 16)])
    model(x).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5)


class CacheWriter(nn.Module):
    """A step that writes its new entry into a cache tensor in place (as HF's StaticCache does)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, cache, pos):
        cache.index_copy_(1, pos, self.fc(x))
        return cache.sum(1)


def test_an_input_updated_in_place_is_written_back():
    """A cache handed in and updated in place (index_copy_ at a position given as a tensor): the
    caller's tensor holds the new entries after every call, as eagerly, and one program serves
    every position."""
    torch.manual_seed(0)
    model, ref = CacheWriter(), CacheWriter()
    ref.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    f = _compile(model, MESH_TP, {"fc": "colwise"})
    n0 = programs_built()
    mine, theirs = torch.zeros(2, 6, 8), torch.zeros(2, 6, 8)
    for t in range(4):
        x, pos = torch.randn(2, 1, 8), torch.tensor([t])
        with torch.no_grad():
            _close(f(x, mine, pos), ref(x, theirs, pos))
        assert torch.equal(mine, theirs), t
    assert len(compiled_programs(n0)) == 1


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.o = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.o(torch.relu(self.q(x)))


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_a_block_compiled_on_its_own_reads_its_plan_from_the_block(how):
    """Blocks compiled one by one, called from an eager parent: the plan names the block's own
    submodules (it named the parent's before, and failed with _orig_mod suggestions)."""
    torch.manual_seed(0)
    model = _Blocks()
    ref = copy.deepcopy(model)
    plan = {"q": ColwiseParallel(), "o": RowwiseParallel()}
    options = {"mesh": fxshard.MeshSpec((2,), ("tp",)), "plan": plan, "simulate": True}
    torch._dynamo.reset()
    n0 = programs_built()
    for i, block in enumerate(model.blocks):
        if how == "torch.compile":
            model.blocks[i] = torch.compile(block, backend="fxshard", options=options)
        else:
            block.compile(backend="fxshard", options=options)
    x = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    progs = compiled_programs(n0)
    assert progs and all([c.kind for c in p.collectives()] == ["all_reduce"] for p in progs)
