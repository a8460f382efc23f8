"""The greedy annotator: every node's placement, one node at a time in graph order.

Fixed placements come first: parameters from the plan (replicated otherwise), graph inputs from
explicit ``input_placements`` or the plan's hints (data-parallel mesh dims shard the batch), module
boundaries from the plan.  Every other op takes, among its legal states (``PlacementProblem``), the
one with the least total redistribution cost from its producers' placements (planner costs), one
step of lookahead into a consumer that is a gradient marker; ties go to the state that changes
fewer inputs.  An op without a rule is computed replicated, with a logged warning that names the
op, the node and its source line.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from .._torch import tree_map
from ..core.spec import ShardingSpec
from ..ir import GRAD_TAG, STATE_KINDS, NodeKind, info, tensor_args
from .problem import PlacementProblem, _val, shape_key


def state_placement(problem: PlacementProblem, fqn: str, val: torch.Tensor) -> tuple:
    """(spec, provenance) of a parameter / buffer: the plan's placement on the plan dim,
    replicated otherwise.  A placement that does not divide the shape is kept, unevenly sharded
    in torch.chunk's layout as DTensor shards it."""
    opts = problem.state_options(fqn, val)
    return opts.requested, opts.provenance


class Greedy:
    """Annotates one graph (``annotate``); decisions are memoised across identical layers."""

    def __init__(self, problem: PlacementProblem):
        self.p = problem
        self._decisions: dict = {}

    def placeholder(self, node: fx.Node) -> None:
        rec = info(node)
        val = node.meta["val"]
        if rec.kind in STATE_KINDS:
            rec.spec, rec.provenance = state_placement(self.p, rec.fqn, val)
            return
        opts = self.p.placeholder_options(node)
        rec.spec, rec.provenance = opts.requested, opts.provenance

    def boundary(self, node: fx.Node) -> None:
        rec = info(node)
        src = info(node.args[0]).spec
        if rec.tag.startswith(GRAD_TAG):
            # the complete gradient of a forward value, placed like the value (Partial ->
            # Replicate): partial gradients meeting at one value are summed before this one
            # reduction
            want = self.p.gradient_target(node)
            if want is None:
                rec.spec, rec.provenance = src, "gradient (passthrough)"
            else:
                rec.spec, rec.provenance = (
                    want,
                    f"gradient of {rec.tag[len(GRAD_TAG) :]}: placed like it",
                )
            rec.input_specs = (rec.spec,)
            return
        rec.module = rec.tag.split(":")[0]
        want = self.p.boundary_requirement(node)
        if want is None:
            rec.spec, rec.provenance = src, "passthrough"
        else:
            pl = list(src.placements)
            pl[self.p.cons.dim] = want[0]
            spec = self.p.spec(pl, node.meta["val"], what=f"{want[1]} ({rec.tag})")
            rec.spec, rec.provenance = spec, f"{want[1]} ({rec.tag.split(':', 1)[1]})"
        rec.input_specs = (rec.spec,)

    def getitem(self, node: fx.Node) -> None:
        rec = info(node)
        parent = info(node.args[0]).spec
        rec.spec = parent[node.args[1]] if isinstance(parent, tuple) else parent
        rec.provenance = "getitem"

    def op(self, node: fx.Node) -> None:
        rec = info(node)
        cur = [info(a).spec for a in tensor_args(node)]
        # one step of lookahead: a consumer that is a gradient marker will ask for its target
        targets = tuple(t for t in (self.p.gradient_target(u) for u in node.users) if t is not None)
        # Repeated layers ask the same question: same op, shapes, arguments and input placements.
        args = tree_map(_val, tuple(node.args))
        kwargs = tree_map(_val, dict(node.kwargs))
        key = (node.target, shape_key(args), shape_key(kwargs), tuple(cur), targets)
        hit = self._decisions.get(key)
        if hit is None:
            hit = self._decisions[key] = self._decide(node, cur, targets)
        rec.input_specs, rec.spec, rec.provenance, why = hit
        if why:
            self.p.warn_fallback(node, why, cur)

    def _decide(self, node: fx.Node, cur: list, targets: tuple) -> tuple:
        """(input specs, output spec(s), provenance, fallback reason) of the cheapest legal
        state."""
        legal = self.p.legal_states(node, cur)
        multi = isinstance(node.meta.get("val"), (tuple, list))
        if legal.source != "rule":
            specs, out_specs = legal.states[0]
            prov = (
                "factory: replicated"
                if legal.source == "factory"
                else "fallback: replicated (no rule)"
            )
            return specs, out_specs if multi else out_specs[0], prov, legal.why
        best = None
        for specs, out_specs in legal.states:
            c = sum(self.p.cost(a, b) for a, b in zip(cur, specs))
            if targets and out_specs and out_specs[0] is not None:
                c += sum(
                    self.p.cost(out_specs[0], t) for t in targets if t.shape == out_specs[0].shape
                )
            changed = sum(
                a.placements != b.placements or a.levels != b.levels for a, b in zip(cur, specs)
            )
            key = (round(c, 9), changed)
            if best is None or key < best[0]:
                best = (key, specs, out_specs)
        (cost, _), specs, out_specs = best
        prov = "rule" if cost == 0 else f"rule (min redistribution {cost:.2f} us)"
        return specs, out_specs if multi else out_specs[0], prov, None

    def output(self, node: fx.Node) -> None:
        rec = info(node)
        specs = []
        for req, o in zip(self.p.output_requirements(node), _flat(node)):
            if req is None:
                specs.append(None)
            elif req.kind == "fixed":
                specs.append(req.spec)
            elif req.kind == "like":
                specs.append(info(req.placeholder).spec)
            else:
                specs.append(self.p.reduced(info(o).spec))
        rec.input_specs = tuple(specs)
        rec.provenance = (
            "output_placements" if self.p.output_placements is not None else "outputs (reduced)"
        )


