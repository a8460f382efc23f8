"""Hugging Face models as their users run them: a coverage matrix of transformers architectures
(tiny, random weights, built from config: nothing downloaded) x {fxshard.shard + simulate,
torch.compile(backend="fxshard") on the default call, training with labels=, generate()}, on 4
simulated ranks with each model's own tp_plan (a hand plan or "auto" where it has none), every
result against single device."""

import copy

import pytest
import torch

import fxshard
from fxshard.backend import compiled_programs, programs_built
from fxshard.ir import PARAM, info

T = pytest.importorskip("transformers")

MESH = fxshard.MeshSpec((4,), ("tp",))
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
HEADS = dict(num_attention_heads=8, num_key_value_heads=4)
MOE = dict(num_experts_per_tok=2, head_dim=8)


def _gpt2_plan():  # GPT-2 has no tp_plan: its MLP's Conv1D layers, Megatron style
    return {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


# name -> (model factory, plan (None: the model's own tp_plan), input kind)
ARCHS = {
    # 2 kv heads on 4 ranks: half a head per rank (uneven heads)
    "llama": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, num_attention_heads=8,
                                                       num_key_value_heads=2)), None, "text"),
    "llama_eager": (lambda: T.LlamaForCausalLM(T.LlamaConfig(**SMALL, **HEADS,
                                                             attn_implementation="eager")),
                    None, "text"),
    "qwen2": (lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SMALL, **HEADS)), None, "text"),
    "qwen3": (lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**SMALL, **HEADS, head_dim=8)), None,
              "text"),
    "mistral": (lambda: T.MistralForCausalLM(T.MistralConfig(**SMALL, **HEADS, head_dim=8)), None,
                "text"),
    "gemma2": (lambda: T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, **HEADS, head_dim=8,
                                                          attn_implementation="eager")),
               None, "text"),
    "phi3": (lambda: T.Phi3ForCausalLM(T.Phi3Config(**SMALL, **HEADS, pad_token_id=0)), None,
             "text"),
    "olmo2": (lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**SMALL, **HEADS)), None, "text"),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2,
                                                    n_head=8, n_positions=64, resid_pdrop=0.0,
                                                    embd_pdrop=0.0, attn_pdrop=0.0)),
             _gpt2_plan, "text"),
    "mixtral": (lambda: T.MixtralForCausalLM(T.MixtralConfig(**SMALL, **HEADS, **MOE,
                                                             num_local_experts=4)), None, "text"),
    "qwen3_moe": (lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**SMALL, **HEADS, **MOE,
                                                                 moe_intermediate_size=32,
                                                                 num_experts=4)), None, "text"),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(**SMALL, num_attention_heads=8,
                                                    hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0)),
             lambda: "auto", "masked"),
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=64, intermediate_size=128,
                                                            num_hidden_layers=2,
                                                            num_attention_heads=8, image_size=16,
                                                            patch_size=4, num_labels=5)),
            lambda: "auto", "vision"),
}  # fmt: skip
MOES = {"mixtral", "qwen3_moe"}


def _build(name):
    make, plan, kind = ARCHS[name]
    torch.manual_seed(0)
    model = make().eval()
    plan = model.tp_plan if plan is None else plan()
    g = torch.Generator().manual_seed(1)
    if kind == "vision":
        x, labels = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([1, 3])
    else:
        x = torch.randint(1, 128, (2, 8), generator=g)
        labels = x
    return model, plan, kind, x, labels


def _close(a, b, **kw):
    torch.testing.assert_close(a, b, **{"rtol": 1e-5, "atol": 1e-5, **kw})


def _compile(model, plan):
    torch._dynamo.reset()
    return torch.compile(
        model, backend="fxshard", options={"mesh": MESH, "plan": plan, "simulate": True}
    )


class Logits(torch.nn.Module):
    """The model called as a user calls it for logits (no cache), for fxshard.shard."""

    def __init__(self, model, kind):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, x):
        if self.kind == "text":
            return self.model(x, use_cache=False).logits
        return self.model(x).logits


def _prefixed(plan, model):
    if not isinstance(plan, dict):
        return plan
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    # the model's tp_plan covers dense and MoE variants: the entries this model has
    return {
        f"model.{k}": v
        for k, v in plan.items()
        if any(fxshard.placement.constraints._match(k, n) for n in names)
    }


