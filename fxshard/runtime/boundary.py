"""DTensor at program boundaries: a sharded value outside a compiled program is a DTensor.

A DTensor argument's placements and shard order become its placeholder's ``ShardingSpec`` and its
local tensor is handed to the per-rank program as it is (no communication); an output asked for as
a DTensor wraps this rank's local result with the program's spec (no gather).  Even shards of any
placement and shard order line up with DTensor's layout (both cut blocks in mesh-dim order,
outermost first), and uneven ones too: both follow torch.chunk (the last ranks hold less, or
nothing).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._torch import dtensor_layout, dtensor_local, fake_mode, is_dtensor, make_dtensor
from ..core.mesh import MeshSpec
from ..core.spec import ShardingSpec

OUTPUTS = ("global", "dtensor")


def spec_of(dt, mesh: MeshSpec, what: str = "a DTensor argument") -> ShardingSpec:
    """The ShardingSpec of a DTensor on ``mesh`` (the program's mesh)."""
    if tuple(dt.device_mesh.shape) != tuple(mesh.shape):
        raise ValueError(
            f"{what} lives on a mesh of shape {tuple(dt.device_mesh.shape)}, the program is "
            f"sharded on {mesh.shape}; redistribute it onto the program's DeviceMesh first"
        )
    placements, order = dtensor_layout(dt)
    return ShardingSpec.make(mesh, placements, tuple(dt.shape), dt.dtype, order, what=what)


def check_mesh(dt, device_mesh: DeviceMesh | None, what: str) -> None:
    if device_mesh is not None and dt.device_mesh != device_mesh:
        raise ValueError(
            f"{what} is a DTensor on {dt.device_mesh}, the program runs on {device_mesh}: "
            "one program takes DTensors of its own DeviceMesh only (redistribute them onto it, or "
            "pass full_tensor())"
        )


def as_program_arg(x, mesh: MeshSpec, what: str):
    """A call argument as the program takes it: a DTensor (checked to be on the program's mesh),
    which the per-rank program runs on as it is, uneven shards included, or a plain (global)
    tensor."""
    if is_dtensor(x):
        spec_of(x, mesh, what)
    return x


def local_arg(dt, spec: ShardingSpec, coord, what: str) -> torch.Tensor:
    """This rank's local tensor of a DTensor argument, checked against the program's spec."""
    local = dtensor_local(dt)
    want = spec.local_shape(coord)
    if tuple(local.shape) != want:
        raise ValueError(
            f"{what}: its local shard has shape {tuple(local.shape)}, the program's spec {spec} "
            f"of {spec.shape} has {want} on mesh coordinate {tuple(coord)}"
        )
    return local.contiguous()


def wrap_output(local: torch.Tensor, device_mesh: DeviceMesh, spec: ShardingSpec):
    """This rank's shard of an output as a DTensor of the program's spec."""
    order = {d: ms for d, ms in spec.shard_order}
    if any(sf != 1 for lv in spec.levels for _, sf in lv):
        # genuinely strided levels: the placements carry them, in mesh-dim order only
        if any(list(ms) != sorted(ms) for ms in order.values()):
            raise NotImplementedError(
                f"an output sharded {spec} (strided shards and another dim's non-default shard "
                "order) has no DTensor spelling; ask for other output_placements"
            )
        order = None
    return make_dtensor(local, device_mesh, spec.placements, order, spec.shape)


def output_wrapper(specs, device_mesh: DeviceMesh, as_dtensor):
    """flat outputs -> the same, output ``k`` wrapped as a DTensor of ``specs[k]`` where
    ``as_dtensor[k]`` (worked out once per program, applied every call)."""
    want = [k < len(as_dtensor) and as_dtensor[k] for k in range(len(specs))]
    if not any(want):
        return lambda flat: flat

    def wrap(flat: list) -> list:
        return [
            wrap_output(v, device_mesh, specs[k])
            if k < len(want) and want[k] and isinstance(v, torch.Tensor)
            else v
            for k, v in enumerate(flat)
        ]

    return wrap


def standin(dt) -> torch.Tensor:
    """A fake tensor of a DTensor's global shape, dtype and device, for capture: no memory (the
    global value of a sharded KV cache may not fit on one rank); capture re-fakes it in its own
    mode."""
    with fake_mode():
        t = torch.empty(tuple(dt.shape), dtype=dt.dtype, device=dtensor_local(dt).device)
    return t.requires_grad_(dt.requires_grad)
