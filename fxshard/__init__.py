"""fxshard: an SPMD sharding compiler pass for PyTorch FX graphs."""

from .cost import CostModel, torch_compatible
from .mesh import MeshSpec
from .planner import RedistributePlan, Step, clear_plan_cache, plan_redistribute
from .spec import ShardingSpec

__all__ = ["MeshSpec", "CostModel", "torch_compatible", "ShardingSpec", "plan_redistribute",
           "RedistributePlan", "Step", "clear_plan_cache"]
