"""Plan quality on Llamas written by others (``benchmarks/others.py``), and plan="auto"'s speed.

Part 1, hand plans (small models, mesh (4,), simulated ranks): for each model (eager attention,
Hugging Face structure, torchtitan structure) and each of its plans (Megatron TP, sequence
parallel), the forward collectives per layer of fxshard's two searches (``search="global"``, the
default, and ``search="greedy"``, op by op) and of DTensor (torch's ``parallelize_module`` with the
same plan, counted by ``CommDebugMode`` on simulated ranks), the modelled cost, and the largest
difference to single device (training: loss and every gradient).  The Megatron minimum is 2
all-reduces per layer (TP) and 2 all-gathers + 2 reduce-scatters per layer (SP); the model's
embedding and head add a fixed count on top, so both are printed per program.

Part 2, ``plan="auto"`` at LLaMA-3-8B shapes (32 layers, bf16, joint graph, 8x8 (dp, tp) mesh,
batch 64 x seq 2048, meta device): capture and planning time (medians of ``--repeat``), the
solver's size (decisions, ILP columns), and the modelled step cost against the hand plan
(Megatron TP on tp, data parallel on dp) of the same model.

    python benchmarks/plan_quality.py [--part 1 2] [--layers 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import others  # noqa: E402

import fxshard  # noqa: E402
from fxshard.api import annotate, capture, program, redistribute  # noqa: E402
from fxshard.runtime.simulate import SimulatedMesh  # noqa: E402

SHORT = {
    "all_reduce": "AR",
    "all_gather": "AG",
    "reduce_scatter": "RS",
    "all_to_all": "A2A",
    "all_gather_into_tensor": "AG",
    "reduce_scatter_tensor": "RS",
}


def counts_text(counts: dict) -> str:
    return " ".join(f"{v} {SHORT.get(k, k)}" for k, v in sorted(counts.items())) or "none"


def dtensor_counts(model, plan, x, k: int) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    from fxshard._torch import make_local_tensor

    with SimulatedMesh((k,)) as sim:
        pm = parallelize_module(copy.deepcopy(model), sim.device_mesh, plan)
        mode = CommDebugMode()
        with mode:
            pm(make_local_tensor({r: x.clone() for r in range(k)}))
        return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def max_error(model, prog, x, training: bool) -> float:
    ref = model(x)
    if not training:
        return (prog.simulate(x) - ref).abs().max().item()
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    out, grads = prog.simulate(x, grad_outputs=(g,))
    model.zero_grad()
    ref.backward(g)
    out = out[0] if isinstance(out, tuple) else out
    err = (out - ref).abs().max().item()
    for fqn, p in model.named_parameters():
        scale = p.grad.abs().max().item() or 1.0
        err = max(err, (grads[fqn] - p.grad).abs().max().item() / scale)
    return err


def part1(args):
    k = 4
    mesh = fxshard.MeshSpec((k,))
    print(
        f"Hand plans, mesh ({k},), {args.small_layers} layers, batch 4 x seq 8, simulated ranks; "
        "forward collectives (training: forward / backward); error: max |fxshard - single "
        "device| (gradients relative to their largest entry)"
    )
    print(
        "| model | plan | mode | DTensor fwd | fxshard global fwd | fxshard greedy fwd | "
        "global / greedy modelled us | global plan s | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, cls in others.MODELS.items():
        torch.manual_seed(0)
        model = others.init(cls(others.Config(n_layers=args.small_layers)))
        x = torch.randint(0, model.cfg.vocab_size, (4, 8), generator=torch.Generator())
        for pname, make_plan in (("TP", others.tp_plan), ("SP", others.sp_plan)):
            plan = make_plan(model)
            dt = counts_text(dtensor_counts(model, plan, x, k))
            for training in (False, True):
                res = {}
                for search in ("global", "greedy"):
                    t0 = time.perf_counter()
                    prog = fxshard.shard(
                        model, mesh, plan, example_inputs=(x,), training=training, search=search
                    )
                    dt_s = time.perf_counter() - t0
                    by_phase = collections.defaultdict(collections.Counter)
                    for c in prog.collectives():
                        by_phase[c.phase][c.kind] += 1
                    text = counts_text(by_phase["forward"])
                    if training:
                        text += " / " + counts_text(by_phase["backward"])
                    res[search] = (text, prog.modelled_cost()["total_us"], dt_s, prog)
                err = max_error(model, res["global"][3], x, training)
                print(
                    f"| {name} | {pname} | {'train' if training else 'fwd'} | {dt} | "
                    f"{res['global'][0]} | {res['greedy'][0]} | {res['global'][1]:.1f} / "
                    f"{res['greedy'][1]:.1f} | {res['global'][2]:.2f} | {err:.1e} |",
                    flush=True,
                )


def _plan(model, tokens, mesh, plan):
    t0 = time.perf_counter()
    c = capture(model, (tokens,), mesh=mesh, plan=plan, training=True)
    t1 = time.perf_counter()
    annotate(c)
    redistribute(c)
    t2 = time.perf_counter()
    return program(c), t1 - t0, t2 - t1


def part2(args):
    mesh = fxshard.MeshSpec((8, 8), names=("dp", "tp"))
    print(
        f"\nplan='auto', LLaMA-3-8B shapes, {args.layers} layers, bf16, joint fwd+bwd, mesh "
        f"{mesh.shape} (dp, tp), batch 64 x seq 2048; medians of {args.repeat}"
    )
    print(
        "| model | nodes | capture s | plan s | capture + plan s | decisions | ILP columns | "
        "auto cost ms | hand TP+DP cost ms | auto / hand |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, cls in others.MODELS.items():
        cfg = others.llama3_8b_config(args.layers)
        with torch.device("meta"):
            model = cls(cfg).to(torch.bfloat16)
        tokens = torch.zeros(64, 2048, dtype=torch.long, device="meta")
        hand, _, _ = _plan(model, tokens, mesh, others.tp_plan(model))
        caps, plans = [], []
        for _ in range(args.repeat):
            auto, cap_s, plan_s = _plan(model, tokens, mesh, "auto")
            caps.append(cap_s)
            plans.append(plan_s)
        rep = auto.captured.auto
        ca, ch = auto.modelled_cost()["total_us"], hand.modelled_cost()["total_us"]
        cap_s, plan_s = statistics.median(caps), statistics.median(plans)
        print(
            f"| {name} | {rep.nodes} | {cap_s:.1f} | {plan_s:.1f} | {cap_s + plan_s:.1f} | "
            f"{rep.variables} | {rep.ilp_columns} | {ca / 1e3:.1f} | {ch / 1e3:.1f} | "
            f"{ca / ch:.2f}x |",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--small-layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if 1 in args.part:
        part1(args)
    if 2 in args.part:
        part2(args)


if __name__ == "__main__":
    main()