def _train_and_compare(model, ref, plan, x, labels):
    """loss.backward() through the backend vs single device: the loss and every gradient."""
    want = ref(x, labels=labels).loss
    want.backward()
    loss = _compile(model, plan)(x, labels=labels).loss
    loss.backward()
    _close(loss, want)
    for (fqn, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            _close(p.grad, q.grad, rtol=1e-4, msg=fqn)


@pytest.mark.parametrize("name", list(ARCHS))
def test_shard_and_simulate(name):
    model, plan, kind, x, _ = _build(name)
    wrapped = Logits(model, kind)
    prog = fxshard.shard(wrapped, MESH, _prefixed(plan, model), example_inputs=(x,))
    assert not prog.warnings, prog.warnings
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))
    if isinstance(plan, dict):  # the plan's parameters are sharded
        assert any(
            info(p).fqn and not all(pl.is_replicate() for pl in info(p).spec.placements)
            for p in prog.placeholders
        )


def test_a_wrapped_model_keeps_its_own_plans_leniency():
    """A transformers model inside a user's module, its whole tp_plan named under the module's FQN
    (as a user writes it for shard / parallelize): the entries of the architecture's other
    variants (Qwen3-MoE's dense-MLP entries) are skipped as transformers skips them; an entry of
    the user's own that matches nothing is still an error."""
    model, plan, kind, x, _ = _build("qwen3_moe")
    wrapped = Logits(model, kind)
    whole = {f"model.{k}": v for k, v in plan.items()}
    assert whole != _prefixed(plan, model)  # some entries match nothing in this model
    prog = fxshard.shard(wrapped, MESH, whole, example_inputs=(x,))
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))
    with pytest.raises(ValueError, match=r"fxshard: plan entry 'model\.model\.layerz\.\*\.mlp'"):
        fxshard.shard(wrapped, MESH, {**whole, "model.model.layerz.*.mlp": "colwise"},
                      example_inputs=(x,))  # fmt: skip


@pytest.mark.parametrize("name", list(ARCHS))
def test_compile_default_call(name):
    """torch.compile(model, backend="fxshard") called with the model's defaults (a DynamicCache
    for decoders)."""
    model, plan, _, x, _ = _build(name)
    ref = copy.deepcopy(model)
    n0 = programs_built()
    with torch.no_grad():
        _close(_compile(model, plan)(x).logits, ref(x).logits)
    assert all(not p.warnings for p in compiled_programs(n0))


@pytest.mark.parametrize("name", list(ARCHS))
def test_training_with_labels(name):
    """loss = model(x, labels=...).loss; loss.backward() through the backend: loss and every
    gradient of single device."""
    model, plan, _, x, labels = _build(name)
    model.train()
    ref = copy.deepcopy(model)
    _train_and_compare(model, ref, plan, x, labels)


@pytest.mark.parametrize("name", [n for n, a in ARCHS.items() if a[2] == "text"])
def test_generate(name):
    """model.compile(backend="fxshard") then greedy generate(): the tokens of single device."""
    model, plan, _, x, _ = _build(name)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    model.compile(backend="fxshard", options={"mesh": MESH, "plan": plan, "simulate": True})
    mask = torch.ones_like(x)
    with torch.no_grad():
        got = model.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
        want = ref.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert torch.equal(got, want)


def test_generate_with_a_static_cache_builds_two_programs():
    """generate(cache_implementation="static"): the cache tensors are updated in place by the
    compiled decode step, so one generation builds two programs, prefill and decode, however
    many tokens it makes; the tokens of single device."""
    model, plan, _, x, _ = _build("llama")
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    model.compile(backend="fxshard", options={"mesh": MESH, "plan": plan, "simulate": True})
    mask = torch.ones_like(x)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, cache_implementation="static")
    n0 = programs_built()
    with torch.no_grad():
        got = model.generate(x, **kw)
        want = ref.generate(x, **kw)
    assert torch.equal(got, want)
    assert len(compiled_programs(n0)) == 2


