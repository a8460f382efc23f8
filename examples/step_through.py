"""Step through the stages on the Llama-style model, edit one placement by hand, see the cost
change.

Run: python examples/step_through.py
"""

import torch
from torch.distributed.tensor import Shard

import fxshard
from fxshard import zoo
from fxshard.ir import info


def main():
    torch.manual_seed(0)
    model = zoo.init_weights(zoo.Llama())
    tokens = zoo.example_input(model)
    mesh = fxshard.MeshSpec((2, 2), names=("dp", "tp"))

    c = fxshard.capture(model, tokens, mesh=mesh, plan=zoo.megatron_tp_plan())
    print(f"captured: {len(c.gm.graph.nodes)} nodes")
    fxshard.annotate(c)
    before = fxshard.program(
        fxshard.redistribute(
            fxshard.annotate(fxshard.capture(model, tokens, mesh=mesh, plan=zoo.megatron_tp_plan()))
        )
    )

    # Hand edit: keep the final norm's output sharded on the sequence dim (tp), e.g. to try a
    # sequence-parallel lm_head.  Every node's record is in node.meta["fxshard"].
    norm_out = [
        n for n in c.gm.graph.nodes if info(n).module == "norm" and n.op == "call_function"
    ][-1]
    print(
        f"{norm_out.name} ({info(norm_out).module}): {info(norm_out).spec} <- "
        f"{info(norm_out).provenance}"
    )
    fxshard.set_placement(norm_out, (Shard(0), Shard(1)))
    print(f"{norm_out.name} is now {info(norm_out).spec}")

    fxshard.redistribute(c)
    after = fxshard.program(c)
    print(fxshard.diff(before, after, names=("annotated", "hand-edited")))

    out = after.simulate(*tokens)
    with torch.no_grad():
        ref = model(*tokens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    print(f"\nmax error {(out - ref).abs().max().item():.2e}: sharded result matches single device")


if __name__ == "__main__":
    main()
