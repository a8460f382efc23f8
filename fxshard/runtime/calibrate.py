"""``fxshard.calibrate(device_mesh)``: measure each mesh dim's latency and bandwidth with a few real
all-gathers and return a CostModel that plans with them (gloo on CPU, NCCL on GPU alike)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.cost import CostModel
from ..core.mesh import MeshSpec

_GIB = float(1 << 30)


def _time_all_gather(group, nbytes: int, device, repeats: int) -> float:
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    k = dist.get_world_size(group)
    out = torch.empty(x.numel() * k, dtype=x.dtype, device=device)
    dist.all_gather_into_tensor(out, x, group=group)  # warm-up (connection set-up)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_gather_into_tensor(out, x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    # every rank must agree on the number; the slowest rank's median is what a collective costs
    t = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def calibrate(
    device_mesh: DeviceMesh,
    sizes: Sequence[int] = (1 << 12, 1 << 16, 1 << 20),
    repeats: int = 5,
) -> CostModel:
    """Fit ``t = a + b * bytes`` for an all-gather on every mesh dim and turn it into the alpha-beta
    model: per-hop latency ``a / (k - 1)`` and bandwidth ``(k - 1) / b``, base latency folded in.
    Every rank must call it (it runs collectives)."""
    device = torch.device(
        device_mesh.device_type
        if device_mesh.device_type != "cuda"
        else f"cuda:{torch.cuda.current_device()}"
    )
    lat, bw = [], []
    for m in range(device_mesh.ndim):
        group = device_mesh.get_group(m)
        k = device_mesh.size(m)
        if k == 1:
            lat.append(0.0)
            bw.append(1e9)
            continue
        xs = [float(s) for s in sizes]
        ys = [_time_all_gather(group, int(s), device, repeats) for s in sizes]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        slope = max(slope, 1e-12)
        intercept = max(my - slope * mx, 0.0)
        lat.append(intercept / (k - 1))
        # all-gather moves (k-1) * input bytes per rank: µs per byte = (k-1) / B, B in GiB/s
        bw.append((k - 1) * 1e6 / (slope * _GIB))
    mesh = MeshSpec(
        tuple(device_mesh.mesh.shape), device_mesh.mesh_dim_names, bandwidth=bw, latency=lat
    )
    return CostModel(mesh, base_latency_us=0.0)