def test_moe_experts_are_sharded_as_the_tp_plan_says():
    """Mixtral's tp_plan names the fused experts' parameters: gate_up_proj [E, 2I, H] packed
    colwise (gate and up strided on dim 1), down_proj [E, H, I] rowwise (dim 2); the grouped
    matmuls run on those shards (no all-to-all of a weight) and the experts' output is summed."""
    model, plan, _, x, _ = _build("mixtral")
    if not any(".experts." in k for k in plan):
        pytest.skip(f"transformers {T.__version__}: Mixtral's tp_plan leaves the experts whole")
    wrapped = Logits(model, "text")
    prog = fxshard.shard(wrapped, MESH, _prefixed(plan, model), example_inputs=(x,))
    spec = {info(p).fqn: info(p).spec for p in prog.placeholders if info(p).fqn}
    gate_up = spec["model.model.layers.0.mlp.experts.gate_up_proj"].placements[0]
    assert fxshard._torch.is_strided_shard(gate_up) and gate_up.dim == 1
    assert spec["model.model.layers.0.mlp.experts.down_proj"].placements[0].dim == 2
    moved = [c for c in prog.collectives() if "grouped_mm" in c.provenance]
    assert all(c.bytes < 16384 for c in moved), moved  # activations only, never a weight
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))


@pytest.mark.parametrize("name", sorted(MOES))
def test_moe_layers_cost_the_megatron_minimum(name):
    """Under the model's tp_plan a MoE decoder layer costs one all-reduce after attention and one
    after the experts (HF's TP and torch's parallelize_module cost as many): the experts' masked
    output (``where(mask, 0, y)``, then scaled by the routing weights, gathered and summed) stays
    Partial until the layer's output is needed (it was reduce-scattered and gathered: 3 per
    layer), and equals single device."""
    import collections

    model, plan, _, x, _ = _build(name)
    wrapped = Logits(model, "text")
    prog = fxshard.shard(wrapped, MESH, _prefixed(plan, model), example_inputs=(x,))
    layers = model.config.num_hidden_layers
    # (transformers 5.25's plans leave the experts whole: attention's all-reduce alone)
    per_layer = 2 if any(".experts." in k for k in plan) else 1
    # and 5.25's plans split the embedding by rows (``embedding_rowwise``): one more all-reduce
    embedding = sum("embed" in k and "rowwise" in str(v) for k, v in plan.items())
    counts = collections.Counter(c.kind for c in prog.collectives())
    want = {"all_reduce": per_layer * layers + embedding, "all_gather": 1}  # + the head's gather
    assert counts == want, counts
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))


_VIEWS = {
    f"aten.{op}"
    for op in ("t.default", "view.default", "permute.default", "transpose.int", "_to_copy.default",
               "unsqueeze.default", "expand.default", "reshape.default", "slice.Tensor",
               "select.int", "alias.default")
}  # fmt: skip


def _weights_moved(prog) -> list[str]:
    """The redistributions that move a parameter (or a view or cast of one): a collective of the
    program whose input is a weight, not an activation computed from it."""
    weights = set()
    for n in prog.global_graph.graph.nodes:
        if n.op == "placeholder" and info(n).kind == PARAM:
            weights.add(n)
        elif n.op == "call_function" and str(n.target) in _VIEWS and n.args[0] in weights:
            weights.add(n)
    moving = {c.node for c in prog.planned_collectives()}
    return [n.name for n in prog.redistribute_nodes() if n.args[0] in weights and n.name in moving]


