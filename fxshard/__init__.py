"""fxshard: an SPMD sharding compiler pass for PyTorch FX graphs."""

from .adapter import register_torch_logs as _register_torch_logs
from .api import shard
from .cost import CostModel, torch_compatible
from .mesh import MeshSpec
from .planner import RedistributePlan, Step, clear_plan_cache, plan_redistribute
from .program import Collective, ShardedProgram
from .report import diff
from .spec import ShardingSpec

_register_torch_logs()

__all__ = ["MeshSpec", "CostModel", "torch_compatible", "ShardingSpec", "plan_redistribute",
           "RedistributePlan", "Step", "clear_plan_cache", "shard", "ShardedProgram", "Collective", "diff"]
