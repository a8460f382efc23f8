"""The factor graph of ``plan="auto"``: one variable per decision, costs on states and edges.

Each decision (a variable) is a node's strategy, from the placement problem's legal states: an
op's (input placements, output placements), a parameter's or input's placements.  Its costs:

* unary: modelled compute time of the strategy (flops and bytes of the local shards, on the cost
  model's device figures), and the reduction a forward output needs before it is handed back;
* pairwise, per data edge: the planner's cost of redistributing the producer's output placement to
  the placement the consumer's strategy needs (a gradient output to its parameter's placement).

Repeated layers whose graphs are identical share their variables (``sharing``); an op with one
tensor input follows its input where its rule allows (no decision of its own); a value read by
several consumers gets a hub variable ("the placement it is redistributed to", costed once).
Memory per state (parameters, their gradients and optimizer states, saved activations) feeds the
budget constraint.  ``apply`` writes a solved choice back into the graph's records.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..._torch import is_strided_shard
from ...core.spec import ShardingSpec, is_even, placements_str
from ...ir import BOUNDARY, BUFFER, CONSTANT, PARAM, NodeKind, flat_outputs, info, tensor_args
from ...planner import costs_from, pairwise_costs, plan_in_program
from ..problem import (
    _RESHAPE_OPS,
    PlacementProblem,
    _strided_spec,
    _val,
    compute_us_states,
    local_bytes,
    tied,
)
from .options import AutoInfeasible, AutoOptions, AutoReport
from .sharing import shared_nodes

INF = float("inf")


def _has_strided(state) -> bool:
    return any(_strided_spec(s) for side in state for s in side)


class _Var:
    __slots__ = ("node", "states", "unary", "memory", "fixed", "nodes", "derived", "anchor")

    def __init__(self, node, states):
        self.node = node
        self.states = states  # [(input spec ids, output spec ids)]
        self.unary = torch.zeros(len(states), dtype=torch.float64)
        self.memory = None
        self.fixed = False  # a single state given by the user
        self.nodes = [node]  # every node taking this decision
        # (root variable, this var's state per root state): it follows its input
        self.derived = None
        self.anchor = None  # anchored: the index of the annotation's own state


class FactorGraph:
    """Variables (one per decision), their states' unary costs and memory, and pairwise factors
    (redistribution costs on data edges), built from the placement problem of one graph."""

    def __init__(
        self,
        gm: fx.GraphModule,
        problem: PlacementProblem,
        options: AutoOptions,
        *,
        blocks: Sequence = (),
        training: bool = False,
        anchored: bool = False,
    ):
        self.gm, self.p, self.opt = gm, problem, options
        # the time budget covers the whole solve, this build included (time.perf_counter's clock)
        self.deadline = time.perf_counter() + options.time_budget_s
        # the graph carries an annotation (greedy's): placeholders keep theirs, and every other
        # node's states are that annotation's plus those its producers' states feed as they are
        self.anchored = anchored
        self.mesh, self.cm, self.cons = problem.mesh, problem.cm, problem.cons
        self.fuse = problem.multi_dim
        self.training = training
        self.blocks = list(blocks)
        self.specs: list[ShardingSpec] = []
        self.spec_id: dict = {}
        self._cost: dict = {}
        self._by_shape: dict[tuple, list[int]] = {}  # (shape, dtype) -> spec ids
        self._searched: set[int] = set()  # spec ids whose costs to their group are known
        self._resolved: dict[tuple, tuple] = {}  # resolve() per (variable, output index, follows)
        self._tables: dict[
            tuple, tuple[dict, torch.Tensor]
        ] = {}  # (shape, dtype) -> (spec id -> row, costs)
        self.vars: list[_Var] = []
        self.fallbacks: list[tuple[fx.Node, str]] = []  # ops with no rule (warned after solve)
        self.var_of: dict[fx.Node, int] = {}
        self.factors: dict[tuple[int, int], torch.Tensor] = {}
        self.report = AutoReport(nodes=len(gm.graph.nodes))
        # a mesh solved per dim (``auto._solve_decomposed``) only ever picks states that place
        # alike on the groups of one split of its dims into two (then one dim at a time among
        # those): the rules enumerate only those (a 4x4x4 mesh's states are the cube of per-dim
        # choices, these about twice a 2-D mesh's)
        nd = self.mesh.ndim
        self.decompose = (
            bool(options.decompose) and nd > 1
            if options.decompose is not None
            else nd >= 3 and not anchored
        )
        self.ties = (
            tuple((tuple(range(c)), tuple(range(c, nd))) for c in range(1, nd))
            if self.decompose and nd >= 3 and not anchored
            else None
        )

    # ---- specs and costs ----
    def sid(self, spec: ShardingSpec) -> int:
        i = self.spec_id.get(spec)
        if i is None:
            i = self.spec_id[spec] = len(self.specs)
            self.specs.append(spec)
            self._by_shape.setdefault((spec.shape, spec.dtype), []).append(i)
        return i

    def cost(self, a: int, b: int) -> float:
        if a == b:
            return 0.0
        # an output without placement (never read: see leaves_used_output_unplaced)
        if a < 0 or b < 0:
            return INF
        c = self._cost.get((a, b))
        if c is None:
            if a not in self._searched:
                self._costs_from(a)
                c = self._cost.get((a, b))
            if c is None:
                c = self._tabled(a, b)
            if c is None:
                c = self._cost[(a, b)] = self._plan_cost(self.specs[a], self.specs[b])
        return c

    def _tabled(self, a: int, b: int) -> float | None:
        sa = self.specs[a]
        hit = self._tables.get((sa.shape, sa.dtype))
        if hit is not None and a in hit[0] and b in hit[0]:
            return float(hit[1][hit[0][a], hit[0][b]])
        return None

    def _plan_cost(self, sa: ShardingSpec, sb: ShardingSpec) -> float:
        if sa.levels == sb.levels and sa.placements == sb.placements:
            return 0.0
        try:
            return plan_in_program(sa, sb, self.cm, fuse=self.fuse).cost
        except (ValueError, NotImplementedError):
            return INF

    def _costs_from(self, a: int):
        """Costs from spec ``a`` to every spec of the same value shape so far (the solver asks for
        nearly all pairs among a value's placements): the whole group's table at once the first
        time (the planner's state graph, closed under min-plus), one search from ``a`` for a spec
        registered after that."""
        sa = self.specs[a]
        group = self._by_shape.get((sa.shape, sa.dtype), [])
        try:
            if not any(b in self._searched for b in group):
                specs = [self.specs[b] for b in group]
                # even intermediate states where every placement of the value is even (what the
                # program's plans keep to); a value with uneven placements is planned freely
                table = pairwise_costs(specs, self.cm, even_only=_all_even(specs), fuse=self.fuse)
                self._searched.update(group)
                self._tables[(sa.shape, sa.dtype)] = ({b: i for i, b in enumerate(group)}, table)
                return
            self._searched.add(a)
            others = [b for b in group if b != a]
            dsts = [self.specs[b] for b in others]
            costs = costs_from(sa, dsts, self.cm, even_only=_all_even([sa, *dsts]), fuse=self.fuse)
        except (ValueError, NotImplementedError):
            self._searched.add(a)
            return  # pair by pair (unreachable targets cost INF there)
        self._cost.update(((a, b), c) for b, c in zip(others, costs))

    # ---- variables ----
    def _new_var(self, node, states) -> int:
        v = _Var(node, states)
        self.vars.append(v)
        self.var_of[node] = len(self.vars) - 1
        return len(self.vars) - 1

    def producer(self, a: fx.Node) -> tuple[fx.Node, int]:
        """(node whose variable decides ``a``'s placement, output index): through getitem,
        transparent boundaries and (while the graph is being built) shared layers."""
        idx = 0
        while a not in self.var_of:
            if a in self.share:
                a = self.share[a]
            elif a.op == "call_function" and a.target is operator.getitem:
                a, idx = a.args[0], a.args[1]
            elif a in self.transparent:
                a = a.args[0]
            else:
                raise AssertionError(f"fxshard auto: no decision for {a.name}")
        return a, idx

    def resolve(self, a: fx.Node) -> tuple[int, tuple]:
        """(deciding variable, ``a``'s placement (spec id) per state of that variable)."""
        p, idx = self.producer(a)
        v = self.var_of[p]
        var = self.vars[v]
        key = (
            v,
            idx,
            var.derived is not None,
        )  # a variable's states are fixed; it may come to follow once
        hit = self._resolved.get(key)
        if hit is None:
            if var.derived is not None:
                u, maps = var.derived
                hit = u, tuple(var.states[m][1][idx] for m in maps)
            else:
                hit = v, tuple(st[1][idx] for st in var.states)
            self._resolved[key] = hit
        return hit

    def _follow(self, v: int, comp: dict):
        """Make ``v`` follow its only tensor input where it can: for every placement the input may
        have, a strategy that takes it as it is (no redistribution into the op; Alpa's "follow").
        Most ops (views, elementwise with constants, activations) then cost no decision at all."""
        if v in self._followed:
            return
        self._followed.add(v)
        var = self.vars[v]
        n = var.node
        if (
            n is None
            or n.op != "call_function"
            or info(n).kind == NodeKind.BOUNDARY
            or len(var.states) < 2
        ):
            return
        firsts = []
        for x in var.nodes:
            ta = tensor_args(x)
            if len(ta) != 1:
                return
            firsts.append(ta[0])
        self._follow(self.var_of[self.producer(firsts[0])[0]], comp)
        u, ids = self.resolve(firsts[0])
        if any(self.resolve(a) != (u, ids) for a in firsts[1:]) or u == v:
            return
        cost = comp.get(v)
        by_in: dict[int, int] = {}
        for i, st in enumerate(var.states):
            j = by_in.get(st[0][0])
            if j is None or (cost is not None and float(cost[i]) < float(cost[j])):
                by_in[st[0][0]] = i
        maps = []
        for o in ids:
            if o not in by_in:
                return
            maps.append(by_in[o])
        var.derived = (u, maps)

    def _placeholder_states(self, node: fx.Node) -> list[ShardingSpec]:
        """The placeholder's options: what is asked for where nothing is free, else every even
        placement that keeps what is fixed (the plan's placement on the plan dim)."""
        if self.anchored:
            if self.p.kept_state(node):  # state kept sharded: the solve places it
                anchor = info(node).spec
                return [anchor, *(s for s in self.p.even_options(node.meta["val"]) if s != anchor)]
            return [info(node).spec]
        opts = self.p.placeholder_options(node)
        if not opts.free:
            return [opts.requested]
        val = node.meta["val"]
        fixed = {
            m: opts.requested.placements[m] for m in range(self.mesh.ndim) if m not in opts.free
        }
        specs = self._tied_specs(self.p.even_options(val, fixed))
        if not specs:
            rec = info(node)
            want = opts.requested.placements[self.cons.dim]
            raise AutoInfeasible(
                f"{opts.provenance} asks for {want} on {rec.fqn} of shape {tuple(val.shape)}, "
                f"which mesh {self.mesh.shape} does not divide evenly"
            )
        return specs

    def _tied_specs(self, specs: list[ShardingSpec]) -> list[ShardingSpec]:
        """``specs`` that place alike on the groups of one of ``self.ties`` (all without ties, or
        where none does)."""
        if self.ties is None:
            return specs
        return [s for s in specs if tied(((s,), ()), self.ties)] or specs

    def _op_states(self, node: fx.Node) -> tuple[list, str]:
        targs = tensor_args(node)
        # rules enumerate every plain placement whatever ``cur`` is; anchored, ``cur`` is the
        # anchor's (its strided inputs are seeds too, and the rule's answer is cached from it)
        if self.anchored:
            cur = [info(a).spec for a in targs]
        else:
            cur = [self.p.replicated(_val(a)) for a in targs]
        legal = (
            self.p.legal_states(node, cur)
            if self.anchored
            else self.p.legal_states(node, cur, self.ties, plain=True)
        )
        if legal.source == "fallback":
            self.fallbacks.append((node, legal.why))  # warned after the solve, where it costs
            return legal.states, "fallback: replicated (no rule)"
        if legal.source == "rule" and not self.anchored:
            # plan="auto" leaves strided shards out by default: every view that merges dims would
            # offer them, and the state space grows ~30x (a 2-layer LLaMA-3-8B on 8x8: 4 s ->
            # 420 s).  AutoOptions(strided=True) offers them where they are needed: a reshape's
            # strided states for plain inputs no plain state takes (heads merged into the batch
            # before an eager attention's bmm), and every op's states for the strided inputs its
            # producers can give (asked for those inputs only)
            plain = [st for st in legal.states if not _has_strided(st)]
            if not plain:
                return legal.states, "auto"
            if not self.opt.strided:
                return plain, "auto"
            return plain + self._strided_states(node, targs, cur, plain), "auto"
        if legal.source == "rule":
            states, seen = list(legal.states), set(legal.states)
            for alt in self._strided_inputs(targs, cur):
                more = self.p.legal_states(node, alt)
                if more.source == "rule":
                    states += [st for st in more.states if st not in seen]
                    seen.update(more.states)
            return states, "auto"
        return legal.states, "factory: replicated" if legal.source == "factory" else "auto"

    def _available(self, a: fx.Node) -> set[int]:
        """Spec ids ``a`` can have: its deciding variable's output states (none: undecided)."""
        try:
            p, idx = self.producer(a)
        except AssertionError:
            return set()
        return {st[1][idx] for st in self.vars[self.var_of[p]].states if len(st[1]) > idx}

    def _anchor_index(self, var: _Var) -> int | None:
        """The index among ``var``'s states of the annotation it was built around (anchored)."""
        rec = info(var.node)
        if rec.spec is None:
            return None
        outs = rec.spec if isinstance(rec.spec, tuple) else (rec.spec,)
        want_out = tuple(-1 if s is None else self.spec_id.get(s) for s in outs)
        want_in = None
        if var.node.op != "placeholder" and rec.kind != NodeKind.BOUNDARY:
            if rec.input_specs is None:
                return None
            want_in = tuple(self.spec_id.get(s) for s in rec.input_specs)
        for i, (ins, o) in enumerate(var.states):
            if tuple(o) == want_out and (want_in is None or tuple(ins) == want_in):
                return i
        return None

    def anchor_choice(self) -> list[int] | None:
        """Every variable's anchor state (the plan a ``search="global"`` solve starts from), or
        None where some variable has none (``plan="auto"``; a variable that follows another).
        A hub (a value read by several consumers) takes its cheapest placement given the
        others' anchors, as the redistribute pass would."""
        if not self.anchored or any(v.derived is not None for v in self.vars):
            return None
        choice = [v.anchor for v in self.vars]
        if any(c is None for v, c in zip(self.vars, choice) if v.node is not None):
            return None
        hubs = {h: v.unary.clone() for h, v in enumerate(self.vars) if v.node is None}
        for (a, b), t in self.factors.items():
            if b in hubs and a not in hubs:
                hubs[b] += t[choice[a], :]
            elif a in hubs and b not in hubs:
                hubs[a] += t[:, choice[b]]
        for h, cost in hubs.items():
            choice[h] = int(torch.argmin(cost))
        return choice

    def _near_anchor(self, n: fx.Node, raw: list) -> list:
        """The states of an anchored search: the anchor's own, and every state whose inputs its
        producers can hand over as they are, but for one broadcast operand of a pointwise op
        (which is redistributed: a small reduction brought to the shards, ``exp(x) * sum(g)`` of a
        softmax's backward, rather than the shards gathered to it).  The anchor's plan is then one
        of the plans searched, and the solve can only improve on it; the states stay as few as
        the placements reachable from the fixed ones."""
        rec = info(n)
        mine = None
        if rec.input_specs is not None and rec.spec is not None:
            outs = rec.spec if isinstance(rec.spec, tuple) else (rec.spec,)
            mine = (tuple(rec.input_specs), tuple(outs))
        targs = tensor_args(n)
        avail = [self._available(a) for a in targs]
        movable = _broadcast_operands(n, targs)

        def near(st) -> bool:
            moved = [
                i for i, (s, av) in enumerate(zip(st[0], avail)) if self.spec_id.get(s) not in av
            ]
            return not moved or (len(moved) == 1 and moved[0] in movable)

        keep = [
            st
            for st in raw
            if (mine is not None and (tuple(st[0]), tuple(st[1])) == mine) or near(st)
        ]
        if mine is not None and mine not in keep:
            keep.append(mine)
        return keep or raw

    def _strided_states(self, node, targs, cur, plain) -> list:
        """The strided states ``plan="auto"`` adds to a node's plain ones (see ``_op_states``)."""
        extra, seen = [], set(plain)
        if node.target in _RESHAPE_OPS:
            takes = {st[0] for st in plain}
            for st in self.p.legal_states(node, cur, self.ties).states:
                if st not in seen and not any(map(_strided_spec, st[0])) and st[0] not in takes:
                    seen.add(st)
                    extra.append(st)
        for alt in self._strided_inputs(targs, cur):
            for st in self.p.legal_states(node, alt, self.ties, given=True).states:
                if st not in seen and any(map(_strided_spec, st[0])):
                    seen.add(st)
                    extra.append(st)
        return extra

    def _strided_inputs(self, targs, cur) -> list[list]:
        """Input placements to ask the op's rule about beyond replicated ones: rules enumerate
        their strategies from the inputs' current placements, and a strided shard (a view that
        merges a sharded dim into an unsharded outer one: heads into batch * heads before an eager
        attention bmm) is only offered to an op whose input has it.  One alternative per distinct
        strided placement the producers can give: every input that can have it takes it."""
        options = []
        for a in targs:
            ids = self._available(a) if isinstance(a, fx.Node) else set()
            options.append(
                {
                    self.specs[i].placements: self.specs[i]
                    for i in ids
                    if i >= 0 and any(is_strided_shard(p) for p in self.specs[i].placements)
                }
            )
        alts = []
        for plc in dict.fromkeys(k for opt in options for k in opt):
            alts.append([opt.get(plc, c) for opt, c in zip(options, cur)])
        return alts

    def build(self):
        t0 = time.perf_counter()
        gm = self.gm
        share: dict[fx.Node, fx.Node] = {}  # which nodes share a decision
        if self.opt.share_layers and self.blocks:
            share, self.report.shared_layers = shared_nodes(gm, self.blocks)
        self.provenance: dict[int, str] = {}
        transparent, shared = set(), []
        self.share, self.transparent = share, transparent  # filled in as the graph is read
        self._order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for n in gm.graph.nodes:
            rec = info(n)
            if n.op == "output" or (n.op == "call_function" and n.target is operator.getitem):
                continue
            if rec.kind == NodeKind.BOUNDARY and self.p.boundary_requirement(n) is None:
                transparent.add(n)
                continue
            if n in share:
                shared.append(n)
                continue
            if n.op == "placeholder":
                specs = self._placeholder_states(n)
                states = [((), (self.sid(s),)) for s in specs]
                v = self._new_var(n, states)
                self.vars[v].fixed = len(states) == 1
                if self.anchored:  # what placed it (the plan entry, the data-parallel default)
                    self.provenance[v] = info(n).provenance
                else:
                    self.provenance[v] = "auto" if len(states) > 1 else "fixed"
            elif rec.kind == NodeKind.BOUNDARY:
                tag = rec.tag
                want = self.p.boundary_requirement(n)
                opts = self.p.even_options(n.meta["val"], {self.cons.dim: want[0]})
                if not self.anchored:
                    opts = self._tied_specs(opts)
                if not opts:
                    raise AutoInfeasible(
                        f"{want[1]} asks for {want[0]} at {tag}, which does not divide shape "
                        f"{tuple(n.meta['val'].shape)} evenly on mesh {self.mesh.shape}"
                    )
                if self.anchored:
                    avail = self._available(n.args[0])
                    opts = [s for s in opts if s == rec.spec or self.spec_id.get(s) in avail]
                    if rec.spec not in opts:  # the anchor's own (an uneven one is not offered)
                        opts.append(rec.spec)
                v = self._new_var(n, [((self.sid(s),), (self.sid(s),)) for s in opts])
                self.provenance[v] = f"{want[1]} ({tag.split(':', 1)[1]})" + (
                    "" if self.anchored else " + auto"
                )
                rec.module = tag.split(":")[0]
            else:
                raw, prov = self._op_states(n)
                if self.anchored:
                    raw = self._near_anchor(n, raw)
                states = [
                    (
                        tuple(self.sid(s) for s in ins),
                        tuple(-1 if s is None else self.sid(s) for s in outs),
                    )
                    for ins, outs in raw
                ]
                v = self._new_var(n, states)
                self.provenance[v] = prov
        if self.anchored:
            for var in self.vars:
                var.anchor = self._anchor_index(var)
        for (
            n
        ) in shared:  # later layers (and their backward, which runs first) take the first layer's
            v = self.var_of[share[n]]
            self.var_of[n] = v
            self.vars[v].nodes.append(n)
        t1 = time.perf_counter()
        comp = {}
        terms: dict = {}  # spec id -> its local bytes and sharded mesh dims (compute_us_states)
        for var in self.vars:
            n = var.node
            if self.opt.compute and n.op == "call_function" and info(n).kind != NodeKind.BOUNDARY:
                comp[n] = torch.tensor(
                    compute_us_states(n, var.states, self.specs, terms, self.cm),
                    dtype=torch.float64,
                )
        self._followed: set[int] = set()
        if self.opt.follow:
            by_pos = sorted(range(len(self.vars)), key=lambda i: self._order[self.vars[i].node])
            cv = {self.var_of[n]: c for n, c in comp.items()}
            for v in by_pos:
                self._follow(v, cv)
        self.report.followed = sum(v.derived is not None for v in self.vars)
        self.report.variables = len(self.vars) - self.report.followed
        self._costs(comp)
        self.report.times["build"] = t1 - t0
        self.report.times["costs"] = time.perf_counter() - t1

    def _add_pair(self, u: int, v: int, table: torch.Tensor):
        if u == v:
            self.vars[u].unary += table.diagonal()
            return
        if u > v:
            u, v, table = v, u, table.T
        f = self.factors.get((u, v))
        self.factors[(u, v)] = table.clone() if f is None else f + table

    def _table(self, out_ids: list[int], in_ids: list[int]) -> torch.Tensor:
        if out_ids and min(out_ids) >= 0 and out_ids[0] not in self._searched:
            self._costs_from(out_ids[0])  # the value's whole table, computed once
        key = (
            (self.specs[out_ids[0]].shape, self.specs[out_ids[0]].dtype)
            if out_ids and out_ids[0] >= 0
            else None
        )
        hit = self._tables.get(key)
        if (
            hit is not None
            and all(i in hit[0] for i in out_ids)
            and all(i in hit[0] for i in in_ids)
        ):
            pos, t = hit
            long = torch.long
            o, i = torch.tensor(out_ids, dtype=long), torch.tensor(in_ids, dtype=long)
            sub = t[torch.tensor([pos[a] for a in out_ids], dtype=long)][
                :, torch.tensor([pos[b] for b in in_ids], dtype=long)
            ]
            return sub.masked_fill(o[:, None] == i[None, :], 0.0)
        uo = sorted(set(out_ids))
        ui = sorted(set(in_ids))
        m = torch.tensor([[self.cost(a, b) for b in ui] for a in uo], dtype=torch.float64)
        ro = torch.tensor([uo.index(a) for a in out_ids])
        ri = torch.tensor([ui.index(b) for b in in_ids])
        return m[ro][:, ri]

    def _costs(self, comp):
        gm = self.gm
        edges: dict[tuple, int] = {}  # (u, idx, v, j) -> count
        unary_edges: dict[tuple, int] = {}  # (u, idx, required spec id) -> count
        grad_edges: dict[tuple, int] = {}  # (u, idx, param var) -> count
        saved = set()
        uses: dict[fx.Node, list] = {}  # immediate argument -> its (edge key, actual node) uses
        hub_edges: dict[tuple, int] = {}
        self.hub_nodes: dict[int, list[fx.Node]] = {}
        self._output_roles = []
        self._trained: list[fx.Node] = []  # parameters with a gradient output
        for n in gm.graph.nodes:
            if n.op == "placeholder" or n in self.transparent or n.target is operator.getitem:
                continue
            if n.op == "output":
                self._output_edges(n, unary_edges, grad_edges)
                continue
            v = self.var_of[n]
            targs = [n.args[0]] if info(n).kind == NodeKind.BOUNDARY else tensor_args(n)
            for j, a in enumerate(targs):
                p, _ = self.producer(a)
                if (
                    self.opt.activations
                    and self.training
                    and n.meta.get("partitioner_tag") == "is_backward"
                    and p.meta.get("partitioner_tag") == "is_forward"
                    and p.op != "placeholder"
                ):
                    saved.add(a)
                if self.vars[v].derived is not None:
                    continue  # takes its input as it is
                u, ids = self.resolve(a)
                key = (u, ids, v, j)
                edges[key] = edges.get(key, 0) + 1
                uses.setdefault((self.share.get(a, a), u, ids), []).append((key, a))
        for var in self.vars:  # identical nodes sharing a decision cost alike
            if var.node.op == "call_function" and var.node in comp:
                c = len(var.nodes) * comp[var.node]
                if var.derived is None:
                    var.unary += c
                else:
                    u, maps = var.derived
                    self.vars[u].unary += c[maps]
        # A value read by several consumers is redistributed once per placement wanted (the
        # redistribute pass shares one node per (value, placement)): such a value gets a hub
        # variable, "the placement it is redistributed to", costed once, from which each consumer's
        # placement follows (free when it is a local chunk of the hub's, as from Replicate).
        for (_, u, ids), lst in uses.items():
            if len(lst) < 2:
                continue
            want = sorted(
                {st[0][e[3]] for e, _ in lst for st in self.vars[e[2]].states}
                | set(i for i in ids if i >= 0)
            )
            h = len(self.vars)
            self.vars.append(_Var(None, [((i,), (i,)) for i in want]))
            self.vars[h].nodes = []
            self.hub_nodes[h] = sorted({x for _, x in lst}, key=lambda x: x.name)
            copies = len(self.hub_nodes[h])  # one redistribution per layer the value lives in
            self._add_pair(u, h, self._table(list(ids), want) * copies)
            for e, _ in lst:
                edges[e] -= 1
                hub_edges[(h, e[2], e[3])] = hub_edges.get((h, e[2], e[3]), 0) + 1
        for (h, v, j), k in hub_edges.items():
            t = self._table(
                [st[1][0] for st in self.vars[h].states], [st[0][j] for st in self.vars[v].states]
            )
            self._add_pair(h, v, t * k)
        for (u, ids, v, j), k in edges.items():
            if k == 0:
                continue
            t = self._table(list(ids), [st[0][j] for st in self.vars[v].states])
            self._add_pair(u, v, t * k)
        for (u, ids, want), k in unary_edges.items():
            if want is None:  # hand back usable values: pending reductions finished
                self.vars[u].unary += k * torch.tensor(
                    [self.cost(i, self.sid(self.p.reduced(self.specs[i]))) for i in ids],
                    dtype=torch.float64,
                )
            else:
                self.vars[u].unary += k * torch.tensor(
                    [self.cost(i, want) for i in ids], dtype=torch.float64
                )
        for (u, ids, pv), k in grad_edges.items():
            t = self._table(list(ids), [st[1][0] for st in self.vars[pv].states])
            self._add_pair(u, pv, t * k)
        self._memory({self.var_of[p] for p in self._trained}, saved)

    def _memory(self, trained: set[int], saved: set[fx.Node]) -> None:
        """Per state: parameters (+ gradients and optimizer states where they train), buffers and
        (``activations``) the forward values the backward reads."""
        for n in self.gm.graph.nodes:
            if n.op != "placeholder" or info(n).kind not in (PARAM, BUFFER, CONSTANT):
                continue
            v = self.var_of[n]
            var = self.vars[v]
            # + gradient + optimizer states
            f = 2 + self.opt.optimizer_states if v in trained else 1
            self._add_memory(var, [f * local_bytes(self.specs[st[1][0]]) for st in var.states])
        for a in sorted(saved, key=lambda x: x.name):
            u, ids = self.resolve(a)
            self._add_memory(
                self.vars[u], [local_bytes(self.specs[i]) if i >= 0 else 0.0 for i in ids]
            )

    def _add_memory(self, var: _Var, mem: list[float]):
        t = torch.tensor(mem, dtype=torch.float64)
        var.memory = t if var.memory is None else var.memory + t

    def _output_edges(self, n, unary_edges, grad_edges):
        """Every output's requirement as a unary cost (a fixed placement, or its reduction) or an
        edge to the placeholder its placement follows (a gradient)."""
        for req, o in zip(self.p.output_requirements(n), flat_outputs(n)):
            if req is None:
                self._output_roles.append(None)
                continue
            u, idx = self.resolve(o)  # idx: the output's spec id per state of u
            if req.role.kind == "grad_param" and req.placeholder is not None:
                self._trained.append(req.placeholder)  # it trains: gradients + optimizer states
            if req.kind == "fixed":
                want = self.sid(req.spec)
                unary_edges[(u, idx, want)] = unary_edges.get((u, idx, want), 0) + 1
                self._output_roles.append(("fixed", want))
            elif req.kind == "like":
                pv = self.var_of[req.placeholder]
                grad_edges[(u, idx, pv)] = grad_edges.get((u, idx, pv), 0) + 1
                self._output_roles.append(("like", pv))
            else:
                unary_edges[(u, idx, None)] = unary_edges.get((u, idx, None), 0) + 1
                self._output_roles.append(("reduced", (u, idx)))

    # ---- write back ----
    def conditional(self, v: int, choice: Sequence[int]) -> torch.Tensor:
        c = self.vars[v].unary.clone()
        for (a, b), t in self.factors.items():
            if a == v:
                c += t[:, choice[b]]
            elif b == v:
                c += t[choice[a], :]
        return c

    def apply(self, choice: Sequence[int]) -> None:
        by_node = {}
        choice = list(choice)
        # followers take their root's choice (roots are never followers)
        for i, var in enumerate(self.vars):
            if var.derived is not None:
                u, maps = var.derived
                choice[i] = maps[choice[u]]
        for i, var in enumerate(self.vars):
            # a hub: the redistribute pass routes consumers through it where cheaper
            if var.node is None:
                hub = self.specs[var.states[choice[i]][1][0]]
                for x in self.hub_nodes[i]:
                    info(x).hub = hub
                continue
            ins, outs = var.states[choice[i]]
            prov = self.provenance.get(i, "auto")
            if var.derived is not None:
                prov = f"auto: follows its input ({self.vars[var.derived[0]].node.name})"
            elif len(var.states) > 1 and prov.endswith("auto"):
                cond = self.conditional(i, choice)
                order = sorted(range(len(var.states)), key=lambda s: (float(cond[s]), s))
                alt = next(
                    (s for s in order if s != choice[i] and math.isfinite(float(cond[s]))), None
                )
                if alt is not None:
                    a_out = var.states[alt][1]
                    a_desc = (
                        placements_str(self.specs[a_out[0]].placements)
                        if a_out and a_out[0] >= 0
                        else "-"
                    )
                    a_in = ",".join(
                        placements_str(self.specs[x].placements) for x in var.states[alt][0]
                    )
                    delta = float(cond[alt]) - float(cond[choice[i]])
                    prov = (
                        f"{prov}; runner-up {a_desc}"
                        + (f" from {a_in}" if a_in else "")
                        + f" +{delta:.2f} us"
                    )
            for k, n in enumerate(var.nodes):
                by_node[n] = (
                    ins,
                    outs,
                    prov if k == 0 else f"{prov} (shared with {var.nodes[0].name})",
                )
        for n in self.gm.graph.nodes:
            rec = info(n)
            if n in by_node:
                ins, outs, prov = by_node[n]
                out_specs = tuple(self.specs[o] if o >= 0 else None for o in outs)
                if n.op == "placeholder":
                    rec.spec = out_specs[0]
                else:
                    rec.input_specs = tuple(self.specs[i] for i in ins)
                    rec.spec = (
                        out_specs if isinstance(n.meta.get("val"), (tuple, list)) else out_specs[0]
                    )
                rec.provenance = prov
            elif n.op == "call_function" and n.target is operator.getitem:
                parent = info(n.args[0]).spec
                rec.spec = parent[n.args[1]] if isinstance(parent, tuple) else parent
                rec.provenance = "getitem"
            elif n in self.transparent:
                rec.spec = info(n.args[0]).spec
                rec.input_specs = (rec.spec,)
                rec.provenance = "passthrough"
                if n.target is BOUNDARY:
                    rec.module = rec.tag.split(":")[0]
            elif n.op == "output":
                specs = []
                for role, o in zip(self._output_roles, flat_outputs(n)):
                    if role is None:
                        specs.append(None)
                    elif role[0] == "fixed":
                        specs.append(self.specs[role[1]])
                    elif role[0] == "like":
                        specs.append(info(self.vars[role[1]].node).spec)
                    else:
                        specs.append(self.p.reduced(info(o).spec))
                rec.input_specs = tuple(specs)
                rec.provenance = "outputs (auto)"


def _all_even(specs) -> bool:
    return all(is_even(s) for s in specs)


def _broadcast_operands(n: fx.Node, targs: list) -> set[int]:
    """Positions (among ``targs``) of the operands a pointwise ``n`` broadcasts: fewer elements
    than its output (a row's sum against the row)."""
    tags = getattr(n.target, "tags", ())
    out = n.meta.get("val")
    if torch.Tag.pointwise not in tags or not isinstance(out, torch.Tensor) or len(targs) < 2:
        return set()
    return {
        i
        for i, a in enumerate(targs)
        if isinstance(v := a.meta.get("val"), torch.Tensor)
        and statically_known_true(v.numel() < out.numel())
    }