@pytest.mark.parametrize("name", sorted(MOES))
def test_expert_parallelism_with_the_models_ep_plan(name):
    """The model's expert-parallel plan (transformers' ``base_model_ep_plan``: ``grouped_gemm``
    experts' weights, an ``ep_router`` gate, ``moe_tp_experts``): each rank holds a block of whole
    experts (the fused weights' dim 0) and computes their rows of the routed tokens; the experts'
    output is summed.  Forward and training through the backend equal single device, and no
    weight is ever moved."""
    model, _, _, x, labels = _build(name)
    plan = dict(model._ep_plan)
    # the router style: ``ep_router`` (transformers 5.17), ``ep_dispatch_experts`` (5.25)
    styles = set(plan.values())
    assert "grouped_gemm" in styles and styles & {"ep_router", "ep_dispatch_experts"}, plan
    ref = copy.deepcopy(model)
    n0 = programs_built()
    with torch.no_grad():
        _close(_compile(model, plan)(x).logits, ref(x).logits)
    (prog,) = compiled_programs(n0)
    experts = {info(p).fqn: str(info(p).spec) for p in prog.placeholders
               if info(p).fqn and ".experts." in info(p).fqn}  # fmt: skip
    assert experts and set(experts.values()) == {"S(0)"}, experts
    assert not _weights_moved(prog), prog.explain()
    model.train()
    ref.train()
    n0 = programs_built()
    _train_and_compare(model, ref, plan, x, labels)
    # the experts regions train too: each rank's pairs forward and backward
    local = {str(n.target) for p in compiled_programs(n0) for n in p.local_graph.graph.nodes}
    assert "fxshard.moe_experts_local_backward.default" in local


def test_parameter_entries_need_tp_plan_strings():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model, _, _, x, _ = _build("mixtral")
    with pytest.raises(ValueError, match="names parameters"):
        fxshard.shard(
            Logits(model, "text"),
            MESH,
            {"model.model.layers.*.mlp.experts.down_proj": ColwiseParallel()},
            example_inputs=(x,),
        )


def _experts_nodes(prog):
    from fxshard.rules.experts import MOE_EXPERTS

    return [n for n in prog.global_graph.graph.nodes if n.target is MOE_EXPERTS]


@pytest.mark.parametrize("name", sorted(MOES))
def test_expert_parallelism_by_token_dispatch(name):
    """Experts split by experts (``grouped_gemm``) and tokens split by rows (a batch-sharded,
    data-parallel input): each experts module is one region whose tokens are dispatched to their
    experts' ranks and back (all-to-all inside the op, torchtitan's EP), no weight moved, no
    token gathered; the output stays split by rows and equals single device."""
    from torch.distributed.tensor import Shard

    model, _, _, _, _ = _build(name)
    x = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(3))
    plan = {k: v for k, v in model._ep_plan.items() if v == "grouped_gemm"}
    wrapped = Logits(model, "text")
    rows = [(Shard(0),)]
    prog = fxshard.shard(wrapped, MESH, _prefixed(plan, model), example_inputs=(x,),
                         input_placements=rows, output_placements=rows)  # fmt: skip
    nodes = _experts_nodes(prog)
    assert len(nodes) == model.config.num_hidden_layers
    for n in nodes:
        specs = [str(s) for s in info(n).input_specs]
        assert specs[:3] == ["S(0)"] * 3 and set(specs[3:]) == {"S(0)"}, specs
        assert str(info(n).spec) == "S(0)"
    local = {str(n.target) for n in prog.local_graph.graph.nodes}
    assert "fxshard.moe_experts_dispatch.default" in local
    # inside each region: counts, rows there, results back; nothing else moves
    kinds = [(c.kind, c.transition) for c in prog.collectives()]
    assert kinds == [("all_to_all", "dispatch")] * 3 * len(nodes), prog.explain()
    cost = prog.modelled_cost()
    assert cost["compute_us"] > 0
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))


@pytest.mark.parametrize("name", sorted(MOES))
def test_the_ep_plan_costs_one_all_reduce_per_moe_layer(name):
    """Under the model's expert-parallel plan (tokens replicated within the group) each experts
    module is one region: a rank computes its experts' pairs and the layer's output is summed
    once, as transformers' EP does (the grouped matmuls' rules cost 2 reduce-scatters, an
    all-gather and an all-reduce per layer)."""
    import collections

    model, _, _, x, _ = _build(name)
    if "ep_router" not in model._ep_plan.values():
        pytest.skip(
            f"transformers {T.__version__}'s EP plan dispatches tokens (ep_dispatch_experts): "
            "test_expert_parallelism_by_token_dispatch covers that"
        )
    wrapped = Logits(model, "text")
    prog = fxshard.shard(wrapped, MESH, _prefixed(dict(model._ep_plan), model),
                         example_inputs=(x,))  # fmt: skip
    assert [str(info(n).spec) for n in _experts_nodes(prog)] == ["P"] * 2
    counts = collections.Counter(c.kind for c in prog.collectives())
    assert counts == {"all_reduce": model.config.num_hidden_layers}, prog.explain()
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))


