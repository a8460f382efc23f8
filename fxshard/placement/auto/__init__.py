"""auto: choose every node's placement globally (``plan="auto"``), instead of one node at a time.

The choice is a discrete energy minimisation.  Each decision (a variable) is a node's strategy:
an op's (input placements, output placements) from its sharding rule, a parameter's or input's
placements.  Its cost has two parts:

* unary: modelled compute time of the strategy (flops and bytes of the local shards, on the cost
  model's device figures), and the reduction a forward output needs before it is handed back;
* pairwise, per data edge: the planner's cost of redistributing the producer's output placement to
  the placement the consumer's strategy needs (a gradient output to its parameter's placement).

Subject to a per-rank memory budget (parameters, their gradients and optimizer states when
training, optionally saved activations) and to the user's fixed placements (a partial plan,
``input_placements`` / ``output_placements``).

Structure keeps it small and fast:

1. Repeated layers (children of one container with the same type and parameter shapes) are
   marked at capture; the nodes of every layer whose graph is identical to the first one's share
   its variables (edges between layers become edges inside one layer, counted once per layer).
2. Chains and trees are solved exactly by dynamic programming (min-sum variable elimination of
   variables with at most two neighbours: a chain link becomes an edge between its neighbours).
3. What is left (the cross edges: residual streams, attention's q/k/v fan-in, the backward's
   reads of saved activations) is an integer program over the remaining variables, solved by HiGHS
   (``highspy``) with the memory budget as one linear constraint.

The pieces: ``factors`` (variables, states, costs, sharing, write-back), ``dp`` (elimination,
backtracking), ``ilp`` (dominance, the LP and its rounding, local search, branch and bound),
``options`` (options, report, errors).  Deterministic: variables, states and ILP columns are built
in graph order.  The modelled cost of any annotated program (auto or hand-written) comes from
``fxshard.placement.problem.modelled_cost``, so plans compare on equal terms.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import time
from collections.abc import Sequence

import torch
import torch.fx as fx

from ...ir import info, tensor_args
from ..problem import PlacementProblem
from .dp import backtrack, eliminate
from .factors import FactorGraph
from .ilp import dominance, solve_ilp
from .options import AutoInfeasible, AutoOptions, AutoReport, size_text

log = logging.getLogger("fxshard")


def check_budget(fg: FactorGraph, budget: float | None) -> None:
    """Raise ``AutoInfeasible`` when even the most sharded states exceed ``budget``."""
    fg.report.min_memory_bytes = sum(float(v.memory.min()) for v in fg.vars if v.memory is not None)
    if budget is None or fg.report.min_memory_bytes <= budget:
        return
    what = "parameters + gradients + optimizer states" if fg.training else "parameters and buffers"
    if fg.opt.activations and fg.training:
        what += " + saved activations"
    need = fg.report.min_memory_bytes
    raise AutoInfeasible(
        f"memory_budget {size_text(budget)} per rank is too small: the {what} need at least "
        f"{size_text(need)} "
        f"per rank even when sharded as far as mesh {fg.mesh.shape} and the fixed placements allow "
        f"({size_text(need - budget)} over); raise the budget or use a larger mesh"
    )


def objective(fg: FactorGraph, choice: Sequence[int]) -> float:
    total = sum(float(v.unary[choice[i]]) for i, v in enumerate(fg.vars))
    for (u, v), t in fg.factors.items():
        total += float(t[choice[u], choice[v]])
    return total


def _solve_states(
    fg: FactorGraph, keep: list[torch.Tensor] | None = None, report: AutoReport | None = None
) -> list[int]:
    """The best choice over each variable's states ``keep[v]`` (indices into its states; None:
    all of them): chains and trees by DP, the core by the ILP.  Indices into the full states.
    ``report``: where the solve's sizes and times go (``fg.report`` by default)."""
    report = fg.report if report is None else report
    budget = fg.opt.memory_budget
    if keep is None:
        unary = [v.unary.clone() for v in fg.vars]
        factors = {k: t.clone() for k, t in fg.factors.items()}
        mem_of = [v.memory for v in fg.vars]
    else:
        unary = [v.unary[k] for v, k in zip(fg.vars, keep)]
        factors = {(a, b): t[keep[a]][:, keep[b]] for (a, b), t in fg.factors.items()}
        mem_of = [None if v.memory is None else v.memory[k] for v, k in zip(fg.vars, keep)]
    protected = {i for i, m in enumerate(mem_of) if budget is not None and m is not None}
    t0 = time.perf_counter()
    eliminated, alive, nbrs = eliminate(unary, factors, protected)
    report.eliminated = len(eliminated) - fg.report.followed
    t1 = time.perf_counter()
    core = [i for i in range(len(fg.vars)) if alive[i]]
    choice = [-1] * len(fg.vars)
    if core:
        memory_of = {v: mem_of[v] for v in core if mem_of[v] is not None}
        kept = dominance(core, unary, factors, nbrs, memory_of, budget)
        sub_unary = list(unary)
        memory = {}
        for v in core:
            sub_unary[v] = unary[v][kept[v]]
            if v in memory_of:
                memory[v] = memory_of[v][kept[v]]
        sub_factors = {(u, v): t[kept[u]][:, kept[v]] for (u, v), t in factors.items()}
        report.pruned_states = sum(len(unary[v]) - len(kept[v]) for v in core)
        for v, s in solve_ilp(
            core, sub_unary, sub_factors, memory, budget, fg.opt, report, fg.deadline
        ).items():
            choice[v] = int(kept[v][s])
    t2 = time.perf_counter()
    backtrack(eliminated, unary, choice)
    times = report.times
    times["dp"] = times.get("dp", 0.0) + (t1 - t0) + (time.perf_counter() - t2)
    times["ilp"] = times.get("ilp", 0.0) + t2 - t1
    if keep is not None:
        choice = [int(k[c]) for k, c in zip(keep, choice)]
    return choice


