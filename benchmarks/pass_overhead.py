"""Time of each fxshard stage on the Llama-style model (forward graph) vs Inductor on the same
model.

For 2, 8 and 32 layers, on a (2, 4) dp x tp mesh with the Megatron TP plan: capture, annotate,
redistribute and lower times, graph nodes per second through the pass, and in the same run the time
``torch.compile`` (Inductor, CPU) takes to compile the single-device model (first call).

    python benchmarks/pass_overhead.py [--layers 2 8 32] [--no-inductor]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import fxshard
from fxshard import zoo
from fxshard.passes.lower import lower_to_local


def stage_times(n_layers: int):
    cfg = zoo.LlamaConfig(n_layers=n_layers)
    model = zoo.init_weights(zoo.Llama(cfg))
    x = zoo.example_input(model, batch=4, seq=16)
    mesh = fxshard.MeshSpec((2, 4), names=("dp", "tp"))
    t = {}
    t0 = time.perf_counter()
    cap = fxshard.capture(model, x, mesh=mesh, plan=zoo.megatron_tp_plan())
    t["capture"] = time.perf_counter() - t0
    nodes = len(cap.gm.graph.nodes)
    t0 = time.perf_counter()
    fxshard.annotate(cap)
    t["annotate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fxshard.redistribute(cap)
    t["redistribute"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    lower_to_local(cap.gm, mesh.ndim)
    t["lower"] = time.perf_counter() - t0
    return model, x, nodes, t


def inductor_time(model, x) -> float:
    """First-call compile time of the single-device model, with Inductor's caches off (a cold
    compile, as fxshard's own stages are timed cold too)."""
    import torch._inductor.config as inductor_config

    inductor_config.force_disable_caches = True
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="inductor")
    t0 = time.perf_counter()
    with torch.no_grad():
        compiled(*x)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args(argv)
    print(
        "| layers | nodes | capture s | annotate s | redistribute s | lower s | fxshard total s | "
        "nodes/s "
        "| annotate+redistribute+lower s | inductor compile s | (annotate+redistribute+lower) / "
        "inductor |"
    )
    print("|" + "---|" * 11)
    if not args.no_inductor:  # load the C++ toolchain once, outside the timed compiles
        inductor_time(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    for n in args.layers:
        model, x, nodes, t = stage_times(n)
        total = sum(t.values())
        ours = t["annotate"] + t["redistribute"] + t["lower"]
        ind = float("nan") if args.no_inductor else inductor_time(model, x)
        print(
            f"| {n} | {nodes} | {t['capture']:.2f} | {t['annotate']:.2f} | {t['redistribute']:.2f} "
            "| "
            f"{t['lower']:.2f} | {total:.2f} | {nodes / total:.0f} | {ours:.2f} | {ind:.2f} | "
            f"{ours / ind:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