def _experts_block(kind, experts=4, hidden=16, inter=32, seed=0):
    """A router and a transformers experts module (Mixtral's or Qwen3-MoE's class), top 2."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            if kind == "mixtral":
                cfg = T.MixtralConfig(hidden_size=hidden, intermediate_size=inter,
                                      num_local_experts=experts, num_experts_per_tok=2)  # fmt: skip
                self.experts = MixtralExperts(cfg)
            else:
                cfg = T.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                                       num_experts=experts, num_experts_per_tok=2)  # fmt: skip
                self.experts = Qwen3MoeExperts(cfg)
            self.gate = torch.nn.Linear(hidden, experts, bias=False)

        def forward(self, x):
            w, idx = torch.topk(self.gate(x).softmax(-1), 2)
            return self.experts(x, idx, w / w.sum(-1, keepdim=True))

    torch.manual_seed(seed)
    block = Block()
    with torch.no_grad():
        for p in block.experts.parameters():
            p.normal_(0, 0.2)
    return block


EXPERTS_PLAN = {"experts.gate_up_proj": "grouped_gemm", "experts.down_proj": "grouped_gemm"}


@pytest.mark.parametrize(
    "kind,experts,tokens", [("mixtral", 4, 32), ("qwen3_moe", 7, 30), ("mixtral", 8, 13)]
)
def test_token_dispatch_trains(kind, experts, tokens):
    """Training with tokens split by rows and experts by experts (data parallel + expert
    parallel, torchtitan's layout; uneven tokens and expert blocks too): the forward dispatches
    tokens by all-to-all, the backward sends the rows and their gradients to the experts' ranks
    and the gradients back; the output and every gradient equal single device's, and the only
    collectives move the router's gradient (and nothing of the tokens or experts)."""
    import collections

    from torch.distributed.tensor import Shard

    model = _experts_block(kind, experts)
    ref = copy.deepcopy(model)
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1))
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.backward(torch.ones_like(want))
    rows = [(Shard(0),)]
    prog = fxshard.shard(model, MESH, EXPERTS_PLAN, example_inputs=(x.requires_grad_(),),
                         input_placements=rows, output_placements=rows, training=True)  # fmt: skip
    local = collections.Counter(str(n.target) for n in prog.local_graph.graph.nodes)
    assert local["fxshard.moe_experts_dispatch.default"] == 1
    assert local["fxshard.moe_experts_dispatch_backward.default"] == 1
    kinds = collections.Counter((c.kind, c.phase) for c in prog.collectives())
    assert kinds[("all_to_all", "forward")] == 3, prog.explain()
    assert kinds[("all_to_all", "backward")] == 5, prog.explain()
    # besides: the router's gradient all-reduce, and on torch 2.11, whose scatter rule has no
    # batch strategy, a gather of the [T, 2] routing weights; never the [T, 16] tokens
    others = sum(c.bytes for c in prog.collectives() if c.kind != "all_to_all")
    assert others <= model.gate.weight.numel() * 4 + tokens * 8, prog.explain()
    out, grads = prog.simulate(x.detach(), grad_outputs=[torch.ones(tokens, 16)])
    _close(out, want.detach())
    _close(grads["input:0"], xr.grad)
    for n, p in ref.named_parameters():
        _close(grads[n], p.grad, msg=n)


def test_token_dispatch_within_one_mesh_dim_of_two():
    """A (dp, ep) mesh, tokens split over both, experts over ep: the dispatch runs within each ep
    group (its all-to-alls on mesh dim 1 only), the experts' gradients are summed over dp, and
    training equals single device."""
    import collections

    from torch.distributed.tensor import Shard

    model = _experts_block("qwen3_moe", 6)
    ref = copy.deepcopy(model)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(2))
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.backward(torch.ones_like(want))
    rows = [(Shard(0), Shard(0))]
    mesh = fxshard.MeshSpec((2, 2), ("dp", "ep"))
    prog = fxshard.shard(model, mesh, EXPERTS_PLAN, example_inputs=(x.requires_grad_(),),
                         input_placements=rows, output_placements=rows, training=True,
                         tp_dim="ep")  # fmt: skip
    a2a = collections.Counter(c.mesh_dims for c in prog.collectives() if c.kind == "all_to_all")
    assert a2a == {(1,): 8}, prog.explain()
    out, grads = prog.simulate(x.detach(), grad_outputs=[torch.ones(24, 16)])
    _close(out, want.detach())
    _close(grads["input:0"], xr.grad)
    for n, p in ref.named_parameters():
        _close(grads[n], p.grad, msg=n)


