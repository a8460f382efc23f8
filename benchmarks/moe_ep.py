"""Expert parallelism of Hugging Face MoE models: fxshard against transformers' own EP, same run,
same weights, same inputs.

Per architecture (tiny random-init transformers MoE models built from config, ``--experts``
experts, top 2), on ``--ranks`` gloo ranks of this machine (CPU, loopback), one forward step of the
global batch (``use_cache=False``):

* **HF EP + torch.compile**: ``DistributedConfig(enable_expert_parallel=True)`` then transformers'
  ``apply_tensor_parallelism(model, mesh)`` (its ``_ep_plan``: experts' weights split by experts,
  the router masked to each rank's experts, the experts' output all-reduced), then
  ``torch.compile``;
* **fxshard EP plan**: ``torch.compile(model, backend="fxshard", options={"mesh": mesh, "plan":
  model._ep_plan})``: the same plan; each experts module is one region, a rank computes its
  experts' pairs and the output is summed (one all-reduce per MoE layer);
* **fxshard DP + EP dispatch**: the batch split over the ranks (data parallel) and the experts by
  experts on the same mesh dim (``grouped_gemm`` entries only; ``fxshard.shard(...).compile()``,
  input and output ``Shard(0)``): tokens are dispatched to their experts' ranks and back by
  all-to-all inside each region (torchtitan's EP); every other layer runs on the rank's rows.

Columns: the collectives of one step (fxshard: its per-rank program, a dispatch region's three
all-to-alls included; HF: counted at dispatch on the eager twin) and the bytes a rank hands them,
the median step time of ``--repeats`` calls (a barrier before each, the variants alternating) and
its ratio to HF EP, and whether the logits equal single device's.  On 2 cores the ranks share the
CPUs: quote medians and ratios.

    python benchmarks/moe_ep.py [--ranks 4] [--experts 8] [--batch 8] [--seq 64]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from decode import CollectiveBytes

SIZE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024,
            max_position_embeddings=256, num_attention_heads=8, num_key_value_heads=4,
            num_experts_per_tok=2, head_dim=32)  # fmt: skip
HF, FX_EP, FX_DP = "HF EP + torch.compile", "fxshard EP plan", "fxshard DP + EP dispatch"


def build(name, experts):
    import transformers as T

    torch.manual_seed(0)
    make = {
        "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**SIZE, num_local_experts=experts)),
        "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(**SIZE, moe_intermediate_size=128, num_experts=experts)
        ),
    }[name]
    return make().eval()


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def worker(rank, world, archs, experts, batch, seq, repeats):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from transformers import DistributedConfig
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    import fxshard
    from fxshard.backend import compiled_programs, programs_built

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, SIZE["vocab_size"], (batch, seq), generator=g)
    out = {}
    for name in archs:
        base = build(name, experts)
        with torch.no_grad():
            want = base(x, use_cache=False).logits
        row = {}
        torch._dynamo.reset()
        hf = copy.deepcopy(base)
        hf.config.distributed_config = DistributedConfig(enable_expert_parallel=True)
        hf = apply_tensor_parallelism(hf, dm)
        with torch.no_grad(), CollectiveBytes() as c:
            hf(x, use_cache=False)
        row[HF] = dict(calls=len(c.calls), bytes=c.bytes)
        hf_c = torch.compile(hf)

        n0 = programs_built()
        options = {"mesh": dm, "plan": dict(base._ep_plan)}
        fx_ep = torch.compile(copy.deepcopy(base), backend="fxshard", options=options)
        grouped = {f"model.{k}": v for k, v in base._ep_plan.items() if v == "grouped_gemm"}
        rows = [(Shard(0),)]
        prog = fxshard.shard(_Logits(copy.deepcopy(base)), dm, grouped, example_inputs=(x,),
                             input_placements=rows, output_placements=rows)  # fmt: skip
        fx_dp = prog.compile()
        local_want = fx_dp.output_specs[0].local_of(want, fx_dp.coord_ints)

        variants = {
            HF: lambda f=hf_c: f(x, use_cache=False).logits,
            FX_EP: lambda f=fx_ep: f(x, use_cache=False).logits,
            FX_DP: lambda f=fx_dp: f(x),
        }
        refs = {HF: want, FX_EP: want, FX_DP: local_want}
        times = {k: [] for k in variants}
        with torch.no_grad():
            for label, f in variants.items():  # first calls compile
                dist.barrier()
                got = f()
                row.setdefault(label, {})["same"] = bool(
                    torch.allclose(got, refs[label], rtol=1e-4, atol=1e-4)
                )
            (ep_prog,) = compiled_programs(n0)
            for label, p in ((FX_EP, ep_prog), (FX_DP, prog)):
                calls = p.collectives()
                row[label].update(calls=len(calls), bytes=sum(c.bytes for c in calls))
            for _ in range(repeats):
                for label, f in variants.items():
                    dist.barrier()
                    t = time.perf_counter()
                    f()
                    times[label].append(time.perf_counter() - t)
        for label in variants:
            row[label]["step_ms"] = 1e3 * statistics.median(times[label])
        out[name] = row
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--archs", default="mixtral,qwen3_moe")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from fxshard.runtime.launch import spawn

    archs = args.archs.split(",")
    per_rank = spawn(
        args.ranks, worker, archs, args.experts, args.batch, args.seq, args.repeats, timeout=3000
    )
    print(
        f"HF MoE models, expert parallelism: hidden {SIZE['hidden_size']}, "
        f"{SIZE['num_hidden_layers']} layers, {args.experts} experts top 2, batch {args.batch}, "
        f"seq {args.seq}; {args.ranks} gloo ranks (CPU); medians over ranks of {args.repeats} "
        "steps"
    )
    print(f"{'arch':10} {'variant':26} {'collectives':>11} {'bytes/rank':>10} {'step ms':>8} "
          f"{'/HF EP':>7} {'same':>5}")  # fmt: skip
    for name in archs:
        hf_ms = statistics.median(r[name][HF]["step_ms"] for r in per_rank)
        for label in (HF, FX_EP, FX_DP):
            r0 = per_rank[0][name][label]
            ms = statistics.median(r[name][label]["step_ms"] for r in per_rank)
            same = all(r[name][label]["same"] for r in per_rank)
            print(f"{name:10} {label:26} {r0['calls']:>11d} {r0['bytes']:>10d} {ms:8.1f} "
                  f"{ms / hf_ms:7.2f} {str(same):>5}")  # fmt: skip


if __name__ == "__main__":
    main()
