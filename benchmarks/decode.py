"""Greedy decoding with a KV cache on real process groups: fxshard.parallelize (its cache kept as
heads-sharded DTensors between calls) vs DTensor + torch.compile (torch's parallelize_module with
the same plan, its cache the local heads).

``zoo.CachedLlama`` (a static cache of ``max_seq_len`` positions, HF StaticCache layout), Megatron
TP plan, 4 gloo ranks on this machine (CPU, loopback), both in the same run on the same weights and
prompt.  Per rank: the first call of each program (prefill and decode: dynamo, fxshard's passes,
Inductor), then ``--repeats`` timed decodes of ``--tokens`` tokens each (a barrier before each, the
two variants alternating); tokens/s is batch x tokens / median decode time.  Bytes per token: the
collectives of one decode step, from fxshard's per-rank program and, for DTensor, counted on the
eager step (its compiled step runs the same collectives).  On 2 cores the 4 ranks share the CPUs:
quote medians and ratios.

    python benchmarks/decode.py [--ranks 4] [--tokens 32] [--batch 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CollectiveBytes(TorchDispatchMode):
    """Bytes each rank hands to the collectives DTensor runs eagerly (their input tensors)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # modes run before subclasses: let DTensor desugar the op into its collectives on
            # plain tensors, which then come back here (as torch's CommDebugMode does; counted
            # here, DTensor's own all-reduces, a vocab-parallel embedding's, were missed)
            return NotImplemented
        ns = getattr(func, "namespace", "")
        name = func.name() if hasattr(func, "name") else str(func)
        kind = name.split("::")[-1].split(".")[0]
        collective = kind.startswith(("all_", "reduce_scatter", "broadcast", "allreduce"))
        if ns in ("_c10d_functional", "c10d_functional", "c10d") and collective:
            # c10d's in-place ones (dist.all_reduce) take lists of tensors
            t = next(a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor))
            self.bytes += t.numel() * t.element_size()
            self.calls.append(kind)
        return func(*args, **(kwargs or {}))


def worker(rank, world, cfg_kw, batch, prompt_len, tokens, repeats):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import fxshard
    from fxshard import zoo

    cfg = zoo.LlamaConfig(**cfg_kw)
    base = zoo.init_weights(zoo.CachedLlama(cfg), seed=0)
    prompt = torch.randint(
        0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1)
    )
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.no_grad():
        want, _ = zoo.greedy_decode(base, base, prompt, tokens)
    hd = cfg.dim // cfg.n_heads
    local_heads = cfg.n_kv_heads // world

    def torch_cache():  # torch TP hands the attention its local heads: the cache holds those
        shape = (batch, local_heads, cfg.max_seq_len, hd)
        return [torch.zeros(shape) for _ in range(2 * cfg.n_layers)]

    variants = {}
    dist.barrier()
    t = time.perf_counter()
    tm = torch.compile(parallelize_module(copy.deepcopy(base), dm, zoo.megatron_tp_plan()))
    with torch.no_grad():
        got, _ = zoo.greedy_decode(tm, base, prompt, 2, cache=torch_cache())
    variants["DTensor + torch.compile"] = dict(
        step=tm, cache=torch_cache, first_s=time.perf_counter() - t
    )
    eager = parallelize_module(copy.deepcopy(base), dm, zoo.megatron_tp_plan())
    cache = torch_cache()
    with torch.no_grad():
        logits, *cache = eager(prompt, torch.arange(prompt_len), *cache)
        counter = CollectiveBytes()
        with counter:
            eager(prompt[:, :1], torch.tensor([prompt_len]), *cache)
    variants["DTensor + torch.compile"]["bytes"] = counter.bytes
    variants["DTensor + torch.compile"]["calls"] = len(counter.calls)

    dist.barrier()
    t = time.perf_counter()
    pm = fxshard.parallelize(copy.deepcopy(base), dm, zoo.megatron_tp_plan(), outputs="dtensor")
    with torch.no_grad():
        zoo.greedy_decode(pm, base, prompt, 2)
    progs = [p for p, _ in pm._programs.values()]
    decode = progs[-1].collectives()
    variants["fxshard.parallelize"] = dict(
        step=pm,
        cache=lambda: None,
        first_s=time.perf_counter() - t,
        bytes=sum(c.bytes for c in decode),
        calls=len(decode),
    )
    times = {k: [] for k in variants}
    same = {}
    with torch.no_grad():
        for _ in range(repeats):
            for label, v in variants.items():
                dist.barrier()
                t = time.perf_counter()
                got, _ = zoo.greedy_decode(v["step"], base, prompt, tokens, cache=v["cache"]())
                times[label].append(time.perf_counter() - t)
                same[label] = bool(torch.equal(got, want))
    return {
        label: dict(
            tokens_s=batch * tokens / statistics.median(times[label]),
            first_s=v["first_s"],
            bytes=v["bytes"],
            calls=v["calls"],
            same=same[label],
        )
        for label, v in variants.items()
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=256)
    args = ap.parse_args()
    from fxshard.runtime.launch import spawn

    cfg = dict(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=4 * args.dim,
        vocab_size=1024,
        max_seq_len=args.prompt + args.tokens,
    )
    per_rank = spawn(
        args.ranks, worker, cfg, args.batch, args.prompt, args.tokens, args.repeats, timeout=1800
    )
    anchor = "DTensor + torch.compile"

    def med(label, key):
        return statistics.median(r[label][key] for r in per_rank)

    print(
        f"Greedy decode, zoo.CachedLlama {args.layers} layers, hidden {args.dim}, 8 heads / 4 kv "
        f"heads, batch {args.batch}, prompt {args.prompt}, {args.tokens} new tokens, "
        f"{args.ranks} gloo ranks (CPU), Megatron TP; medians over ranks of {args.repeats} runs"
    )
    print(
        f"{'':26} {'tokens/s':>9} {'vs DTensor':>10} {'first calls s':>13} "
        f"{'collectives/token':>17} {'bytes/token':>11} {'same tokens':>11}"
    )
    for label in per_rank[0]:
        print(
            f"{label:26} {med(label, 'tokens_s'):9.1f} "
            f"{med(label, 'tokens_s') / med(anchor, 'tokens_s'):10.2f} "
            f"{med(label, 'first_s'):13.1f} {per_rank[0][label]['calls']:17d} "
            f"{per_rank[0][label]['bytes']:11d} {str(all(r[label]['same'] for r in per_rank)):>11}"
        )


if __name__ == "__main__":
    main()