class _OddExperts(torch.nn.Module):
    """The experts signature, and a way each breaks the contract a region rests on: ``mix``
    normalises an expert's outputs over the tokens (a subset of them gives other values),
    ``by_expert`` over each expert's own tokens (the pairs of a block agree, halves of the tokens
    do not), ``detach`` stops the routing weights' gradient (the forward is the plain one)."""

    def __init__(self, how, e=4, h=8):
        super().__init__()
        self.how, self.num_experts = how, e
        self.weight = torch.nn.Parameter(torch.randn(e, h, h))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        w = top_k_weights.detach() if self.how == "detach" else top_k_weights
        for j in range(top_k_index.shape[1]):
            y = torch.einsum("th,thg->tg", hidden_states, self.weight[top_k_index[:, j]])
            if self.how == "mix":
                y = y - y.mean(0)
            elif self.how == "by_expert":
                onehot = torch.nn.functional.one_hot(top_k_index[:, j], self.num_experts).float()
                mean = (onehot.T @ y) / onehot.sum(0).clamp_min(1)[:, None]
                y = y - onehot @ mean
            out = out + w[:, j, None] * y
        return out


class _Router(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4, bias=False)
        self.experts = experts

    def forward(self, x):
        w, idx = torch.topk(self.gate(x).softmax(-1), 2)
        return self.experts(x, idx, w)


@pytest.mark.parametrize(
    "how,why",
    [("mix", "not independent"), ("by_expert", "not independent"),
     ("detach", "routing weights' gradient"), ("hook", "forward hooks")],
)  # fmt: skip
def test_an_experts_module_outside_the_contract_keeps_its_body(how, why, caplog):
    """A module with the experts signature that breaks the region's contract (tokens that
    depend on each other, a routing weight without its gradient, a forward hook the region would
    skip) fails the probe: it is no region (logged why), its traced body is sharded op by op, and
    forward and training equal single device."""
    import logging

    from torch.distributed.tensor import Shard

    torch.manual_seed(0)
    experts = _OddExperts("plain" if how == "hook" else how)
    if how == "hook":
        experts.register_forward_hook(lambda m, args, out: out * 2)
    model = _Router(experts)
    x = torch.randn(16, 8)
    rows = [(Shard(0),)]
    with caplog.at_level(logging.INFO, logger="fxshard.regions"):
        prog = fxshard.shard(model, MESH, {"experts.weight": "grouped_gemm"}, example_inputs=(x,),
                             input_placements=rows, output_placements=rows)  # fmt: skip
        train = fxshard.shard(model, MESH, {"experts.weight": "grouped_gemm"},
                              example_inputs=(x,), training=True)  # fmt: skip
    assert not _experts_nodes(prog) and not _experts_nodes(train)
    assert why in caplog.text
    with torch.no_grad():
        _close(prog.simulate(x), model(x))
    ref = copy.deepcopy(model)
    want = ref(x)
    want.backward(torch.ones_like(want))
    out, grads = train.simulate(x, grad_outputs=[torch.ones(16, 8)])
    _close(out, want.detach())
    for n, p in ref.named_parameters():
        _close(grads[n], p.grad, msg=n)


