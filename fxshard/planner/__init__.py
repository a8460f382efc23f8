"""Min-cost redistribution planning.

``plan`` (plan types, ``plan_redistribute``), ``problem`` (states, moves, bounds), ``moves`` (the
one move generator, on packed states), ``astar`` (one plan), ``exhaustive`` (costs from a placement
to many), ``execute`` (running a plan with functional collectives).
"""

from .exhaustive import costs_from, pairwise_costs
from .plan import (
    RedistributePlan,
    Step,
    clear_plan_cache,
    plan_between,
    plan_in_program,
    plan_is_even,
    plan_redistribute,
)

__all__ = [
    "Step",
    "RedistributePlan",
    "plan_redistribute",
    "plan_between",
    "plan_in_program",
    "plan_is_even",
    "costs_from",
    "pairwise_costs",
    "clear_plan_cache",
]
