"""fxshard: an SPMD sharding compiler pass for PyTorch FX graphs."""

from .adapter import register_torch_logs as _register_torch_logs
from .api import PASS_POINTS, annotate, capture, lower, program, redistribute, set_placement, shard
from .calibrate import calibrate
from .cost import CostModel, torch_compatible
from .mesh import MeshSpec
from .parallelize import ParallelModule, parallelize
from .passes.auto import AutoInfeasible, AutoOptions
from .planner import RedistributePlan, Step, clear_plan_cache, plan_redistribute
from .program import Collective, ShardedProgram
from .report import diff
from .spec import ShardingSpec
from .strategies import register_rule, unregister_rule

_register_torch_logs()

__all__ = ["MeshSpec", "CostModel", "torch_compatible", "ShardingSpec", "plan_redistribute",
           "RedistributePlan", "Step", "clear_plan_cache", "shard", "ShardedProgram", "Collective", "diff",
           "capture", "annotate", "set_placement", "redistribute", "program", "lower", "PASS_POINTS",
           "register_rule", "unregister_rule", "calibrate", "parallelize", "ParallelModule",
           "AutoOptions", "AutoInfeasible"]
