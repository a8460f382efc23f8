"""Dynamic shapes: one sharded program for every size of the dims dynamo made dynamic
(``fxshard.capture.symbolic``), on simulated ranks.  Each case compares every call with single
device and counts the programs the backend built."""

import copy
import logging

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard
from fxshard import zoo
from fxshard.backend import compiled_programs, programs_built

MESH = fxshard.MeshSpec((4,), ("tp",))
MESH3 = fxshard.MeshSpec((3,), ("tp",))


def _compile(fn, mesh=MESH, plan=None, **kw):
    torch._dynamo.reset()
    return torch.compile(
        fn,
        backend="fxshard",
        options={"mesh": mesh, "plan": plan or {}, "simulate": True},
        **kw,
    )


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Attention(nn.Module):
    """Decode-style attention over a cache that grows by the new token: shape arguments of the
    growing length (arange, view, expand, a slice) in the graph."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, past_k, past_v):
        b, t, _ = x.shape

        def split(y):
            return y.view(b, t, self.heads, self.hd).transpose(1, 2)

        k = torch.cat([past_k, split(self.k(x))], dim=2)
        v = torch.cat([past_v, split(self.v(x))], dim=2)
        n = k.shape[2]
        pos = torch.arange(n, device=x.device).float() / n  # a position bias of the length
        scores = split(self.q(x)) @ k.transpose(-1, -2) / self.hd**0.5 + pos
        out = torch.softmax(scores, -1) @ v[:, :, :n]
        return self.o(out.transpose(1, 2).reshape(b, t, -1)), k, v


def _decode(model, f, k, v, steps=6):
    """``steps`` decode calls of ``f``, each against single device, the cache growing a token;
    the cache after them."""
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(2, 1, 32)
            want = model(x, k, v)
            got = f(x, k, v)
            for a, b in zip(got, want):
                _close(a, b)
            k, v = want[1], want[2]
    return k, v


def _attention_plan():
    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel()}  # fmt: skip


# torch 2.11's functionalization runs C++ matmul on a 3-d input, which asks numel() of symbolic
# sizes: no symbolic program there, a program per size (logged, right); 2.12 on: one program
SYMBOLIC_MATMUL = pytest.mark.skipif(
    tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 12),
    reason="torch 2.11 capture asks numel() of symbolic sizes in matmul: a program per size",
)


@SYMBOLIC_MATMUL
@pytest.mark.parametrize("mesh", [MESH, MESH3], ids=["even heads", "uneven heads"])
def test_one_program_for_every_cache_length(mesh):
    """A decode step whose cache grows every call: after dynamo marks the length dynamic (its
    second size), one program serves every later length, the heads sharded and the length never
    split; each call equals single device (on 3 ranks too, its q/k/v features split unevenly)."""
    torch.manual_seed(0)
    model = Attention().eval()
    f = _compile(model, mesh, _attention_plan())
    n0 = programs_built()
    k = torch.randn(2, 4, 3, 8)
    v = torch.randn(2, 4, 3, 8)
    _decode(model, f, k, v)
    progs = compiled_programs(n0)
    assert [p.symbolic for p in progs] == [False, True], [p.symbolic for p in progs]
    sym = progs[-1]
    assert {str(s) for s in (sym.output_specs[1], sym.output_specs[2])} == {"R"}
    heads = [
        str(fxshard.ir.info(n).spec)
        for n in sym.global_graph.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.cat.default
    ]
    if mesh is MESH:  # (on 3 ranks the q/k/v features split 11, 11, 10: no whole heads)
        assert heads == ["S(1)", "S(1)"], heads  # the cache's heads sharded, its length whole


@SYMBOLIC_MATMUL
def test_a_plan_that_splits_the_dynamic_dim_gets_a_program_per_size(caplog):
    """Sequence parallelism splits the sequence: with a dynamic sequence no symbolic program can
    keep it whole, so each length gets its own program (said once), and every one is right."""
    torch.manual_seed(0)
    model = zoo.Llama().eval()
    f = _compile(model, MESH, zoo.sequence_parallel_plan(), dynamic=True)
    n0 = programs_built()
    with caplog.at_level(logging.INFO, logger="fxshard"), torch.no_grad():
        for n in (8, 12, 16):
            tokens = torch.randint(0, model.cfg.vocab_size, (2, n))
            _close(f(tokens), model(tokens))
    progs = compiled_programs(n0)
    assert len(progs) == 3 and not any(p.symbolic for p in progs)
    said = [r.getMessage() for r in caplog.records if "program per size" in r.getMessage()]
    assert len(said) == 1 and "splits" in said[0], said


def test_guards_that_fail_build_another_program():
    """Sizes that were equal when a program was traced are assumed equal (its guards say so); a
    call where they differ fails the guard and gets a program of its own, right too."""

    def f(x, y):
        return (x * 2).sum(-1) + (y + 1).sum(-1), torch.cat([x, y], dim=-1)

    g = _compile(f, dynamic=True)
    n0 = programs_built()
    for a, b in ((5, 5), (7, 7), (6, 9), (9, 4)):
        x, y = torch.randn(4, a), torch.randn(4, b)
        for got, want in zip(g(x, y), f(x, y)):
            _close(got, want)
    progs = compiled_programs(n0)
    assert all(p.symbolic for p in progs) and len(progs) == 2, [p.symbolic for p in progs]


class Growing:
    """A cache object: a buffer that grows and a Python counter of its length."""

    def __init__(self):
        self.buf, self.n = torch.zeros(4, 2), 2


def test_sizes_a_program_returns_and_dynamic_ints_that_are_no_size():
    """A graph that stores a size into an object (a cache's length counter: dynamo hands it back
    as an output of the graph) and takes a dynamic Python int that is no tensor's size: one
    program for every length (two: the first assumed two sizes equal), whose counter and
    results are single device's at every step."""

    def step(cache, x, k: int):
        cache.buf = torch.cat([cache.buf, x], 1)
        cache.n += x.shape[1]
        return cache.buf.sum(1) * cache.n + k

    f = _compile(step, dynamic=True)
    mine, theirs = Growing(), Growing()
    n0 = programs_built()
    for i in range(8):
        x = torch.randn(4, 2 + i % 2)
        _close(f(mine, x, 3 * i + 1), step(theirs, x, 3 * i + 1))
        assert mine.n == theirs.n and mine.buf.shape == theirs.buf.shape
    progs = compiled_programs(n0)
    # (the first program assumed the buffer and the new piece equally long: a guard)
    assert len(progs) <= 2 and all(p.symbolic for p in progs), [p.symbolic for p in progs]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_hugging_face_generate_builds_three_programs(arch):
    """transformers' Llama and Mistral (a sliding-window cache that counts its length in a Python
    int) under their own tp_plan on 4 simulated ranks: greedy generate() with the default cache
    builds three programs for 12 new tokens (prefill, first decode, one symbolic decode program
    for every later length) and gives single device's tokens."""
    T = pytest.importorskip("transformers")
    size = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
    torch.manual_seed(0)
    if arch == "llama":
        ref = T.LlamaForCausalLM(T.LlamaConfig(**size)).eval()
    else:
        ref = T.MistralForCausalLM(T.MistralConfig(**size, head_dim=8)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(3)
    model = copy.deepcopy(ref)
    torch._dynamo.reset()
    model.compile(backend="fxshard", options={"mesh": MESH, "plan": ref.tp_plan, "simulate": True})
    x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    n0 = programs_built()
    with torch.no_grad():
        want = ref.generate(x, **kw)
        assert torch.equal(model.generate(x, **kw), want)
    progs = compiled_programs(n0)
    assert len(progs) == 3 and progs[-1].symbolic, [p.symbolic for p in progs]
    assert len(set(want[:, 8:].flatten().tolist())) > 3


def test_a_linear_with_bias_keeps_its_dims_dynamic():
    """nn.Linear with a bias on a 3-D input (a prompt of any length under a colwise plan): one
    program for every length (functionalizing its C++ decomposition once asked for concrete
    sizes, which made every length a program of its own), each equal to single device."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    f = _compile(model, MESH, plan, dynamic=True)
    n0 = programs_built()
    with torch.no_grad():
        for t in (5, 7, 9, 12):
            x = torch.randn(2, t, 16)
            _close(f(x), model(x))
    progs = compiled_programs(n0)
    assert len(progs) == 1 and progs[0].symbolic, [p.symbolic for p in progs]


@SYMBOLIC_MATMUL
def test_a_decode_step_goes_straight_to_the_symbolic_program(monkeypatch):
    """Once the symbolic program is built, a call with a new length runs it without building a
    key of its sizes first (that key missed on every decode step: a Python walk over every
    argument, about a twentieth of a tiny model's decode step on 2 ranks)."""
    from fxshard.backend import ShardedGraph

    torch.manual_seed(0)
    model = Attention().eval()
    f = _compile(model, MESH, _attention_plan())
    k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8)
    keys = [0]
    key = ShardedGraph._key

    def counted(self, args):
        keys[0] += 1
        return key(self, args)

    k, v = _decode(model, f, k, v, steps=3)  # the symbolic program is built (length dynamic)
    monkeypatch.setattr(ShardedGraph, "_key", counted)
    _decode(model, f, k, v, steps=3)
    assert keys[0] == 0, keys
