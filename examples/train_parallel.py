"""Train the Llama-style model tensor-parallel on 2 gloo ranks with local-shard parameters.

The model is built on the meta device (no memory), parallelized (each rank allocates only its
shards), loaded from a single-device state dict, then trained with a plain AdamW on the local shards
(the joint forward+backward graph is sharded, split by the min-cut partitioner and compiled with
Inductor).  The losses are printed next to single-device training of the same model.

    python examples/train_parallel.py
"""

from __future__ import annotations

import torch

import fxshard
from fxshard import zoo


def train(rank, world, steps):
    from torch.distributed.device_mesh import init_device_mesh

    reference = zoo.init_weights(zoo.Llama(), seed=0)
    state = {
        **reference.state_dict(),
        "rope_cos": reference.rope_cos,
        "rope_sin": reference.rope_sin,
    }
    (tokens,) = zoo.example_input(reference, generator=torch.Generator().manual_seed(1))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = zoo.Llama()
    pm = fxshard.parallelize(model, mesh, zoo.megatron_tp_plan())
    pm.load_full_state_dict(state)
    held = sum(p.numel() for p in pm.parameters())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        for module, o in ((pm, opt), (reference, opt_ref)):
            o.zero_grad()
            loss = module(tokens).float().pow(2).mean()
            loss.backward()
            o.step()
            losses.append(float(loss.detach()))
    return held, sum(p.numel() for p in reference.parameters()), losses


def main():
    from fxshard.runtime.launch import spawn

    held, total, losses = spawn(2, train, 5)[0]
    print(f"rank 0 holds {held} of {total} parameters")
    print("step  fxshard (2 ranks)  single device")
    for i in range(0, len(losses), 2):
        print(f"{i // 2:4d}  {losses[i]:17.6f}  {losses[i + 1]:13.6f}")


if __name__ == "__main__":
    main()