def _merge_report(into: AutoReport, rep: AutoReport) -> None:
    """A solve's report into the whole one, as if the solve had written it: its sizes, its gap;
    a stop is kept; times add up."""
    for f in ("eliminated", "pruned_states", "ilp_variables", "ilp_columns", "ilp_gap"):
        setattr(into, f, getattr(rep, f))
    into.ilp_rounded = rep.ilp_rounded
    into.stopped = into.stopped or rep.stopped
    for k, t in rep.times.items():
        into.times[k] = into.times.get(k, 0.0) + t


def _placement_ids(fg: FactorGraph) -> torch.Tensor:
    """Per variable: a (states x mesh dims) tensor, the id of what each state places on each mesh
    dim (the placements of all its inputs and outputs there, interned: equal ids, equal
    placements, on any two mesh dims)."""
    ids: dict = {}
    plc: dict = {}  # placement -> small int
    per_spec: dict = {-1: None}  # spec id -> its placements as small ints, per mesh dim
    out = []
    nd = fg.mesh.ndim
    for var in fg.vars:
        rows = []
        for ins, outs in var.states:
            specs = []
            for i in (*ins, *outs):
                t = per_spec.get(i, False)
                if t is False:
                    t = per_spec[i] = tuple(
                        plc.setdefault(p, len(plc)) for p in fg.specs[i].placements
                    )
                specs.append(t)
            rows.append(
                [
                    ids.setdefault(tuple(-1 if t is None else t[m] for t in specs), len(ids))
                    for m in range(nd)
                ]
            )
        out.append(torch.tensor(rows, dtype=torch.long).reshape(len(var.states), nd))
    return out


def _tied(pid: torch.Tensor, groups: Sequence[Sequence[int]]) -> torch.Tensor:
    """Indices of the states that place the same on every mesh dim of each group."""
    ok = torch.ones(pid.shape[0], dtype=torch.bool)
    for g in groups:
        for m in g[1:]:
            ok &= pid[:, m] == pid[:, g[0]]
    return torch.nonzero(ok).flatten()


