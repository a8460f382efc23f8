"""Small models with the structure of real ones, and the hand plans people write for them.

Used by the tests (``tests/models.py`` re-exports this), the demo, the CLI and the benchmarks.
FQNs follow torchtitan's Llama (``tok_embeddings``, ``layers.N.attention.wq``, ``norm``, ``output``)
so that published plans apply unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

# ---- models --------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class MegatronMLP(nn.Module):
    """SwiGLU feed-forward (w2(silu(w1 x) * w3 x)), no bias: Llama's FFN."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int = 32, n_heads: int = 4):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim)
        self.wk = nn.Linear(dim, dim)
        self.wv = nn.Linear(dim, dim)
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


@dataclass
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 128
    ffn_hidden: int = 128
    max_seq_len: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, s, h, d); rotate pairs (x[2i], x[2i+1]) by the position's angle."""
    b, s, h, d = x.shape
    xp = x.reshape(b, s, h, d // 2, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c = cos[:s].view(1, s, 1, d // 2)
    sn = sin[:s].view(1, s, 1, d // 2)
    return torch.stack([x0 * c - x1 * sn, x0 * sn + x1 * c], dim=-1).reshape(b, s, h, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:  # grouped-query attention: every kv head serves `rep` query heads
            k = (
                k.unsqueeze(3)
                .expand(b, s, k.shape[2], rep, self.head_dim)
                .reshape(b, s, -1, self.head_dim)
            )
            v = (
                v.unsqueeze(3)
                .expand(b, s, v.shape[2], rep, self.head_dim)
                .reshape(b, s, -1, self.head_dim)
            )
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MegatronMLP(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        cfg = cfg or LlamaConfig()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


@torch.compiler.disable
def _eager_step() -> None:
    """Runs outside any compiled graph: dynamo breaks the graph where it is called."""


class GraphBreakLlama(Llama):
    """Llama whose forward breaks dynamo's graph after the first layer (a print, in real models)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h, self.rope_cos, self.rope_sin)
            if i == 0:
                _eager_step()
        return self.output(self.norm(h))


class CachedLlama(Llama):
    """Llama that decodes with a static KV cache it is handed and hands back (HF's StaticCache
    layout: per layer a key and a value tensor of (batch, kv heads, max_seq_len, head dim)).  A call
    writes its tokens' keys and values at positions ``pos`` and attends to every cached position up
    to its own: a prefill (``pos = arange(s)``) and then one token per call (``pos = [t]``) run two
    programs, whatever the step.  Same parameters and FQNs as ``Llama``: its plans apply."""

    def new_cache(self, batch: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        cfg = self.cfg
        shape = (batch, cfg.n_kv_heads, cfg.max_seq_len, cfg.dim // cfg.n_heads)
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * cfg.n_layers)]

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, *cache: torch.Tensor):
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        new = []
        for i, layer in enumerate(self.layers):
            a, k, v = _attend_cached(
                layer.attention, layer.attention_norm(h), cos, sin, pos, *cache[2 * i : 2 * i + 2]
            )
            h = h + a
            h = h + layer.feed_forward(layer.ffn_norm(h))
            new += [k, v]
        return (self.output(self.norm(h)), *new)


def _attend_cached(attn: Attention, x, cos, sin, pos, k_cache, v_cache):
    b, s, _ = x.shape
    q = attn.wq(x).view(b, s, -1, attn.head_dim)
    k = attn.wk(x).view(b, s, -1, attn.head_dim)
    v = attn.wv(x).view(b, s, -1, attn.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = k_cache.index_copy(2, pos, k.transpose(1, 2))
    v_cache = v_cache.index_copy(2, pos, v.transpose(1, 2))
    rep = attn.n_heads // attn.n_kv_heads
    keys = k_cache.repeat_interleave(rep, dim=1) if rep > 1 else k_cache
    values = v_cache.repeat_interleave(rep, dim=1) if rep > 1 else v_cache
    visible = torch.arange(k_cache.shape[2], device=x.device)[None, :] <= pos[:, None]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=visible)
    return attn.wo(o.transpose(1, 2).reshape(b, s, -1)), k_cache, v_cache


def greedy_decode(step, model: CachedLlama, prompt: torch.Tensor, new_tokens: int, cache=None):
    """Greedy decoding with ``step(tokens, pos, *cache) -> (logits, *cache)`` (the model, or a
    compiled / parallelized form of it): the prompt in one call, then one token per call.  Returns
    the generated tokens (batch, new_tokens) and the last cache."""
    b, s = prompt.shape
    cache = model.new_cache(b) if cache is None else cache
    logits, *cache = step(prompt, torch.arange(s), *cache)
    out = []
    for t in range(new_tokens):
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        tok = logits[:, -1:].argmax(-1)
        out.append(tok)
        if t + 1 < new_tokens:
            logits, *cache = step(tok, torch.tensor([s + t]), *cache)
    return torch.cat(out, dim=1), cache


class ConvNet(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.fc = nn.Linear(channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


class UnevenMLP(MLP):
    """Feature dims (10, 14) that no mesh of 4 divides."""

    def __init__(self):
        super().__init__(dim=10, hidden=14)


# ---- example inputs ------------------------------------------------------------------------------


def example_input(
    model: nn.Module, batch: int = 4, seq: int = 8, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, ...]:
    g = generator
    if isinstance(model, CachedLlama):  # a prefill: tokens, their positions, an empty cache
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=g)
        return (tokens, torch.arange(seq), *model.new_cache(batch))
    if isinstance(model, Llama):
        return (torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=g),)
    if isinstance(model, ConvNet):
        return (torch.randn(batch, 3, 8, 8, generator=g),)
    if isinstance(model, MultiHeadAttention):
        return (torch.randn(batch, seq, model.wq.in_features, generator=g),)
    if isinstance(model, (MLP, MegatronMLP)):
        first = model.fc1 if isinstance(model, MLP) else model.w1
        return (torch.randn(batch, seq, first.in_features, generator=g),)
    raise TypeError(f"no example input for {type(model).__name__}")


# ---- hand plans (torch ParallelStyle dicts) ------------------------------------------------------


def megatron_tp_plan(prefix: str = "layers.*.") -> dict:
    """Colwise q/k/v/w1/w3, rowwise o/w2: 2 all-reduces per layer forward."""
    return {
        f"{prefix}attention.wq": ColwiseParallel(),
        f"{prefix}attention.wk": ColwiseParallel(),
        f"{prefix}attention.wv": ColwiseParallel(),
        f"{prefix}attention.wo": RowwiseParallel(),
        f"{prefix}feed_forward.w1": ColwiseParallel(),
        f"{prefix}feed_forward.w3": ColwiseParallel(),
        f"{prefix}feed_forward.w2": RowwiseParallel(),
    }


def sequence_parallel_plan() -> dict:
    """torchtitan's Llama plan: SP norms, PrepareModuleInput on attention/ffn, vocab-parallel
    embedding and loss-parallel lm_head."""
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }
    return plan


def vocab_parallel_plan() -> dict:
    """Megatron TP plus a vocab-parallel embedding and a loss-parallel (vocab-sharded) lm_head."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        **megatron_tp_plan(),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def mlp_plan() -> dict:
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def megatron_mlp_plan() -> dict:
    return {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}


def attention_plan() -> dict:
    return {
        "wq": ColwiseParallel(),
        "wk": ColwiseParallel(),
        "wv": ColwiseParallel(),
        "wo": RowwiseParallel(),
    }


def init_weights(model: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic, well-scaled weights (norm weights randomised too, so sharding bugs show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def uneven_config() -> LlamaConfig:
    """A Llama that no mesh of 4 divides: vocabulary 1001, hidden 96 in 6 heads (3 kv heads), ffn
    250 (torch.chunk on 4 ranks: 251 x 3 + 248 rows, heads 2, 2, 2, 0, 63 x 3 + 61)."""
    return LlamaConfig(dim=96, n_layers=2, n_heads=6, n_kv_heads=3, vocab_size=1001, ffn_hidden=250)