@pytest.mark.slow
def test_expert_dispatch_on_gloo_ranks():
    """The dispatch ops' all-to-alls on real process groups (2 gloo ranks, 3 experts: uneven
    blocks), compiled by Inductor: a Mixtral's logits with a batch-split input, its EP plan through
    torch.compile, and a training step through torch.compile on a batch-split DTensor (loss and
    gradients), each equal to single device."""
    import e2e_workers

    from fxshard.runtime.launch import spawn

    for r in spawn(2, e2e_workers.moe_expert_dispatch, timeout=600):
        err, ops = r["dispatch"]
        assert err < 1e-5 and ops == ["fxshard.moe_experts_dispatch.default"], r
        err, ops = r["ep_plan"]
        assert err < 1e-5 and ops == ["fxshard.moe_experts_local.default"], r
        err, ops = r["train"]
        assert err < 1e-5, r
        assert ops == ["fxshard.moe_experts_dispatch.default",
                       "fxshard.moe_experts_dispatch_backward.default"], r  # fmt: skip


def test_token_dispatch_drops_pairs_routed_to_no_expert():
    """An expert id outside 0 .. E-1 (transformers' EP sentinel) routes its pair nowhere, as the
    module itself drops it: every rank sends the same number of all-to-alls (an id a rank could
    not place would leave the others waiting), and the result is the module's."""
    from fxshard.rules import experts as X

    block = _experts_block("mixtral", 4)
    block.experts.config._experts_implementation = "grouped_mm"  # (it handles the sentinel)
    key = X.register(block.experts, "experts")
    params = [getattr(block.experts, n).detach() for n in X.region(key).names]
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(12, 16, generator=g), torch.rand(12, 2, generator=g)
    idx = torch.randint(0, 4, (12, 2), generator=g)
    idx[::3, 1] = 4  # the sentinel
    starts = X.expert_blocks(4, 2)
    ranks = {r: (idx[6 * r : 6 * r + 6], x[6 * r : 6 * r + 6], w[6 * r : 6 * r + 6],
                 [p[starts[r] : starts[r + 1]] for p in params]) for r in range(2)}  # fmt: skip
    got = X._dispatch(ranks, X._Exchange(2), key, starts)
    # the module's meaning: a sentinel pair adds nothing (the same pair on a real expert with
    # weight 0; transformers 5.25's own grouped_mm reads uninitialised rows for it)
    real, zero = idx.clone(), w.clone()
    real[::3, 1], zero[::3, 1] = 0, 0.0
    with torch.no_grad():
        want = block.experts(x, real, zero)
    _close(torch.cat([got[0], got[1]]), want)


class WithLabels(torch.nn.Module):
    """``model(input_ids=x, labels=y, use_cache=False).loss``: transformers' own loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return self.model(input_ids=x, labels=labels, use_cache=False).loss


@pytest.mark.parametrize("name", ["llama", "gemma2", "mixtral"])
def test_shard_trains_what_the_backend_trains(name):
    """fxshard.shard(training=True) (parallelize's capture): transformers' mask helpers and tensor
    constants (Gemma-2) traced as under dynamo; the loss and every gradient of single device."""
    model, plan, _, x, labels = _build(name)
    _shard_trains(model, plan, x, labels)


def _shard_trains(model, plan, x, labels):
    """shard(training=True) of ``model(input_ids=x, labels=...)`` (a few labels -100), simulated:
    the loss and every gradient of single device."""
    model.train()
    labels = labels.clone()
    labels[0, :2] = -100
    ref = WithLabels(copy.deepcopy(model))
    want = ref(x, labels)
    want.backward()
    prog = fxshard.shard(
        WithLabels(model), MESH, _prefixed(plan, model), example_inputs=(x, labels), training=True
    )
    loss, grads = prog.simulate(x, labels)
    _close(loss, want)
    for fqn, q in ref.named_parameters():
        if q.grad is not None:
            _close(grads[fqn], q.grad, rtol=1e-4, msg=fqn)


GROUPED_MM_MOES = {
    "gpt_oss": lambda: T.GptOssForCausalLM(T.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2)),
    "granitemoehybrid": lambda: T.GraniteMoeHybridForCausalLM(T.GraniteMoeHybridConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["attention", "attention"])),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GROUPED_MM_MOES))
def test_grouped_mm_experts_train_in_fp32_through_shard(name):
    """MoEs whose experts transformers runs through grouped matmuls (the sweep of 5.25 saw
    "Expected inputs of BF16 type" from them in fp32): shard(training=True) with the model's own
    plan gives single device's fp32 loss and gradients."""
    torch.manual_seed(0)
    model = GROUPED_MM_MOES[name]()
    x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    _shard_trains(model, model.tp_plan or {}, x, x.clone())


def test_a_parameter_clamped_in_place_by_forward_is_named_when_training():
    """Gemma-3n's AltUp clamps a parameter in place in its training forward
    (``prediction_coefs.weight.data.clamp_``): sharded training does not apply in-place state
    updates yet, and the error names the parameter and the remedies (it named an "unsupported
    tangent" before)."""
    cfg = T.Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64,
        hidden_size_per_layer_input=8, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=8,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
        altup_num_inputs=2, laurel_rank=8, activation_sparsity_pattern=[0.0, 0.0],
    )  # fmt: skip
    model = T.Gemma3nForCausalLM(cfg)
    x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    cm = torch.compile(
        model, backend="fxshard", options={"mesh": MESH, "simulate": True, "plan": model.tp_plan}
    )
    with pytest.raises(Exception, match=r"updates \['model.layers.0.altup.prediction_coefs"):
        cm(input_ids=x, labels=x, use_cache=False).loss.backward()