def _solve_decomposed(fg: FactorGraph) -> list[int]:
    """A mesh of three or more dims, solved as a product of per-dim choices: every plan people
    write there (the batch on dp and cp, Megatron on tp) places alike on groups of mesh dims.
    First one solve per split of the mesh dims into two contiguous groups, each over the states
    that place alike within a group (as many as a 2-D mesh's); then, from the best of those,
    coordinate descent: one mesh dim at a time is free, the others keep their choice, until no
    dim improves.  Each step is an exact solve over a set containing the current plan, so the
    objective never rises; the problem solved is never the full product of per-dim states (the
    pairwise tables of a 4x4x4 mesh are 10^7 columns: measured 135 s, the LP unfinished)."""
    pids = _placement_ids(fg)
    nd = fg.mesh.ndim
    single = [torch.zeros(1, dtype=torch.long) for _ in fg.vars]
    followers = {i for i, v in enumerate(fg.vars) if v.derived is not None or len(v.states) < 2}
    deadline = fg.deadline
    best, best_cost, steps, best_groups = None, math.inf, [], None
    splits = [[list(range(cut)), list(range(cut, nd))] for cut in range(1, nd)]

    def tied_solve(groups, report):
        keep = []
        for i, pid in enumerate(pids):
            if i in followers:
                keep.append(single[i])
                continue
            k = _tied(pid, groups)
            keep.append(k if len(k) else torch.arange(len(pid)))
        return _solve_states(fg, keep, report)

    # the tied solves are independent: side by side where there are cores for them (HiGHS runs
    # without the GIL), each into its own report, merged in order as if run one after the other
    spent = time.perf_counter() >= deadline  # the first only: its LP relaxation gives a plan
    if spent:
        splits = splits[:1]
    reports = [dataclasses.replace(fg.report, times={}) for _ in splits]
    workers = min(len(splits), os.cpu_count() or 1)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            choices = list(pool.map(tied_solve, splits, reports))
    else:
        choices = [tied_solve(g, r) for g, r in zip(splits, reports)]
    for groups, choice, rep in zip(splits, choices, reports):
        _merge_report(fg.report, rep)
        cost = objective(fg, choice)
        steps.append(f"tied {'|'.join(''.join(map(str, g)) for g in groups)} {cost:.4g} us")
        if cost < best_cost:
            best, best_cost, best_groups = choice, cost, groups
    if spent and nd > 2:
        steps.append("time budget spent")
    # coordinate descent, until nd steps in a row find nothing better: a step over a set the last
    # exact solve covered is skipped (freeing a dim that is a group of its own in the tied solve
    # the plan came from: those states were all in it)
    done = {m for g in best_groups or () if len(g) == 1 for m in g}
    d, rounds = nd - 1, 0
    while len(done) < nd and rounds < 4 * nd and time.perf_counter() < deadline:
        d, rounds = (d + 1) % nd, rounds + 1
        if d in done:
            continue
        done.add(d)
        others = [m for m in range(nd) if m != d]
        keep, free = [], False
        for i, pid in enumerate(pids):
            if i in followers:
                keep.append(torch.tensor([best[i] if len(pid) > best[i] >= 0 else 0]))
                continue
            k = torch.nonzero((pid[:, others] == pid[best[i], others]).all(dim=1)).flatten()
            free = free or len(k) > 1
            keep.append(k)
        if not free:  # nothing to choose: the current plan
            continue
        choice = _solve_states(fg, keep)
        cost = objective(fg, choice)
        if cost < best_cost - 1e-9 * max(abs(best_cost), 1.0):
            best, best_cost, done = choice, cost, {d}
            steps.append(f"dim {d} {cost:.4g} us")
    fg.report.decomposed = "; ".join(steps)
    return best


def solve(fg: FactorGraph) -> list[int]:
    """The chosen state of every variable: chains and trees by DP, the core by the ILP; on a mesh
    of three or more dims, by per-dim decomposition (``_solve_decomposed``)."""
    budget = fg.opt.memory_budget
    check_budget(fg, budget)
    choice = _solve_decomposed(fg) if fg.decompose else _solve_states(fg)
    fg.report.objective_us = objective(fg, choice)
    start = fg.anchor_choice()
    if start is not None and _cheaper(fg, start, fg.report.objective_us, budget):
        # never worse than the plan the search started from (a solver stopped by its time limit)
        choice, fg.report.kept_start = start, True
        fg.report.objective_us = objective(fg, choice)
    fg.report.memory_bytes = sum(
        float(v.memory[choice[i]]) for i, v in enumerate(fg.vars) if v.memory is not None
    )
    if not math.isfinite(fg.report.objective_us):
        raise AutoInfeasible(
            "plan='auto' found no plan with finite cost: a fixed placement cannot be reached "
            "by any redistribution (see the warnings)"
        )
    return choice


def _cheaper(fg: FactorGraph, choice: list[int], than: float, budget: float | None) -> bool:
    cost = objective(fg, choice)
    if not math.isfinite(cost) or cost >= than - 1e-9 * max(abs(than), 1.0):
        return False
    used = sum(float(v.memory[choice[i]]) for i, v in enumerate(fg.vars) if v.memory is not None)
    return budget is None or used <= budget


def annotate_auto(
    gm: fx.GraphModule,
    problem: PlacementProblem,
    *,
    options: AutoOptions | None = None,
    blocks: Sequence = (),
    training: bool = False,
    anchored: bool = False,
) -> tuple[list[str], AutoReport]:
    """``annotate`` by one global solve: every node's placement (``plan="auto"``); or, with
    ``anchored``, improving on the annotation the graph carries (greedy's): its placeholders kept,
    every other node choosing among that annotation's state and the states its producers feed
    as they are (the ``search="global"`` of a fixed plan)."""
    t0 = time.perf_counter()
    options = options or AutoOptions()
    fg = FactorGraph(
        gm,
        problem,
        options,
        blocks=blocks,
        training=training,
        anchored=anchored,
    )
    fg.build()
    choice = solve(fg)
    t1 = time.perf_counter()
    fg.apply(choice)
    for node, why in () if anchored else fg.fallbacks:  # (the anchor's annotation warned)
        # an op with no rule, where its inputs had to be gathered
        problem.warn_fallback(node, why, [info(a).spec for a in tensor_args(node)])
    fg.report.times["apply"] = time.perf_counter() - t1
    fg.report.times["total"] = time.perf_counter() - t0
    log.info("fxshard: %s", fg.report)
    return problem.warnings, fg.report


__all__ = ["AutoOptions", "AutoReport", "AutoInfeasible", "annotate_auto", "FactorGraph", "solve"]
