"""A user pass: turn every all-reduce into reduce-scatter + all-gather (through the sequence dim).

Reduce-scatter + all-gather moves the same bytes as an all-reduce but leaves a point where the value
is sequence-sharded, where a later pass could overlap or shrink work. The pass runs after
``redistribute``, edits the plans of the redistribute nodes, and the plan diff shows what changed.
Run: python examples/user_pass.py
"""

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import zoo
from fxshard.core.spec import ShardingSpec
from fxshard.ir import info
from fxshard.planner import plan_between


def all_reduce_to_rs_ag(gm, captured, seq_dim=1):
    changed = 0
    for node in gm.graph.nodes:
        rec = info(node)
        if rec.kind != "redistribute" or not any(
            s.collective == "all_reduce" for s in rec.plan.steps
        ):
            continue
        plan = rec.plan
        if plan.src.shape[seq_dim] % captured.mesh.size:
            continue  # the sequence dim must divide evenly
        new = None
        for step in plan.steps:
            if step.collective != "all_reduce":
                continue
            m = step.mesh_dims[0]
            # src -> (same, but mesh dim m sequence-sharded) -> dst: a reduce-scatter then an
            # all-gather
            mid = list(plan.src.placements)
            mid[m] = Shard(seq_dim)
            mid = ShardingSpec.make(plan.src.mesh, mid, plan.src.shape, plan.src.dtype)
            new = plan_between(plan.src, mid, captured.cost_model, even_only=True).then(
                plan_between(mid, plan.dst, captured.cost_model, even_only=True)
            )
            break
        if new is not None:
            rec.plan = new
            rec.provenance += " [rewritten: reduce-scatter + all-gather]"
            changed += 1
    print(f"all_reduce_to_rs_ag: rewrote {changed} redistributions")


def main():
    torch.manual_seed(0)
    model = zoo.init_weights(zoo.Llama())
    tokens = zoo.example_input(model)
    mesh = fxshard.MeshSpec((2, 2), names=("dp", "tp"))
    base = fxshard.shard(model, mesh, zoo.megatron_tp_plan(), example_inputs=tokens)
    prog = fxshard.shard(
        model,
        mesh,
        zoo.megatron_tp_plan(),
        example_inputs=tokens,
        passes=[("after_redistribute", all_reduce_to_rs_ag)],
    )
    print(fxshard.diff(base, prog, names=("megatron", "megatron + rs/ag pass")))
    kinds = sorted({c.kind for c in prog.collectives()})
    assert kinds == ["all_gather", "reduce_scatter"], kinds
    out = prog.simulate(*tokens)
    with torch.no_grad():
        ref = model(*tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    print(f"\nmax error {(out - ref).abs().max().item():.2e}: sharded result matches single device")


if __name__ == "__main__":
    main()