@pytest.mark.parametrize("training", [False, True])
def test_the_default_cache_is_a_clear_error_with_its_remedy(training):
    """shard / parallelize of a causal LM called the default way (use_cache=True returns a
    DynamicCache): an error that names the cache and the remedies, and the remedy works."""
    model, plan, _, x, _ = _build("llama")
    with pytest.raises(RuntimeError, match="returns a DynamicCache.*use_cache=False.*compile"):
        fxshard.shard(model, MESH, plan, example_inputs=(x,), training=training)
    model.config.use_cache = False
    prog = fxshard.shard(model, MESH, plan, example_inputs=(x,))
    with torch.no_grad():
        _close(prog.simulate(x).logits, model(x).logits)


def _deepseek_v2():  # MLA attention (mla_kv_a_proj in its own tp_plan), MoE layers
    cfg = T.DeepseekV2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1,
    )  # fmt: skip
    return T.DeepseekV2ForCausalLM(cfg)


def _with(name, **entries):
    def make():
        model, plan, _, x, labels = _build(name)
        return model, {**plan, **entries}, x, labels

    return make


def _own(factory):
    def make():
        torch.manual_seed(0)
        model = factory().eval()
        x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
        return model, model.tp_plan, x, x

    return make


ATTN = "model.layers.*.self_attn"
# the styles of transformers 5.25's plans, each on a model that uses it, as those plans use it
NEW_STYLES = {
    "embedding_colwise": _with("llama", **{"model.embed_tokens": "embedding_colwise"}),
    "unit_colwise+unit_rowwise": _with(
        "qwen3",
        **{f"{ATTN}.{p}_proj": "unit_colwise" for p in "qkv"},
        **{f"{ATTN}.o_proj": "unit_rowwise"},
    ),
    "local_params": _with("llama", **{ATTN: "local_params"}),
    "mla_kv_a_proj": _own(_deepseek_v2),
    "ep_dispatch_experts": _with(
        "mixtral",
        **{
            "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
            "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
            "model.layers.*.mlp.experts": "ep_dispatch_experts",
        },
    ),
}


@pytest.mark.parametrize("style", list(NEW_STYLES))
def test_the_styles_of_the_newest_transformers(style):
    """Forward and labels= training on 4 simulated ranks against single device, with the plan
    the style is in."""
    model, plan, x, labels = NEW_STYLES[style]()
    names = [s for s in plan.values() if isinstance(s, str)]
    assert all(part in names for part in style.split("+")), plan
    if style == "ep_dispatch_experts":  # transformers' EP plan: no TP entries besides
        plan = {k: v for k, v in plan.items() if v in ("grouped_gemm", "ep_dispatch_experts")}
    wrapped = Logits(model, "text")
    prog = fxshard.shard(wrapped, MESH, _prefixed(plan, model), example_inputs=(x,))
    assert not prog.warnings, prog.warnings
    with torch.no_grad():
        _close(prog.simulate(x), wrapped(x))
    if style == "ep_dispatch_experts":  # the experts are regions, split by experts
        assert _experts_nodes(prog), "no experts region"
    _shard_trains(model, plan, x, labels)
