"""Llamas written the way other code bases write them, with the plans their users write.

fxshard's zoo Llama is one way to write the model; real users bring others.  These three are the
same architecture (RMSNorm, RoPE, GQA attention, SwiGLU FFN) written in three other styles, so
that plan quality and planning time can be measured on structure fxshard did not choose:

- ``EagerLlama``: zoo-style names, attention by matmul + softmax (HF's ``eager`` attention, the
  default of Gemma-2 and many others): 4-D matmuls that ATen lowers to view/expand/bmm chains.
- ``HFLlama``: Hugging Face's structure (``model.layers.N.self_attn.q_proj``, ``mlp.gate_proj``,
  ``input_layernorm``), its casting RMSNorm (compute in fp32, cast back: ``.to(dtype)`` everywhere),
  ``rotate_half`` RoPE and ``repeat_kv`` by expand + reshape, eager attention with an additive mask.
- ``TitanLlama``: torchtitan's structure (layers in an ``nn.ModuleDict`` keyed by strings), RoPE in
  real arithmetic on (even, odd) pairs, GQA by ``repeat_interleave``, SDPA.

Each comes with a Megatron TP plan and a sequence-parallel plan in its own FQNs.
"""

from __future__ import annotations

import math

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

from fxshard.zoo import LlamaConfig

# one config for every way of writing the model: zoo's (the same fields, the same defaults)
Config = LlamaConfig


def llama3_8b_config(layers: int = 32) -> Config:
    return Config(4096, layers, 32, 8, 128256, 14336, 8192, 1e-5, 500000.0)


def _inv_freq(cfg: Config) -> torch.Tensor:
    hd = cfg.dim // cfg.n_heads
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))


def _causal_softmax_attention(q, k, v):
    """q, k, v: (b, h, s, d).  Eager attention as HF's ``eager_attention_forward`` computes it."""
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
    mask = torch.full((s, s), float("-inf"), device=q.device).triu(1)
    scores = scores + mask.to(scores.dtype)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


# ---- 1. eager attention, zoo names ---------------------------------------------------------------


class _EagerAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.hd = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.hd).transpose(1, 2)
        q, k = _rope_half(q, cos, sin), _rope_half(k, cos, sin)
        k, v = _repeat_kv(k, self.n_heads // self.n_kv), _repeat_kv(v, self.n_heads // self.n_kv)
        o = _causal_softmax_attention(q, k, v)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _SwiGLU(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _EagerBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm = _Norm(cfg.dim, cfg.norm_eps)
        self.attention = _EagerAttention(cfg)
        self.ffn_norm = _Norm(cfg.dim, cfg.norm_eps)
        self.feed_forward = _SwiGLU(cfg)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rope_half(x, cos, sin):
    """x: (b, h, s, d); cos/sin: (s, d), HF's rotate_half convention."""
    return x * cos[None, None] + _rotate_half(x) * sin[None, None]


def _repeat_kv(x, n_rep: int):
    """HF's repeat_kv: (b, kv, s, d) -> (b, kv * n_rep, s, d) by expand + reshape."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


def _half_tables(cfg: Config, s: int, device=None):
    t = torch.arange(s, dtype=torch.float32, device=device)
    freqs = torch.outer(t, _inv_freq(cfg).to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class EagerLlama(nn.Module):
    def __init__(self, cfg: Config | None = None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(_EagerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = _Norm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = _half_tables(cfg, cfg.max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.cos[:s], self.sin[:s])
        return self.output(self.norm(h))


# ---- 2. Hugging Face structure -------------------------------------------------------------------


class HFRMSNorm(nn.Module):
    """LlamaRMSNorm: computes in fp32 and casts back (a ``.to(dtype)`` on every call)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HFAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.num_key_value_groups = cfg.n_heads // cfg.n_kv_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k = _repeat_kv(k, self.num_key_value_groups)
        v = _repeat_kv(v, self.num_key_value_groups)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v).transpose(1, 2).contiguous()
        return self.o_proj(attn_output.reshape(*input_shape, -1).contiguous())


class HFMLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFDecoderLayer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.self_attn = HFAttention(cfg)
        self.mlp = HFMLP(cfg)
        self.input_layernorm = HFRMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = HFRMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states, position_embeddings, attention_mask)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


