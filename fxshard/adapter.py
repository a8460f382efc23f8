"""The one place fxshard touches private torch APIs.

Everything private that fxshard depends on is imported or wrapped here, so a torch upgrade breaks
one file.  Public torch API (``torch.distributed.tensor.Shard`` and friends, functional collective
ops) is used directly elsewhere.
"""

from __future__ import annotations

from torch.distributed.tensor.placement_types import (  # noqa: F401  (re-exported)
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)

StridedShard = _StridedShard


def is_strided_shard(p) -> bool:
    return isinstance(p, _StridedShard)


def strided_split_factor(p) -> int:
    return int(p._split_factor_int())


def per_rank(fn):
    """Run ``fn`` once per simulated rank under ``LocalTensorMode`` (plain call otherwise).

    Used for the rank-dependent index arithmetic of the executor: arguments that are per-rank
    (LocalTensor, per-rank SymInt coordinates) arrive as that rank's tensor / int.
    """
    from torch.distributed._local_tensor import maybe_run_for_local_tensor

    return maybe_run_for_local_tensor(fn)


def local_tensor_mode(world_size: int):
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(world_size)


def make_local_tensor(per_rank_tensors: dict):
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank_tensors)


def local_tensor_values(t, world_size: int | None = None) -> dict:
    """{rank: tensor} of a LocalTensor (or an AsyncCollectiveTensor wrapping one).  A plain tensor
    (what simulation gives for a value identical on every rank) maps to every rank."""
    from torch.distributed._local_tensor import LocalTensor

    if hasattr(t, "wait") and not isinstance(t, LocalTensor):
        t = t.wait()
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    if world_size is None:
        raise TypeError("a plain tensor holds no per-rank values; pass world_size")
    return {r: t for r in range(world_size)}


def coordinate_tensor(device_mesh):
    """This rank's mesh coordinate as an int64 tensor (a per-rank LocalTensor when simulating)."""
    import torch
    from torch.distributed._local_tensor import enabled_local_tensor_mode, rank_map

    mesh = device_mesh.mesh
    if enabled_local_tensor_mode() is not None:
        return rank_map(lambda r: (mesh == r).nonzero()[0].clone())
    return torch.tensor(device_mesh.get_coordinate(), dtype=torch.long)
