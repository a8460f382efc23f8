"""Every rank in one process: exact collectives on ``LocalTensorMode``, the test oracle.

``SimulatedMesh(shape)`` sets up a fake process group and a ``DeviceMesh`` of that shape (once per
world size; re-entered meshes of the same size share the group), and converts between global
tensors and per-rank local tensors of a ``ShardingSpec``:

    with SimulatedMesh((2, 4)) as sim:
        x = sim.distribute(full, spec)        # LocalTensor: every rank's shard
        y = some_per_rank_function(x)         # runs all ranks at once
        out = sim.assemble(y, spec)           # global tensor; replicas must agree
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .._torch import Partial, Replicate, local_tensor_mode, local_tensor_values, make_local_tensor
from ..core.mesh import MeshSpec
from ..core.spec import ShardingSpec
from ..planner.execute import average


class ReplicaMismatch(AssertionError):
    pass


class SimulatedMesh:
    def __init__(self, shape: Sequence[int], names: Sequence[str] | None = None):
        self.shape = tuple(shape)
        # flattened groups (fused collectives) need named dims; name them if the caller did not
        self.names = tuple(names) if names else tuple(f"d{i}" for i in range(len(self.shape)))
        self.world = math.prod(self.shape)
        self.spec = MeshSpec(self.shape, tuple(names) if names else None)
        self._owns_pg = False
        self._mode = None

    def __enter__(self) -> SimulatedMesh:
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized():
            if dist.get_world_size() != self.world or dist.get_backend() != "fake":
                raise RuntimeError(
                    f"simulating a {self.world}-rank mesh needs the default process group to be a "
                    "fake "
                    f"one of that size; a {dist.get_backend()} group of {dist.get_world_size()} "
                    "exists"
                )
        else:
            dist.init_process_group("fake", rank=0, world_size=self.world)
            self._owns_pg = True
        self.device_mesh = init_device_mesh("cpu", self.shape, mesh_dim_names=self.names)
        self.coords = {
            r: tuple(int(c) for c in (self.device_mesh.mesh == r).nonzero()[0])
            for r in range(self.world)
        }
        self._mode = local_tensor_mode(self.world)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        if self._owns_pg:
            dist.destroy_process_group()
        return False

    def outside(self):
        """A context in which tensors are plain again (no per-rank dispatch)."""
        return self._mode.disable()

    # ---- conversions --------------------------------------------------------------------------
    def distribute(
        self, full: torch.Tensor, spec: ShardingSpec, *, partial_seed: int | None = None
    ):
        """Every rank's shard of ``full``.  Partial dims: by default rank 0 of the dim holds the
        value (the rest zeros / copies); with ``partial_seed`` the value is split into random
        addends (sum, avg; for max / min, values below / above it on all but one rank), so that a
        reduction really has something to reduce."""
        locals_ = {}
        with self._mode.disable():
            gen = torch.Generator().manual_seed(partial_seed) if partial_seed is not None else None
            pdims = [m for m, p in enumerate(spec.placements) if isinstance(p, Partial)]
            parts = None
            ops = set(spec.partials.values())
            if gen is not None and pdims and ops <= {"sum", "avg"}:
                groups = math.prod(self.shape[m] for m in pdims)
                noise = [
                    torch.randn(full.shape, generator=gen, dtype=torch.float32).to(full.dtype)
                    for _ in range(groups - 1)
                ]
                parts = noise + [full - sum(noise)] if noise else [full]
                # avg dims average their addends: scale so the weighted sum is the value
                avg_share = math.prod(
                    self.shape[m] for m, op in spec.partials.items() if op == "avg"
                )
                parts = [p * avg_share for p in parts]
            elif gen is not None and pdims and len(ops) == 1 and ops <= {"max", "min"}:
                # max / min: one addend holds the value, the others lie below / above it
                groups = math.prod(self.shape[m] for m in pdims)
                sign = -1 if ops == {"max"} else 1
                parts = [
                    full
                    + sign
                    * torch.randn(full.shape, generator=gen, dtype=torch.float32)
                    .abs()
                    .to(full.dtype)
                    for _ in range(groups - 1)
                ] + [full]
            for r, c in self.coords.items():
                if parts is not None:
                    j = 0
                    for m in pdims:
                        j = j * self.shape[m] + c[m]
                    unsharded = ShardingSpec.make(
                        self.spec,
                        [p if not isinstance(p, Partial) else Replicate() for p in spec.placements],
                        spec.shape,
                        spec.dtype,
                        spec.shard_order,
                    )
                    locals_[r] = unsharded.shard_full(parts[j], c).clone()
                else:
                    # a copy per rank: a replica that is the caller's tensor (or another rank's)
                    # would see an in-place op once per rank, and change the caller's input
                    locals_[r] = spec.shard_full(full, c).clone()
        return make_local_tensor(locals_)

    def assemble(
        self, local: torch.Tensor, spec: ShardingSpec, *, check_replicas: bool = True
    ) -> torch.Tensor:
        """The global tensor a set of per-rank shards represents (partial dims reduced)."""
        vals = local_tensor_values(local, self.world)
        with self._mode.disable():
            return assemble(vals, spec, self.coords, check_replicas=check_replicas)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (replicas that both hold NaN agree)."""
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def assemble(
    vals: dict, spec: ShardingSpec, coords: dict, *, check_replicas: bool = True
) -> torch.Tensor:
    mesh_shape = spec.mesh.shape
    pdims = [m for m, p in enumerate(spec.placements) if isinstance(p, Partial)]
    op = spec.partial_op
    # Group ranks by their partial-dim coordinates: each group holds one full addend.
    addends = {}
    for r, c in coords.items():
        key = tuple(c[m] for m in pdims)
        local = vals[r]
        expect = spec.local_shape(c)
        if tuple(local.shape) != expect:
            raise AssertionError(
                f"rank {r} at {c}: local shape {tuple(local.shape)}, spec {spec} wants {expect}"
            )
        idx = [spec.local_indices(c, d) for d in range(len(spec.shape))]
        if key not in addends:
            addends[key] = (
                torch.zeros(spec.shape, dtype=local.dtype),
                torch.zeros(spec.shape, dtype=torch.bool),
            )
        full, seen = addends[key]
        grid = (
            torch.meshgrid(*[torch.tensor(i, dtype=torch.long) for i in idx], indexing="ij")
            if idx
            else ()
        )
        if check_replicas:
            prev = full[grid] if idx else full
            was = seen[grid] if idx else seen
            if was.any() and not _same(prev[was], local[was]):
                raise ReplicaMismatch(f"replicas disagree at rank {r} (coordinate {c}) for {spec}")
        if idx:
            full[grid] = local
            seen[grid] = True
        else:
            full.copy_(local)
            seen.fill_(True)
    for key, (_, seen) in addends.items():
        if not bool(seen.all()):
            raise AssertionError(f"shards of {spec} do not cover the tensor (partial group {key})")
    parts = [f for f, _ in addends.values()]
    if not pdims:
        return parts[0]
    stacked = torch.stack(parts)
    ops = set(spec.partials.values())
    if ops <= {"sum", "avg"}:  # linear: sum over every partial dim, divided by the avg dims' sizes
        avg_share = math.prod(mesh_shape[m] for m, o in spec.partials.items() if o == "avg")
        return average(stacked.sum(0), avg_share) if avg_share > 1 else stacked.sum(0)
    if op == "max":
        return stacked.amax(0)
    return stacked.amin(0)