class HFRotaryEmbedding(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(cfg), persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class HFModel(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(HFDecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = HFRMSNorm(cfg.dim, cfg.norm_eps)
        self.rotary_emb = HFRotaryEmbedding(cfg)

    def forward(self, input_ids):
        b, s = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        mask = torch.full((s, s), torch.finfo(hidden_states.dtype).min, device=input_ids.device)
        mask = mask.triu(1)[None, None].to(hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, mask)
        return self.norm(hidden_states)


class HFLlama(nn.Module):
    """``LlamaForCausalLM``'s module tree: ``model.layers.N.self_attn.q_proj``, ``lm_head``."""

    def __init__(self, cfg: Config | None = None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.model = HFModel(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


# ---- 3. torchtitan structure ---------------------------------------------------------------------


class _TitanAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.n_rep = cfg.n_heads // cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs_cos, freqs_sin):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = _rope_pairs(xq, freqs_cos, freqs_sin), _rope_pairs(xk, freqs_cos, freqs_sin)
        keys = torch.repeat_interleave(xk, dim=2, repeats=self.n_rep)
        values = torch.repeat_interleave(xv, dim=2, repeats=self.n_rep)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, keys, values, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


def _rope_pairs(x, cos, sin):
    """Real-arithmetic RoPE on (even, odd) pairs: what view_as_complex * freqs_cis computes."""
    xr, xi = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((xr * c - xi * s, xr * s + xi * c), dim=-1).flatten(3)
    return out.type_as(x)


class _TitanBlock(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention = _TitanAttention(cfg)
        self.feed_forward = _SwiGLU(cfg)
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, x, freqs_cos, freqs_sin):
        h = x + self.attention(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, cfg: Config | None = None):
        super().__init__()
        self.cfg = cfg = cfg or Config()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): _TitanBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), _inv_freq(cfg))
        self.register_buffer("freqs_cos", freqs.cos(), persistent=False)
        self.register_buffer("freqs_sin", freqs.sin(), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cos[:s], self.freqs_sin[:s])
        return self.output(self.norm(h))


# ---- plans ---------------------------------------------------------------------------------------

_NAMES = {
    "zoo": dict(
        layers="layers.*.",
        attn="attention",
        q="wq",
        k="wk",
        v="wv",
        o="wo",
        ffn="feed_forward",
        gate="w1",
        up="w3",
        down="w2",
        norm1="attention_norm",
        norm2="ffn_norm",
        embed="tok_embeddings",
        final_norm="norm",
        head="output",
    ),
    "hf": dict(
        layers="model.layers.*.",
        attn="self_attn",
        q="q_proj",
        k="k_proj",
        v="v_proj",
        o="o_proj",
        ffn="mlp",
        gate="gate_proj",
        up="up_proj",
        down="down_proj",
        norm1="input_layernorm",
        norm2="post_attention_layernorm",
        embed="model.embed_tokens",
        final_norm="model.norm",
        head="lm_head",
    ),
}


def _names(model: nn.Module) -> dict:
    return _NAMES["hf" if isinstance(model, HFLlama) else "zoo"]


def tp_plan(model: nn.Module) -> dict:
    """Megatron TP: colwise q/k/v and gate/up, rowwise o and down; 2 all-reduces per layer."""
    n = _names(model)
    p, a, f = n["layers"], n["attn"], n["ffn"]
    return {
        f"{p}{a}.{n['q']}": ColwiseParallel(),
        f"{p}{a}.{n['k']}": ColwiseParallel(),
        f"{p}{a}.{n['v']}": ColwiseParallel(),
        f"{p}{a}.{n['o']}": RowwiseParallel(),
        f"{p}{f}.{n['gate']}": ColwiseParallel(),
        f"{p}{f}.{n['up']}": ColwiseParallel(),
        f"{p}{f}.{n['down']}": RowwiseParallel(),
    }


def sp_plan(model: nn.Module) -> dict:
    """Sequence parallel (torchtitan's plan): norms on sequence shards, all-gather before attention
    and the FFN, reduce-scatter after; 2 all-gathers + 2 reduce-scatters per layer forward."""
    n = _names(model)
    p, a, f = n["layers"], n["attn"], n["ffn"]
    attn_inputs = (Shard(1), None, None)
    attn_desired = (Replicate(), None, None)
    return {
        n["embed"]: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        n["final_norm"]: SequenceParallel(),
        n["head"]: ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        f"{p}{n['norm1']}": SequenceParallel(),
        f"{p}{a}": PrepareModuleInput(
            input_layouts=attn_inputs, desired_input_layouts=attn_desired
        ),
        f"{p}{a}.{n['q']}": ColwiseParallel(),
        f"{p}{a}.{n['k']}": ColwiseParallel(),
        f"{p}{a}.{n['v']}": ColwiseParallel(),
        f"{p}{a}.{n['o']}": RowwiseParallel(output_layouts=Shard(1)),
        f"{p}{n['norm2']}": SequenceParallel(),
        f"{p}{f}": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        f"{p}{f}.{n['gate']}": ColwiseParallel(),
        f"{p}{f}.{n['up']}": ColwiseParallel(),
        f"{p}{f}.{n['down']}": RowwiseParallel(output_layouts=Shard(1)),
    }


MODELS = {"eager": EagerLlama, "hf": HFLlama, "titan": TitanLlama}


def init(model: nn.Module, seed: int = 0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return model
