"""plan="auto" on a LLaMA-3-8B-shaped model: planning time and modelled step cost vs hand plans.

The model (32 layers, hidden 4096, 32 heads, 8 kv heads, ffn 14336, vocab 128256, bf16) is built on
the meta device and captured as a joint forward+backward graph for a fake 8x8 (dp, tp) mesh; no
process group is needed.  For each layer count: capture time (torch's AOT export, each repeated
layer traced once as ``capture`` does by default; --no-reuse traces every layer), auto's planning
time (annotate with the global solve, then redistribute) and its breakdown, and the modelled step
cost (communication + compute, the figures auto minimises) of auto's plan and of the hand plans
(Megatron TP on tp with data parallel on dp, and Megatron + FSDP-style parameters sharded on dp),
each under the same per-rank memory budget check.

    python benchmarks/auto_plan.py [--layers 2 8 32] [--seq 2048] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import zoo
from fxshard.api import annotate, capture, program, redistribute
from fxshard.ir import PARAM, info

GIB = 2**30


def llama3_8b(layers: int) -> zoo.Llama:
    cfg = zoo.LlamaConfig(
        dim=4096,
        n_layers=layers,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        return zoo.Llama(cfg).to(torch.bfloat16)


def fsdp(c):
    """Hand edit after annotate: every parameter also sharded on dp (dim 0 where it divides), the
    greedy annotation then re-run downstream by redistribute (gathers before use)."""
    mesh = c.mesh
    for n in c.gm.graph.nodes:
        rec = info(n)
        if n.op == "placeholder" and rec.kind == PARAM:
            pl = list(rec.spec.placements)
            val = n.meta["val"]
            if val.shape[0] % mesh.shape[0] == 0 and not isinstance(pl[0], Shard):
                pl[0] = Shard(0)
                fxshard.set_placement(n, tuple(pl))


def run(model, tokens, mesh, plan, budget=None, edit=None, reuse=True):
    t0 = time.perf_counter()
    c = capture(model, (tokens,), mesh=mesh, plan=plan, training=True, reuse_layers=reuse)
    t1 = time.perf_counter()
    annotate(c, auto_options=fxshard.AutoOptions(memory_budget=budget) if plan == "auto" else None)
    if edit:
        edit(c)
    redistribute(c)
    t2 = time.perf_counter()
    prog = program(c)
    return prog, t1 - t0, t2 - t1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--no-reuse", action="store_true", help="trace every layer (capture without reuse_layers)"
    )
    args = ap.parse_args()
    mesh = fxshard.MeshSpec((8, 8), names=("dp", "tp"))
    print(
        f"LLaMA-3-8B-shaped, bf16, joint fwd+bwd, mesh {mesh.shape} (dp, tp), batch {args.batch} x "
        f"seq {args.seq}"
    )
    print(
        "| layers | nodes | capture s | auto plan s (median) | capture + plan s | solve breakdown "
        "| auto cost ms | "
        "Megatron+DP ms | Megatron+FSDP ms | auto / best hand | state GiB/rank auto, TP+DP, "
        "TP+FSDP |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layers in args.layers:
        model = llama3_8b(layers)
        tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
        hand, _, _ = run(model, tokens, mesh, zoo.megatron_tp_plan())
        hf, _, _ = run(model, tokens, mesh, zoo.megatron_tp_plan(), edit=fsdp)
        ch, cf = hand.modelled_cost(), hf.modelled_cost()
        # parameters + gradients + Adam's two states, as FSDP+TP holds them
        budget = cf["state_bytes"] * 4
        times, caps = [], []
        for _ in range(args.repeat):
            auto, cap_s, plan_s = run(
                model, tokens, mesh, "auto", budget=budget, reuse=not args.no_reuse
            )
            times.append(plan_s)
            caps.append(cap_s)
        cap_s, plan_s = statistics.median(caps), statistics.median(times)
        ca, rep = auto.modelled_cost(), auto.captured.auto
        best = min(ch["total_us"], cf["total_us"])
        brk = ", ".join(f"{k} {v:.2f}" for k, v in rep.times.items() if k != "total")
        print(
            f"| {layers} | {rep.nodes} | {cap_s:.1f} | {plan_s:.2f} | {cap_s + plan_s:.1f} | {brk} "
            "| "
            f"{ca['total_us'] / 1e3:.1f} | {ch['total_us'] / 1e3:.1f} | {cf['total_us'] / 1e3:.1f} "
            "| "
            f"{ca['total_us'] / best:.2f}x | {ca['state_bytes'] / GIB:.2f}, "
            f"{ch['state_bytes'] / GIB:.2f}, "
            f"{cf['state_bytes'] / GIB:.2f} |",
            flush=True,
        )
        print(f"  {rep}", flush=True)


if __name__ == "__main__":
    main()
