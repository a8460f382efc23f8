"""MeshSpec: the shape of a device mesh and what its links cost, with no process group attached.

Planning needs only sizes, names and link figures; lowering and execution additionally need a
real (or simulated) ``DeviceMesh``. Keeping the two apart lets a 64-rank plan be made on a laptop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from torch.distributed.device_mesh import DeviceMesh

# torch's MeshTopoInfo figures (torch/distributed/tensor/_collective_utils.py), so that our costs
# compare with torch's on equal terms: NVLink-class bandwidth and latency inside a host, 0.22x the
# bandwidth and ethernet latency once a mesh dim spans hosts.
INTRA_HOST_BANDWIDTH_GBPS = 87.7
INTRA_HOST_LATENCY_US = 0.6
INTER_HOST_BANDWIDTH_FACTOR = 0.22
INTER_HOST_LATENCY_US = 2.7
DEFAULT_DEVICES_PER_HOST = 8


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh as the planner sees it.

    ``bandwidth[d]`` is in GB/s (GiB, as torch counts), ``latency[d]`` in µs per hop.  When not
    given they follow torch's rule: walking mesh dims from the innermost out, a dim is inter-host
    once the devices covered so far exceed ``devices_per_host``.
    """

    shape: tuple[int, ...]
    names: tuple[str, ...] | None = None
    bandwidth: tuple[float, ...] = field(default=())
    latency: tuple[float, ...] = field(default=())
    devices_per_host: int = DEFAULT_DEVICES_PER_HOST

    def __init__(
        self,
        shape: Sequence[int],
        names: Sequence[str] | None = None,
        *,
        bandwidth: Sequence[float] | None = None,
        latency: Sequence[float] | None = None,
        devices_per_host: int = DEFAULT_DEVICES_PER_HOST,
    ):
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(
                f"MeshSpec: mesh shape must be a non-empty tuple of positive sizes, got {shape}"
            )
        if names is not None:
            names = tuple(names)
            if len(names) != len(shape):
                raise ValueError(
                    f"MeshSpec: {len(names)} dim names {names} for a {len(shape)}-D mesh {shape}"
                )
            if len(set(names)) != len(names):
                raise ValueError(f"MeshSpec: dim names must be unique, got {names}")
        default_bw, default_lat = _torch_topology(shape, devices_per_host)
        bandwidth = tuple(float(b) for b in bandwidth) if bandwidth is not None else default_bw
        latency = tuple(float(x) for x in latency) if latency is not None else default_lat
        for what, vals in (("bandwidth", bandwidth), ("latency", latency)):
            if len(vals) != len(shape):
                raise ValueError(
                    f"MeshSpec: {what} has {len(vals)} entries for a {len(shape)}-D mesh"
                )
        if any(b <= 0 for b in bandwidth) or any(x < 0 for x in latency):
            raise ValueError(
                f"MeshSpec: bandwidth must be > 0 and latency >= 0, got {bandwidth}, {latency}"
            )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "bandwidth", bandwidth)
        object.__setattr__(self, "latency", latency)
        object.__setattr__(self, "devices_per_host", devices_per_host)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def dim_index(self, dim: int | str) -> int:
        """Mesh dim by index or by name."""
        if isinstance(dim, str):
            if self.names is None or dim not in self.names:
                raise ValueError(f"mesh has no dim named {dim!r} (names: {self.names})")
            return self.names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise ValueError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh | MeshSpec, **overrides) -> MeshSpec:
        """Build from a ``torch.distributed.DeviceMesh`` (or pass a MeshSpec through; a shape
        such as ``(2, 4)`` is taken as ``MeshSpec((2, 4))``)."""
        if isinstance(device_mesh, MeshSpec):
            return device_mesh
        if isinstance(device_mesh, int) and not isinstance(device_mesh, bool):
            device_mesh = (device_mesh,)
        if isinstance(device_mesh, (tuple, list)) and all(
            isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in device_mesh
        ):
            return cls(tuple(device_mesh), **overrides)
        if not hasattr(device_mesh, "mesh_dim_names") or not hasattr(device_mesh, "mesh"):
            raise TypeError(
                f"fxshard: expected a mesh (a torch DeviceMesh from init_device_mesh, an "
                f"fxshard.MeshSpec, or a shape such as (2, 4)), got {device_mesh!r}"
            )
        names = device_mesh.mesh_dim_names
        overrides.setdefault("devices_per_host", _devices_per_host(device_mesh.device_type))
        return cls(tuple(device_mesh.mesh.shape), names, **overrides)

    def __repr__(self) -> str:
        names = f", names={self.names}" if self.names else ""
        return f"MeshSpec({self.shape}{names})"


def _torch_topology(shape, devices_per_host):
    bw = [INTRA_HOST_BANDWIDTH_GBPS] * len(shape)
    lat = [INTRA_HOST_LATENCY_US] * len(shape)
    covered = 1
    for d in reversed(range(len(shape))):
        covered *= shape[d]
        if covered > devices_per_host:
            bw[d] *= INTER_HOST_BANDWIDTH_FACTOR
            lat[d] = INTER_HOST_LATENCY_US
    return tuple(bw), tuple(lat)


def _devices_per_host(device_type: str) -> int:
    # torch asks the accelerator; a CPU "host" has no natural device count, so keep our default.
    if device_type == "cuda":
        import torch

        n = torch.cuda.device_count()
        return n if n > 0 else DEFAULT_DEVICES_PER_HOST
    return DEFAULT_DEVICES_PER_HOST
