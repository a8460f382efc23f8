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
    python benchmarks/auto_plan.py --scale [--only 8B@8x8 70B@4x4x4] [--time-budget 60]

``--scale``: torchtitan-style LLaMA-3 8B / 70B / 405B shapes on (dp, tp) and (dp, cp, tp) meshes,
time to plan and modelled cost against the hand plan (torchtitan's TP on tp, batch elsewhere).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import zoo
from fxshard.api import annotate, capture, program, redistribute
from fxshard.ir import PARAM, info

GIB = 2**30
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/others.py


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


def run(model, tokens, mesh, plan, budget=None, edit=None, reuse=True, auto_options=None):
    t0 = time.perf_counter()
    c = capture(model, (tokens,), mesh=mesh, plan=plan, training=True, reuse_layers=reuse)
    t1 = time.perf_counter()
    if plan == "auto" and auto_options is None:
        auto_options = fxshard.AutoOptions(memory_budget=budget)
    annotate(c, auto_options=auto_options if plan == "auto" else None)
    if edit:
        edit(c)
    redistribute(c)
    t2 = time.perf_counter()
    prog = program(c)
    return prog, t1 - t0, t2 - t1


# (name, layers, dim, heads, kv heads, ffn): LLaMA-3 shapes (vocab 128256)
SHAPES = {
    "8B": (32, 4096, 32, 8, 14336),
    "70B": (80, 8192, 64, 8, 28672),
    "405B": (126, 16384, 128, 8, 53248),
}
# (model, mesh) rows of --scale: issue 38's targets
SCALE_ROWS = [
    ("8B", (8, 8)),
    ("70B", (8, 8)),
    ("8B", (4, 4, 4)),
    ("8B", (8, 8, 4)),
    ("70B", (4, 4, 4)),
    ("70B", (8, 8, 4)),
    ("405B", (8, 8, 8)),
]


def titan(shape: str, layers: int | None = None):
    """A LLaMA-3 model written in torchtitan's style (``benchmarks/others.py: TitanLlama``: an
    ``nn.ModuleDict`` of layers, real-arithmetic RoPE, ``repeat_interleave`` GQA) on meta, bf16."""
    import others

    n, dim, heads, kv, ffn = SHAPES[shape]
    cfg = others.Config(dim, layers or n, heads, kv, 128256, ffn, 8192, 1e-5, 500000.0)
    with torch.device("meta"):
        return others.TitanLlama(cfg).to(torch.bfloat16)


def scale(args):
    """``plan="auto"`` at the scale people plan for: time to plan and modelled cost against the
    hand plan (torchtitan's TP on tp, the batch on the other mesh dims) on one mesh."""
    import others

    print(
        f"plan='auto', torchtitan-style LLaMA-3 (bf16, meta), joint fwd+bwd, batch {args.batch} x "
        f"seq {args.seq}, time budget {args.time_budget:.0f} s"
    )
    print(
        "| model | mesh | nodes | capture s | plan s | capture + plan s | auto cost ms | "
        "hand cost ms | auto / hand | solver |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [r for r in SCALE_ROWS if not args.only or f"{r[0]}@{'x'.join(map(str, r[1]))}"
            in args.only]  # fmt: skip
    for shape, dims in rows:
        names = ("dp", "tp") if len(dims) == 2 else ("dp", "cp", "tp")
        mesh = fxshard.MeshSpec(dims, names=names)
        model = titan(shape)
        tokens = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
        hand, _, _ = run(model, tokens, mesh, others.tp_plan(model))
        opts = fxshard.AutoOptions(time_budget_s=args.time_budget)
        t0 = time.perf_counter()
        try:
            auto, cap_s, plan_s = run(model, tokens, mesh, "auto", auto_options=opts)
        except Exception as e:  # noqa: BLE001 - the row says what failed
            print(f"| {shape} | {dims} | fails after {time.perf_counter() - t0:.0f} s: "
                  f"{type(e).__name__}: {str(e)[:120]} |", flush=True)  # fmt: skip
            continue
        rep = auto.captured.auto
        ca, ch = auto.modelled_cost()["total_us"], hand.modelled_cost()["total_us"]
        how = rep.stopped or f"gap {rep.ilp_gap:.2%}"
        if rep.kept_start:
            how += ", start kept"
        print(
            f"| {shape} | {'x'.join(map(str, dims))} | {rep.nodes} | {cap_s:.1f} | {plan_s:.1f} | "
            f"**{cap_s + plan_s:.1f}** | {ca / 1e3:.1f} | {ch / 1e3:.1f} | {ca / ch:.2f}x | "
            f"{how} |",
            flush=True,
        )
        print(f"  {rep}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument(
        "--no-reuse", action="store_true", help="trace every layer (capture without reuse_layers)"
    )
    ap.add_argument(
        "--scale",
        action="store_true",
        help="the torchtitan-style 8B / 70B / 405B rows on 2-D and 3-D meshes instead",
    )
    ap.add_argument("--only", nargs="*", default=[], help="--scale rows, e.g. 8B@8x8 70B@4x4x4")
    ap.add_argument("--time-budget", type=float, default=60.0, help="AutoOptions.time_budget_s")
    args = ap.parse_args()
    if args.scale:
        return scale(args)
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
