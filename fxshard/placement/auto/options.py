"""What ``plan="auto"`` takes (``AutoOptions``), reports (``AutoReport``) and raises
(``AutoInfeasible``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AutoOptions:
    """Options of ``plan="auto"``.

    ``memory_budget``: bytes per rank for parameters and buffers, plus (training) their gradients
    and ``optimizer_states`` copies (Adam: 2), plus (``activations=True``, training) the forward
    values the backward reads.  ``compute``: add modelled compute time to the objective (without
    it, replicating everything costs nothing).  ``share_layers``: identical repeated layers take one
    decision.  ``follow``: an op with one tensor input takes its input's placement as it is where
    its rule allows (no decision of its own; off: every op is a decision, slower, rarely cheaper).
    ``time_budget_s`` (default 60): the time plan="auto" may take from the captured graph to
    the chosen plan (building the problem, every LP relaxation, branch and bound and
    per-mesh-dim step together); when it runs out, the best plan known so far is returned
    (``AutoReport.stopped`` says so, ``ilp_gap`` gives its proven gap), never an exception.
    Building the problem (legal states, pairwise costs: ``AutoReport.times``) is not
    interrupted, and the first LP relaxation gets at least ``ilp.LP_FLOOR_S`` (10 s) even when
    the budget is spent (its rounding is the plan; without it the plan would be each decision's
    cheapest state on its own terms, tens of times costlier): where the build alone outlasts the
    budget, the solve keeps the rounded relaxation of its first step, without further search.
    ``time_limit_s``: its former name (deprecated).  ``mip_gap``: the
    relative gap at which it stops (the plan is then within that fraction of the modelled
    optimum).  ``decompose``: solve per mesh dim (None, the default: on meshes of three or more
    dims): one solve per split of the mesh dims into two contiguous groups, over the states that
    place alike within each group, then one mesh dim at a time free while the others keep their
    choice, until no dim improves; the problem never holds the product of per-dim states.
    ``strided``: also offer strided shards where a plain one cannot go on (a reshape that merges
    a sharded dim into an outer one: heads merged into the batch before an eager attention's
    ``bmm``), and the states of every op that reads them: how ``plan="auto"`` finds Megatron
    attention in a model with eager attention (a transformers Llama with
    ``attn_implementation="eager"`` on a 1-D mesh under a memory budget: 0.91x the hand plan's
    modelled cost, 1.41x without).  Off by default: it costs 3-6x the planning time on a 1-D
    mesh (a torchtitan-style 8B: 1.0 -> 5.5 s) and does not finish in minutes on a 2-D one."""

    memory_budget: float | None = None
    optimizer_states: int = 2
    activations: bool = False
    compute: bool = True
    share_layers: bool = True
    follow: bool = True
    time_budget_s: float = 60.0
    mip_gap: float = 5e-3
    decompose: bool | None = None
    time_limit_s: float | None = None  # deprecated: time_budget_s
    strided: bool = False

    def __post_init__(self):
        if self.time_limit_s is not None:
            warnings.warn(
                "AutoOptions(time_limit_s=...) is now AutoOptions(time_budget_s=...)",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "time_budget_s", float(self.time_limit_s))
            object.__setattr__(self, "time_limit_s", None)
        if not self.time_budget_s >= 0:
            raise ValueError(f"AutoOptions: time_budget_s must be >= 0, got {self.time_budget_s}")


@dataclass
class AutoReport:
    """What the solver did (``captured.auto``): sizes and times, for the benchmark and explain."""

    nodes: int = 0
    variables: int = 0
    shared_layers: int = 0
    eliminated: int = 0
    followed: int = 0
    ilp_variables: int = 0
    ilp_columns: int = 0
    objective_us: float = 0.0
    memory_bytes: float = 0.0
    min_memory_bytes: float = 0.0
    pruned_states: int = 0  # dominated states dropped before the ILP
    ilp_gap: float = 0.0  # proven relative gap of the plan to the optimum of the cross-edge program
    ilp_rounded: bool = False  # the LP relaxation, rounded and improved, was within mip_gap
    stopped: str = ""  # why the solver stopped before proving its plan (the time budget), or ""
    kept_start: bool = False  # the plan solved around (search="global") was cheaper: kept
    decomposed: str = ""  # the per-mesh-dim steps (meshes of 3+ dims), or ""
    times: dict = field(default_factory=dict)

    def __str__(self) -> str:
        t = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.times.items())
        return (
            f"auto: {self.nodes} nodes -> {self.variables} decisions ({self.shared_layers} layers "
            "shared, "
            f"{self.followed} ops follow their input), "
            f"{self.eliminated} solved by DP, {self.ilp_variables} by ILP ({self.pruned_states} "
            "dominated "
            f"states dropped, {self.ilp_columns} columns, "
            f"{'LP rounded' if self.ilp_rounded else 'branch and bound'}, gap {self.ilp_gap:.2%}"
            f"{f', stopped: {self.stopped}' if self.stopped else ''}"
            f"{', the starting plan kept' if self.kept_start else ''}"
            f"{f'; by mesh dim: {self.decomposed}' if self.decomposed else ''}); "
            f"objective {self.objective_us:.1f} us, memory {self.memory_bytes / 2**20:.1f} MiB per "
            f"rank; {t}"
        )


class AutoInfeasible(ValueError):
    """The memory budget (or a fixed placement) admits no plan."""


def size_text(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"
