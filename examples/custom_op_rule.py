"""A fused RMSNorm as a torch.library custom op, taught to fxshard with a sharding rule.

The op normalises over the last dim, so it may be sharded on any other dim (batch, sequence) as long
as its weight stays replicated. Run: python examples/custom_op_rule.py
"""

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import fxshard


@torch.library.custom_op("examples::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


# Per mesh dim: (placements of x and weight, placement of the output).  fxshard combines them over
# the mesh dims and always allows all-replicated.  Checked here against the op's schema.
fxshard.register_rule(
    torch.ops.examples.rms_norm.default,
    [
        ((Shard(0), Replicate()), (Shard(0),)),  # batch
        ((Shard(1), Replicate()), (Shard(1),)),  # sequence
    ],
)


class Block(nn.Module):
    def __init__(self, dim=32, hidden=64):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.rand(dim) + 0.5)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(rms_norm(x, self.norm_weight, 1e-5))))


def main():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(4, 8, 32)
    mesh = fxshard.MeshSpec((2, 2), names=("dp", "tp"))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    prog = fxshard.shard(model, mesh, plan, example_inputs=(x,))
    print(prog.explain())
    out = prog.simulate(x)
    with torch.no_grad():
        ref = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    print(f"\nmax error {(out - ref).abs().max().item():.2e}: sharded result matches single device")


if __name__ == "__main__":
    main()