def _flat(node: fx.Node) -> list:
    outs = node.args[0]
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def annotate(gm: fx.GraphModule, problem: PlacementProblem) -> list[str]:
    """Fill ``node.meta["fxshard"]`` with placements for every node; returns the warnings."""
    g = Greedy(problem)
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder":
            g.placeholder(node)
        elif node.op == "output":
            g.output(node)
        elif rec.kind == NodeKind.BOUNDARY:
            g.boundary(node)
        elif node.target is operator.getitem:
            g.getitem(node)
        elif node.op == "call_function":
            g.op(node)
        else:
            raise NotImplementedError(
                f"fxshard.annotate: node {node.name} ({node.op}) is not supported"
            )
    return problem.warnings


def set_placement(node: fx.Node, placements: Sequence, problem: PlacementProblem) -> None:
    """Force ``node``'s output placements (see ``fxshard.set_placement``): the cheapest legal state
    with exactly that output; its inputs are redistributed as needed."""
    rec = info(node)
    want = ShardingSpec.make(
        problem.mesh,
        placements,
        tuple(node.meta["val"].shape),
        node.meta["val"].dtype,
        what=f"set_placement({node.name})",
    )
    if node.op == "placeholder" or rec.kind == NodeKind.BOUNDARY:
        rec.spec = want
        if rec.kind == NodeKind.BOUNDARY:
            rec.input_specs = (want,)
        rec.provenance = "set_placement"
        return
    cur = [info(a).spec for a in tensor_args(node)]
    legal = problem.legal_states(node, cur)
    best = None
    for specs, outs in legal.states if legal.source == "rule" else ():
        if not outs or outs[0] is None or outs[0].placements != want.placements:
            continue
        c = sum(problem.cost(a, b) for a, b in zip(cur, specs))
        if best is None or c < best[0]:
            best = (c, specs)
    if best is None:
        raise ValueError(
            f"set_placement({node.name}): the sharding rule of {node.target} allows no strategy "
            "with "
            f"output {want}"
        )
    rec.input_specs, rec.spec, rec.provenance = best[1], want, "set_placement"


__all__ = ["annotate", "set_placement", "state_placement", "Greedy"]
