"""Time per decode step with the collectives taken out: fxshard's backend against transformers'
own tensor parallelism + ``torch.compile``, greedy ``generate()`` of the same model.

One process on a fake process group of ``--world`` ranks (``torch.testing``'s ``fake`` backend:
each rank's program runs in full, its collectives return at once), so what the two sides differ
by is the work of one rank per call: the compiled program and the Python around it (fxshard:
the call's signature, the parameters' cached shards, the cache's KeptTensors in and out; HF: the
DTensor parameters' unwrapping). On real ranks each rank pays it, and a decode step waits for the
slowest. Tiny random-init transformers models built from config (hidden 256, 8 heads / 4 kv
heads, vocab 1024) with ``--layers`` layers and transformers' default ``DynamicCache`` or a static
cache (``--caches``): the Python around a call grows with the layers (a
cache tensor per layer and kv, every call). Per row: ms per generated token (``--tokens`` tokens
from an 8-token prompt, batch 4, prefill included), the median of ``--repeats`` generations after
two that compile every program, the two sides alternating; the ratio fxshard / HF.

    python benchmarks/host_overhead.py [--archs llama,mistral] [--layers 2,16] [--world 2]
                                       [--caches dynamic,static]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from hf import SIZE, build


def row(arch, layers, dm, prompt, tokens, repeats, cache="dynamic"):
    """ms per token of HF TP + compile and of fxshard: both compiled (two generations each), then
    ``repeats`` generations alternating between them (drift on a shared machine hits both)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    SIZE["num_hidden_layers"] = layers
    base = build(arch)
    torch._dynamo.reset()
    hf = apply_tensor_parallelism(copy.deepcopy(base), dm)
    hf.forward = torch.compile(hf.forward)
    fx = copy.deepcopy(base)
    fx.compile(backend="fxshard", options={"mesh": dm, "plan": base.tp_plan})
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=tokens, do_sample=False,
              pad_token_id=0)  # fmt: skip
    if cache == "static":
        kw["cache_implementation"] = "static"
    times = {"hf": [], "fx": []}
    with torch.no_grad():
        for model in (hf, fx):
            for _ in range(2):  # compiles the prefill and decode programs
                model.generate(prompt, **kw)
        for _ in range(repeats):
            for name, model in (("hf", hf), ("fx", fx)):
                t = time.perf_counter()
                model.generate(prompt, **kw)
                times[name].append(time.perf_counter() - t)
    return [1e3 * statistics.median(times[k]) / tokens for k in ("hf", "fx")]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="llama,mistral")
    ap.add_argument("--layers", default="2,16")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--caches", default="dynamic", help="dynamic,static: transformers' caches")
    args = ap.parse_args()
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # the two models share their forward's code object: room for both variants' graphs
    torch._dynamo.config.recompile_limit = 64
    torch.set_num_threads(1)  # one rank's share of the machine, as the gloo benchmarks run
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    dm = init_device_mesh("cpu", (args.world,), mesh_dim_names=("tp",))
    x = torch.randint(1, SIZE["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(1))
    print(f"greedy generate(), {args.tokens} tokens, batch 4, fake process group of {args.world} "
          f"ranks (collectives cost nothing), 1 thread; ms per token, median of "
          f"{args.repeats}")  # fmt: skip
    print(f"{'arch':10} {'cache':8} {'layers':>6} {'HF TP + compile':>16} {'fxshard':>8} "
          f"{'fx/HF':>6}")  # fmt: skip
    for arch in args.archs.split(","):
        for cache in args.caches.split(","):
            for layers in (int(n) for n in args.layers.split(",")):
                hf_ms, fx_ms = row(arch, layers, dm, x, args.tokens, args.repeats, cache)
                print(f"{arch:10} {cache:8} {layers:6d} {hf_ms:16.2f} {fx_ms:8.2f} "
                      f"{fx_ms / hf_ms:6.2f}", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
