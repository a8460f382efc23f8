"""The configuration of one sharding run: fixed when the run starts, read by every stage."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from .cost import CostModel, CostModelLike
from .mesh import MeshSpec

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket size
SEARCHES = ("global", "greedy")  # how the placements a plan leaves free are chosen
DEFAULT_SEARCH = "global"


@dataclass(frozen=True)
class ShardConfig:
    """What the stages need to know besides the program and the plan.

    ``mesh``: the mesh's shape and link figures; ``device_mesh``: the ``DeviceMesh`` to run on, when
    one was given; ``cost_model``: prices collectives (any object with ``.mesh`` and
    ``.collective(kind, mesh_dims, local_bytes)``); ``multi_dim_collectives``: the planner may use
    one collective over several mesh dims (a flattened group) where that is cheaper;
    ``bucket_bytes``: independent collectives of one kind are merged in the per-rank graph up to
    this many bytes (0: off); ``batch_size``: data-parallel mesh dims shard only inputs of this
    leading size (None: every input whose dim 0 divides); ``replicate_grads``: a joint graph hands
    its gradients back global (the ``torch.compile`` backend) instead of placed like their
    values; ``search``: how the placements a plan leaves free are chosen: ``"global"`` (one solve
    over the whole graph, the plan's parameter, input and boundary placements fixed: the placement
    problem ``plan="auto"`` solves) or ``"greedy"`` (node by node in graph order, each taking the
    cheapest state given its inputs: DTensor's op-by-op way)."""

    mesh: MeshSpec
    cost_model: object
    device_mesh: object = None
    multi_dim_collectives: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    batch_size: int | None = None
    replicate_grads: bool = False
    search: str = DEFAULT_SEARCH

    def __post_init__(self):
        if self.search not in SEARCHES:
            raise ValueError(f"search={self.search!r}: one of {SEARCHES}")

    @classmethod
    def make(
        cls, mesh: MeshSpec | DeviceMesh, *, cost_model: CostModelLike | None = None, **options
    ) -> ShardConfig:
        """From a ``MeshSpec`` or ``DeviceMesh``, with the default cost model when none is given;
        checks that a given cost model prices this mesh."""
        # a DeviceMesh runs the program; a MeshSpec or a shape only plans it
        device_mesh = mesh if hasattr(mesh, "get_group") else None
        spec = MeshSpec.from_device_mesh(mesh)
        cm = cost_model if cost_model is not None else CostModel(spec)
        if not hasattr(cm, "collective") or not isinstance(getattr(cm, "mesh", None), MeshSpec):
            raise TypeError(
                f"cost_model={cm!r}: a cost model needs .mesh (a MeshSpec) and "
                f".collective(kind, mesh_dims, local_bytes) -> us, e.g. fxshard.CostModel(mesh)"
            )
        if cm.mesh.shape != spec.shape:
            raise ValueError(
                f"the cost model is for mesh {cm.mesh.shape}, the program for {spec.shape}"
            )
        return cls(spec, cm, device_mesh, **options)
