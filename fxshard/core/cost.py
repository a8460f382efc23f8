"""Alpha-beta cost model for collectives on mesh dims.

A collective over ``k`` ranks on one mesh dim (or several, flattened) costs

    base + hops * latency + bytes_moved / bandwidth

with ring algorithms: all-gather and reduce-scatter move ``n·(k-1)/k`` bytes per rank where ``n`` is
the full (gathered / pre-scatter) size, all-reduce twice that, all-to-all ``n·(k-1)/k`` of its own
local size.  The defaults reproduce torch's ``MeshTopoInfo`` formulas exactly (µs, with bytes
counted in GiB against GB/s figures), so that a plan's cost means the same thing as torch's, except
that all-to-all gets its real cost instead of torch's "all-gather of the local size + 1 µs"
placeholder (set ``alltoall_penalty_us=1.0`` to reproduce torch exactly).

Every cost here is a function of the *local input bytes per rank*; the planner tracks local size.
Users can subclass or pass their own object with the same ``collective`` method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from .mesh import MeshSpec

BASE_LATENCY_US = 6.6  # torch's per-collective launch latency
_GIB = float(1 << 30)
FLOPS_PER_US = 4.0e8  # 400 TFLOP/s sustained
HBM_BYTES_PER_US = 3.0e6  # 3 TB/s

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL)


class CostModelLike(Protocol):
    """What a planner needs of a cost model: the mesh it prices and a collective's modelled µs
    (``CostModel`` is one; any object with these two works)."""

    mesh: MeshSpec

    def collective(self, kind: str, mesh_dims: Sequence[int], local_bytes: float) -> float: ...


@dataclass(frozen=True)
class CostModel:
    """Collective costs on a mesh. ``collective(kind, mesh_dims, local_bytes)`` is all a planner
    needs."""

    mesh: MeshSpec
    base_latency_us: float = BASE_LATENCY_US
    alltoall_penalty_us: float = 0.0
    # compute figures for plan="auto" (an H100-class accelerator: dense bf16 flops, HBM bandwidth)
    flops_per_us: float = FLOPS_PER_US
    hbm_bytes_per_us: float = HBM_BYTES_PER_US

    def group(self, mesh_dims: Sequence[int]) -> tuple[int, float, float]:
        """(ranks, per-hop latency, bandwidth) of the group spanning ``mesh_dims``.

        A flattened group's ring crosses its slowest link, so it gets the worst latency and
        bandwidth of its dims, and pays the base latency once.
        """
        k = math.prod(self.mesh.shape[d] for d in mesh_dims)
        lat = max(self.mesh.latency[d] for d in mesh_dims)
        bw = min(self.mesh.bandwidth[d] for d in mesh_dims)
        return k, lat, bw

    def collective(self, kind: str, mesh_dims: Sequence[int], local_bytes: float) -> float:
        """Modelled µs of one collective whose input is ``local_bytes`` per rank."""
        k, lat, bw = self.group(mesh_dims)
        if k == 1:
            return 0.0
        return self.latency(kind, k, lat) + local_bytes * self.byte_factor(kind, k, bw)

    @cached_property
    def per_dim(self) -> dict[str, tuple[tuple[float, ...], tuple[float, ...]]]:
        """{kind: (latency per mesh dim, µs per local byte per mesh dim)}: the planner's tables."""
        out = {}
        for kind in COLLECTIVES:
            lats, facs = [], []
            for m in range(self.mesh.ndim):
                k, lat, bw = self.group((m,))
                lats.append(self.latency(kind, k, lat) if k > 1 else 0.0)
                facs.append(self.byte_factor(kind, k, bw) if k > 1 else 0.0)
            out[kind] = (tuple(lats), tuple(facs))
        return out

    @cached_property
    def planner_tables(self) -> tuple[dict, dict]:
        """({(kind, mesh_dim): latency}, {(kind, mesh_dim): µs per byte})."""
        lat, fac = {}, {}
        for kind, (lats, facs) in self.per_dim.items():
            for m in range(self.mesh.ndim):
                lat[kind, m] = lats[m]
                fac[kind, m] = facs[m]
        return lat, fac

    # The two halves are exposed separately: the planner precomputes them per mesh dim.
    def latency(self, kind: str, k: int, lat: float) -> float:
        hops = 2 * (k - 1) if kind == ALL_REDUCE else k - 1
        extra = self.alltoall_penalty_us if kind == ALL_TO_ALL else 0.0
        return self.base_latency_us + hops * lat + extra

    @staticmethod
    def byte_factor(kind: str, k: int, bw: float) -> float:
        """µs per local input byte."""
        per_byte = 1e6 / (_GIB * bw)
        if kind == ALL_GATHER:  # output is k times the input; each rank receives (k-1)/k of it
            return per_byte * (k - 1)
        if kind == ALL_REDUCE:
            return per_byte * 2 * (k - 1) / k
        if kind in (REDUCE_SCATTER, ALL_TO_ALL):
            return per_byte * (k - 1) / k
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {COLLECTIVES}")


_PROBE_BYTES = float(1 << 20)
_probed: dict = {}


def planner_tables(cost_model: CostModelLike) -> tuple[dict, dict]:
    """Per-mesh-dim latency and µs-per-byte tables for the planner.

    ``CostModel`` has them exactly.  Any other object works if it has ``mesh`` (a MeshSpec) and
    ``collective(kind, mesh_dims, local_bytes) -> µs``: the planner then probes it at 0 and 1 MiB
    per collective and mesh dim and treats it as affine in bytes (what the search assumes)."""
    tables = getattr(cost_model, "planner_tables", None)
    if tables is not None:
        return tables
    key = id(cost_model)
    hit = _probed.get(key)
    if hit is not None and hit[0] is cost_model:
        return hit[1]
    if not hasattr(cost_model, "collective") or not hasattr(cost_model, "mesh"):
        raise TypeError(
            f"a cost model needs .mesh and .collective(kind, mesh_dims, local_bytes); "
            f"{type(cost_model).__name__} has not"
        )
    lat, fac = {}, {}
    for kind in COLLECTIVES:
        for m in range(cost_model.mesh.ndim):
            a = float(cost_model.collective(kind, (m,), 0.0))
            b = float(cost_model.collective(kind, (m,), _PROBE_BYTES))
            if a < 0 or b < a:
                raise ValueError(
                    f"cost model {type(cost_model).__name__}: {kind} on mesh dim {m} must cost >= "
                    "0 "
                    f"and not less for more bytes (got {a} us for 0 B, {b} us for 1 MiB)"
                )
            lat[kind, m] = a
            fac[kind, m] = (b - a) / _PROBE_BYTES
    _probed[key] = (cost_model, (lat, fac))
    return lat, fac


def torch_compatible(mesh: MeshSpec) -> CostModel:
    """torch's cost model, +1 µs all-to-all placeholder included (for like-for-like comparisons)."""
    return CostModel(mesh, alltoall_penalty_us=1.0)
