"""fxshard: an SPMD sharding compiler pass for PyTorch FX graphs."""

from ._torch import register_torch_logs as _register_torch_logs
from .api import PASS_POINTS, annotate, capture, lower, program, redistribute, set_placement, shard
from .core.config import ShardConfig
from .core.cost import CostModel, torch_compatible
from .core.mesh import MeshSpec
from .core.spec import ShardingSpec
from .ir import Collective
from .parallelize import ParallelModule, parallelize
from .placement.auto import AutoInfeasible, AutoOptions
from .planner import RedistributePlan, Step, clear_plan_cache, plan_redistribute
from .report import diff
from .rules import register_rule, unregister_rule
from .runtime import launch
from .runtime.agree import AgreementOptions, RanksDisagree
from .runtime.boundary import KeptTensor, kept
from .runtime.calibrate import calibrate
from .runtime.program import ShardedProgram
from .runtime.rulecheck import check_rule

_register_torch_logs()

__all__ = [
    "MeshSpec",
    "CostModel",
    "torch_compatible",
    "ShardingSpec",
    "ShardConfig",
    "plan_redistribute",
    "RedistributePlan",
    "Step",
    "clear_plan_cache",
    "shard",
    "ShardedProgram",
    "Collective",
    "diff",
    "capture",
    "annotate",
    "set_placement",
    "redistribute",
    "program",
    "lower",
    "PASS_POINTS",
    "register_rule",
    "unregister_rule",
    "calibrate",
    "parallelize",
    "ParallelModule",
    "AutoOptions",
    "AutoInfeasible",
    "launch",
    "AgreementOptions",
    "RanksDisagree",
    "check_rule",
    "KeptTensor",
    "kept",
]
