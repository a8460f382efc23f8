"""fxshard: an SPMD sharding compiler pass for PyTorch FX graphs."""

from .api import shard
from .cost import CostModel, torch_compatible
from .mesh import MeshSpec
from .planner import RedistributePlan, Step, clear_plan_cache, plan_redistribute
from .program import Collective, ShardedProgram
from .spec import ShardingSpec

__all__ = ["MeshSpec", "CostModel", "torch_compatible", "ShardingSpec", "plan_redistribute",
           "RedistributePlan", "Step", "clear_plan_cache", "shard", "ShardedProgram", "Collective"]
