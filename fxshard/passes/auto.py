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

Deterministic: variables, states and ILP columns are built in graph order.  The modelled cost of
any annotated program (auto or hand-written) comes from ``modelled_cost``, so plans compare on
equal terms.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .. import strategies
from ..adapter import Partial, Replicate, Shard, flop_count
from ..cost import CostModel
from ..mesh import MeshSpec
from ..planner import costs_from, pairwise_costs, plan_between
from ..plans import PlanConstraints
from ..spec import ShardingSpec, placements_str
from .annotate import (
    Annotator,
    _is_custom_op,
    _val,
    _where,
    arg_key,
    custom_op_error,
    flat_args,
    is_even,
    leaves_used_output_unplaced,
    tensor_args,
    used_outputs,
)
from .capture import BOUNDARY, BUFFER, CONSTANT, GRAD_TAG, INPUT, PARAM, TANGENT, info

log = logging.getLogger("fxshard")
INF = float("inf")


@dataclass(frozen=True)
class AutoOptions:
    """Options of ``plan="auto"``.

    ``memory_budget``: bytes per rank for parameters and buffers, plus (training) their gradients
    and ``optimizer_states`` copies (Adam: 2), plus (``activations=True``, training) the forward
    values the backward reads.  ``compute``: add modelled compute time to the objective (without
    it, replicating everything costs nothing).  ``share_layers``: identical repeated layers take one
    decision.  ``follow``: an op with one tensor input takes its input's placement as it is where its
    rule allows (no decision of its own; off: every op is a decision, slower, rarely cheaper).
    ``time_limit_s``: HiGHS's limit for the cross-edge integer program; ``mip_gap``: the relative
    gap at which it stops (the plan is then within that fraction of the modelled optimum)."""

    memory_budget: float | None = None
    optimizer_states: int = 2
    activations: bool = False
    compute: bool = True
    share_layers: bool = True
    follow: bool = True
    time_limit_s: float = 60.0
    mip_gap: float = 5e-3


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
    times: dict = field(default_factory=dict)

    def __str__(self) -> str:
        t = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.times.items())
        return (f"auto: {self.nodes} nodes -> {self.variables} decisions ({self.shared_layers} layers shared, "
                f"{self.followed} ops follow their input), "
                f"{self.eliminated} solved by DP, {self.ilp_variables} by ILP ({self.pruned_states} dominated "
                f"states dropped, {self.ilp_columns} columns, "
                f"{'LP rounded' if self.ilp_rounded else 'branch and bound'}, gap {self.ilp_gap:.2%}); "
                f"objective {self.objective_us:.1f} us, memory {self.memory_bytes / 2**20:.1f} MiB per rank; {t}")


class AutoInfeasible(ValueError):
    """The memory budget (or a fixed placement) admits no plan."""


# ---- cost of one strategy ---------------------------------------------------------------------------

def local_bytes(spec: ShardingSpec) -> float:
    return spec.nbytes / spec.num_shards


def compute_us(node: fx.Node, in_specs: Sequence, out_specs: Sequence, cm) -> float:
    """Modelled µs of ``node`` under a strategy: its flops split over the mesh dims that shard an
    input (a contraction split over ranks leaves Partial outputs), plus the local bytes it reads and
    writes (Partial values are full size)."""
    fl = node.meta.get("fxshard_flops")
    if fl is None:
        fl = node.meta["fxshard_flops"] = flop_count(node)
    flops_us, bytes_us = getattr(cm, "flops_per_us", None), getattr(cm, "hbm_bytes_per_us", None)
    if not flops_us or not bytes_us:
        return 0.0
    split = 1
    mesh = None
    for s in in_specs:
        if isinstance(s, ShardingSpec):
            mesh = s.mesh
            break
    if mesh is not None:
        for m in range(mesh.ndim):
            if any(isinstance(s, ShardingSpec) and isinstance(s.placements[m], Shard) for s in in_specs):
                split *= mesh.shape[m]
    moved = sum(local_bytes(s) for s in (*in_specs, *out_specs) if isinstance(s, ShardingSpec))
    return fl / split / flops_us + moved / bytes_us


def _reduced(ann, spec: ShardingSpec, val) -> ShardingSpec:
    return ann.spec([Replicate() if isinstance(p, Partial) else p for p in spec.placements], val, spec.shard_order)


# ---- repeated layers ----------------------------------------------------------------------------------

def repeated_blocks(model: torch.nn.Module | None) -> list[list[str]]:
    """Groups of sibling modules (``layers.0``, ``layers.1``...) with one type and parameter shapes."""
    if model is None:
        return []
    out = []
    for fqn, mod in model.named_modules():
        groups: dict = {}
        for name, child in mod.named_children():
            if not name.isdigit():
                continue
            key = (type(child), tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters()))
            groups.setdefault(key, []).append(f"{fqn}.{name}" if fqn else name)
        out += [g for g in groups.values() if len(g) > 1]
    inner = {f for g in out for f in g}
    # a block inside another repeated block is shared through the outer one
    return [g for g in out if not any(f.startswith(o + ".") for f in g for o in inner if o != f)]


def _layer_instances(gm: fx.GraphModule, blocks: list[list[str]]) -> dict[str, list[tuple[list, list]]]:
    """{first block fqn: [(core nodes, accumulation nodes) of each instance]} from the capture's block
    markers (forward nodes between a block's input and output boundaries), backward nodes by their
    forward op (AOT's ``seq_nr``), parameters by FQN prefix; gradient accumulations (no layer's
    ``seq_nr``) by their most recent input, kept apart since the first and last layers differ there."""
    owner = {f: g[0] for g in blocks for f in g}
    inst_of: dict[fx.Node, str] = {}
    current = None
    seq_owner: dict[int, str] = {}
    for n in gm.graph.nodes:
        rec = info(n)
        if n.op == "placeholder":
            if rec.fqn and rec.kind in (PARAM, BUFFER, CONSTANT):
                for f in owner:
                    if rec.fqn.startswith(f + "."):
                        inst_of[n] = f
            continue
        if n.op != "call_function" or n.meta.get("partitioner_tag") == "is_backward":
            continue
        if rec.kind == "boundary":
            tag = n.args[1]
            mod, _, rest = tag.partition(":")
            if mod in owner:
                if rest.startswith("in:") and current is None:
                    current = mod
                if current == mod:
                    inst_of[n] = mod
                    if rest.startswith("out:"):
                        current = None
                    continue
        if current is not None:
            inst_of[n] = current
            if "seq_nr" in n.meta:
                seq_owner.setdefault(n.meta["seq_nr"], current)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    add = torch.ops.aten.add.Tensor
    accumulation: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get("partitioner_tag") != "is_backward":
            continue
        f = seq_owner.get(n.meta.get("seq_nr"))
        if f is None and (n.target is add or info(n).kind == "boundary"):
            # Gradient accumulations carry no layer's seq_nr (AOT tags them with the engine's last
            # one): they join the layer of their most recently computed input, so that every middle
            # layer holds the same accumulations and its signature matches its neighbours'.
            owned = [a for a in n.all_input_nodes if a in inst_of]
            if owned:
                f = inst_of[max(owned, key=order.__getitem__)]
                accumulation.add(n)
        if f is not None:
            inst_of[n] = f
    out: dict[str, list[list[fx.Node]]] = {}
    for g in blocks:
        per = {f: [] for f in g}
        for n in gm.graph.nodes:
            f = inst_of.get(n)
            if f in per:
                per[f].append(n)
        for f in g:  # parameters first, by their name inside the layer
            per[f].sort(key=lambda n, f=f: (0, info(n).fqn[len(f):]) if n.op == "placeholder" else (1, 0))
        out[g[0]] = [([n for n in per[f] if n not in accumulation], [n for n in per[f] if n in accumulation])
                     for f in g]
    return out


def _signature(nodes: list[fx.Node], prefix: str, memo: dict | None = None) -> list:
    """A layer instance's nodes as comparable tuples: op, target, role, FQN inside the layer, output
    shapes, and arguments (nodes of the instance by position, others by shape).  ``memo`` keeps each
    node's position-free part between calls."""
    pos = {n: i for i, n in enumerate(nodes)}
    memo = {} if memo is None else memo

    def arg(a):
        if isinstance(a, fx.Node):
            if a in pos:
                return ("in", pos[a])
            v = a.meta.get("val")
            return ("out", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("out",)
        if isinstance(a, str):
            if a.startswith(prefix + ":"):
                return a[len(prefix):]
            if a.startswith(GRAD_TAG):
                return GRAD_TAG
            return a
        if isinstance(a, float):
            return ("float", a.hex())  # exact: signatures are compared as tuples (1 == 1.0 == True)
        if isinstance(a, (bool, int)):
            return (type(a).__name__, a)
        return a if isinstance(a, (type(None), torch.dtype)) else repr(a)

    sig = []  # a tuple of hashable, exactly comparable parts (cheaper to compare than its repr)
    for n in nodes:
        static = memo.get(n)
        if static is None:
            v = n.meta.get("val")
            shape = tuple((tuple(x.shape), x.dtype) for x in flat_args(v) if isinstance(x, torch.Tensor))
            rec = info(n)
            static = memo[n] = (n.op, str(n.target) if n.op == "call_function" else None, rec.kind,
                                rec.fqn[len(prefix):] if rec.fqn else None, shape)
        sig.append((static, arg_key((n.args, n.kwargs), arg)))
    return sig


# ---- the solver -----------------------------------------------------------------------------------------

class _Var:
    __slots__ = ("node", "states", "unary", "memory", "fixed", "nodes", "derived")

    def __init__(self, node, states):
        self.node = node
        self.states = states  # [(input spec ids, output spec ids)]
        self.unary = torch.zeros(len(states), dtype=torch.float64)
        self.memory = None
        self.fixed = False  # a single state given by the user
        self.nodes = [node]  # every node taking this decision
        self.derived = None  # (root variable, this var's state per root state): it follows its input


class AutoPlanner:
    def __init__(self, gm, mesh: MeshSpec, cm: CostModel, cons: PlanConstraints, options: AutoOptions,
                 input_placements=None, output_placements=None, fuse=True, blocks=(), training=False,
                 replicate_grads=False):
        self.gm, self.mesh, self.cm, self.cons, self.opt = gm, mesh, cm, cons, options
        self.fuse = fuse
        self.training = training
        self.blocks = list(blocks)
        self.ann = Annotator(mesh, cm, cons, input_placements, output_placements, fuse)
        self.ann.replicate_grads = replicate_grads
        self.input_placements, self.output_placements = input_placements, output_placements
        self.specs: list[ShardingSpec] = []
        self.spec_id: dict = {}
        self._cost: dict = {}
        self._by_shape: dict[tuple, list[int]] = {}  # (shape, dtype) -> spec ids
        self._searched: set[int] = set()  # spec ids whose costs to their group are known
        self._resolved: dict[tuple, tuple] = {}  # resolve() per (variable, output index, follows)
        self._tables: dict[tuple, tuple[dict, torch.Tensor]] = {}  # (shape, dtype) -> (spec id -> row, costs)
        self.vars: list[_Var] = []
        self.var_of: dict[fx.Node, int] = {}
        self.factors: dict[tuple[int, int], torch.Tensor] = {}
        self.report = AutoReport(nodes=len(gm.graph.nodes))
        self.warnings = self.ann.warnings

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
        if a < 0 or b < 0:  # an output without placement (never read: see leaves_used_output_unplaced)
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
            return plan_between(sa, sb, self.cm, even_only=True, fuse=self.fuse).cost
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
                table = pairwise_costs([self.specs[b] for b in group], self.cm, even_only=True, fuse=self.fuse)
                self._searched.update(group)
                self._tables[(sa.shape, sa.dtype)] = ({b: i for i, b in enumerate(group)}, table)
                return
            self._searched.add(a)
            others = [b for b in group if b != a]
            costs = costs_from(sa, [self.specs[b] for b in others], self.cm, even_only=True, fuse=self.fuse)
        except (ValueError, NotImplementedError):
            self._searched.add(a)
            return  # pair by pair (unreachable targets cost INF there)
        self._cost.update(((a, b), c) for b, c in zip(others, costs))

    def _placement_options(self, val, fixed_dim=None, fixed=None) -> list[ShardingSpec]:
        """Every even (Replicate | Shard(d)) placement per mesh dim, default shard order."""
        per_dim = []
        for m in range(self.mesh.ndim):
            if m == fixed_dim:
                per_dim.append([fixed])
            else:
                per_dim.append([Replicate()] + [Shard(d) for d in range(val.ndim)])
        out = []
        for plc in itertools.product(*per_dim):
            try:
                s = self.ann.spec(plc, val)
            except ValueError:
                continue
            if is_even(s):
                out.append(s)
        return out

    # ---- variables ----
    def _new_var(self, node, states) -> int:
        v = _Var(node, states)
        self.vars.append(v)
        self.var_of[node] = len(self.vars) - 1
        return len(self.vars) - 1

    def producer(self, a: fx.Node) -> tuple[fx.Node, int]:
        """(node whose variable decides ``a``'s placement, output index): through getitem and
        transparent boundaries."""
        idx = 0
        while a not in self.var_of:
            if a.op == "call_function" and a.target is operator.getitem:
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
        key = (v, idx, var.derived is not None)  # a variable's states are fixed; it may come to follow once
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
        if n is None or n.op != "call_function" or info(n).kind == "boundary" or len(var.states) < 2:
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

    def _placeholder_states(self, node) -> list:
        rec, val = info(node), node.meta["val"]
        if rec.kind in (PARAM, BUFFER, CONSTANT):
            want = self.cons.params.get(rec.fqn)
            if want is not None:
                from .annotate import _normalize
                opts = self._placement_options(val, self.cons.dim, _normalize(want[0], val.ndim))
                if not opts:
                    raise AutoInfeasible(f"{want[1]} asks for {want[0]} on {rec.fqn} of shape {tuple(val.shape)}, "
                                         f"which mesh {self.mesh.shape} does not divide evenly")
            else:
                opts = self._placement_options(val)
            return opts
        if rec.kind == TANGENT:
            i = rec.input_index
            given = self.output_placements[i] if self.output_placements is not None and \
                i < len(self.output_placements) else None
            return [self.ann.spec(given if given is not None else [Replicate()] * self.mesh.ndim, val)]
        i = rec.input_index
        if self.input_placements is not None:
            if i >= len(self.input_placements):
                raise ValueError(f"input_placements has {len(self.input_placements)} entries, but the program "
                                 f"takes input {i} ({node.name})")
            return [self.ann.spec(self.input_placements[i], val, what=f"input_placements[{i}]")]
        return self._placement_options(val)

    def _op_states(self, node) -> list:
        rec = info(node)
        targs = tensor_args(node)
        cur = [self.ann.spec([Replicate()] * self.mesh.ndim, _val(a)) for a in targs]
        out_val = node.meta.get("val")
        outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
        cands = self.ann.candidates(node, cur)
        states, seen = [], set()
        rep_out = tuple(self.ann.spec([Replicate()] * self.mesh.ndim, v) if isinstance(v, torch.Tensor) else None
                        for v in outs)
        if cands == "factory":
            return [(tuple(cur), rep_out)], "factory: replicated"
        used = used_outputs(node)
        for ins, o in cands or ():
            try:
                specs = self.ann._specs_for(ins, targs, cur)
                out_specs = tuple(self.ann.spec(p, v) if p is not None and isinstance(v, torch.Tensor) else None
                                  for p, v in zip(o, outs))
            except ValueError:
                continue
            if specs is None or len(out_specs) != len(outs) or not all(s is None or is_even(s) for s in out_specs):
                continue
            if leaves_used_output_unplaced(used, out_specs, outs):
                continue
            key = (specs, out_specs)
            if key not in seen:
                seen.add(key)
                states.append(key)
        if cands is None and _is_custom_op(node.target):
            raise custom_op_error(node, rec)
        if not states:
            why = "has no sharding rule" if not cands else "has no even sharding for these shapes"
            self.ann.warn(f"{node.target} at node {node.name}{_where(rec)} {why}; computing it replicated")
            return [(tuple(cur), rep_out)], "fallback: replicated (no rule)"
        return states, "auto"

    def build(self):
        t0 = time.perf_counter()
        gm = self.gm
        # which nodes share a decision
        share: dict[fx.Node, fx.Node] = {}
        if self.opt.share_layers and self.blocks:
            for prefix, insts in _layer_instances(gm, self.blocks).items():
                # An instance's ops share the decisions of the first instance with the same signature;
                # its gradient accumulations those of the first with the same signature including
                # them (the first and last layers, bordering the embedding and the head, accumulate
                # differently: they keep their own, the middle ones share).
                members = [f for g in self.blocks if g[0] == prefix for f in g]
                first_core: dict = {}
                first_all: dict = {}
                memo: dict = {}
                for k, (core, acc) in enumerate(insts):
                    sig = tuple(_signature(core, members[k], memo))
                    base = first_core.setdefault(sig, k)
                    if base != k:
                        share.update(zip(core, insts[base][0]))
                        self.report.shared_layers += 1
                    base = first_all.setdefault(tuple(_signature(core + acc, members[k], memo)), k)
                    if base != k:
                        share.update(zip(acc, insts[base][1]))
        self.provenance: dict[int, str] = {}
        transparent, shared = set(), []
        self._order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for n in gm.graph.nodes:
            rec = info(n)
            if n.op == "output" or (n.op == "call_function" and n.target is operator.getitem):
                continue
            if rec.kind == "boundary":
                tag = rec.extra.get("tag", n.args[1])
                want = None if tag.startswith(GRAD_TAG) else self.cons.boundaries.get(tag)
                if want is None or want[0] is None:
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
                self.provenance[v] = "auto" if len(states) > 1 else "fixed"
            elif rec.kind == "boundary":
                tag = rec.extra.get("tag", n.args[1])
                want = self.cons.boundaries[tag]
                opts = self._placement_options(n.meta["val"], self.cons.dim, want[0])
                if not opts:
                    raise AutoInfeasible(f"{want[1]} asks for {want[0]} at {tag}, which does not divide shape "
                                         f"{tuple(n.meta['val'].shape)} evenly on mesh {self.mesh.shape}")
                v = self._new_var(n, [((self.sid(s),), (self.sid(s),)) for s in opts])
                self.provenance[v] = f"{want[1]} ({tag.split(':', 1)[1]}) + auto"
                rec.module = tag.split(":")[0]
            else:
                raw, prov = self._op_states(n)
                states = [(tuple(self.sid(s) for s in ins), tuple(-1 if s is None else self.sid(s) for s in outs))
                          for ins, outs in raw]
                v = self._new_var(n, states)
                self.provenance[v] = prov
        self.share = share
        for n in shared:  # later layers (and their backward, which runs first) take the first layer's
            v = self.var_of[share[n]]
            self.var_of[n] = v
            self.vars[v].nodes.append(n)
        self.transparent = transparent
        t1 = time.perf_counter()
        comp = {}
        for var in self.vars:
            n = var.node
            if self.opt.compute and n.op == "call_function" and info(n).kind != "boundary":
                comp[n] = torch.tensor([compute_us(n, [self.specs[i] for i in ins],
                                                   [self.specs[i] for i in outs if i >= 0], self.cm)
                                        for ins, outs in var.states], dtype=torch.float64)
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
        key = (self.specs[out_ids[0]].shape, self.specs[out_ids[0]].dtype) if out_ids and out_ids[0] >= 0 else None
        hit = self._tables.get(key)
        if hit is not None and all(i in hit[0] for i in out_ids) and all(i in hit[0] for i in in_ids):
            pos, t = hit
            o, i = torch.tensor(out_ids), torch.tensor(in_ids)
            sub = t[torch.tensor([pos[a] for a in out_ids])][:, torch.tensor([pos[b] for b in in_ids])]
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
        placeholders = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                r = info(n)
                if r.kind in (PARAM, BUFFER):
                    placeholders[("grad_param", r.fqn)] = n
                elif r.kind == INPUT:
                    placeholders[("grad_input", r.input_index)] = n
        saved = set()
        uses: dict[fx.Node, list] = {}  # immediate argument -> its (edge key, actual node) uses
        hub_edges: dict[tuple, int] = {}
        self.hub_nodes: dict[int, list[fx.Node]] = {}
        self._output_roles = []
        self._fixed_grads = []  # gradients handed back replicated: their parameters still train
        for n in gm.graph.nodes:
            if n.op == "placeholder" or n in self.transparent or n.target is operator.getitem:
                continue
            if n.op == "output":
                self._output_edges(n, unary_edges, grad_edges, placeholders)
                continue
            v = self.var_of[n]
            targs = [n.args[0]] if info(n).kind == "boundary" else tensor_args(n)
            for j, a in enumerate(targs):
                p, _ = self.producer(a)
                if self.opt.activations and self.training and \
                        n.meta.get("partitioner_tag") == "is_backward" and \
                        p.meta.get("partitioner_tag") == "is_forward" and p.op != "placeholder":
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
        # redistribute pass shares one node per (value, placement)): such a value gets a hub variable,
        # "the placement it is redistributed to", costed once, from which each consumer's placement
        # follows (free when it is a local chunk of the hub's, as from Replicate).
        for (_, u, ids), lst in uses.items():
            if len(lst) < 2:
                continue
            want = sorted({st[0][e[3]] for e, _ in lst for st in self.vars[e[2]].states} |
                          set(i for i in ids if i >= 0))
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
            t = self._table([st[1][0] for st in self.vars[h].states], [st[0][j] for st in self.vars[v].states])
            self._add_pair(h, v, t * k)
        for (u, ids, v, j), k in edges.items():
            if k == 0:
                continue
            t = self._table(list(ids), [st[0][j] for st in self.vars[v].states])
            self._add_pair(u, v, t * k)
        for (u, ids, want), k in unary_edges.items():
            if want is None:  # hand back usable values: pending reductions finished
                val = self.specs[ids[0]]
                self.vars[u].unary += k * torch.tensor(
                    [self.cost(i, self.sid(_reduced(self.ann, self.specs[i], _fake(val)))) for i in ids],
                    dtype=torch.float64)
            else:
                self.vars[u].unary += k * torch.tensor([self.cost(i, want) for i in ids], dtype=torch.float64)
        for (u, ids, pv), k in grad_edges.items():
            t = self._table(list(ids), [st[1][0] for st in self.vars[pv].states])
            self._add_pair(u, pv, t * k)
        # memory: parameters (+ gradients and optimizer states), buffers, saved activations
        trained = {pv for (_, _, pv) in grad_edges} | {self.var_of[placeholders[r]] for r in self._fixed_grads}
        for n in gm.graph.nodes:
            if n.op != "placeholder" or info(n).kind not in (PARAM, BUFFER, CONSTANT):
                continue
            v = self.var_of[n]
            var = self.vars[v]
            f = 2 + self.opt.optimizer_states if v in trained else 1  # + gradient + optimizer states
            self._add_memory(var, [f * local_bytes(self.specs[st[1][0]]) for st in var.states])
        for a in sorted(saved, key=lambda x: x.name):
            u, ids = self.resolve(a)
            self._add_memory(self.vars[u], [local_bytes(self.specs[i]) if i >= 0 else 0.0 for i in ids])

    def _add_memory(self, var: _Var, mem: list[float]):
        t = torch.tensor(mem, dtype=torch.float64)
        var.memory = t if var.memory is None else var.memory + t

    def _output_edges(self, n, unary_edges, grad_edges, placeholders):
        rec = info(n)
        outs = n.args[0]
        flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        joint = bool(rec.extra.get("outputs"))
        roles = rec.extra.get("outputs") or [("output", i) for i in range(len(flat))]
        for i, o in enumerate(flat):
            role = tuple(roles[i]) if i < len(roles) else ("output", i)
            if not isinstance(o, fx.Node):
                self._output_roles.append(None)
                continue
            u, idx = self.resolve(o)  # idx: the output's spec id per state of u
            val = o.meta["val"]
            if role[0] != "output":
                if self.ann.replicate_grads or role not in placeholders:
                    if role in placeholders and role[0] == "grad_param":
                        self._fixed_grads.append(role)
                    want = self.sid(self.ann.spec([Replicate()] * self.mesh.ndim, val))
                    unary_edges[(u, idx, want)] = unary_edges.get((u, idx, want), 0) + 1
                    self._output_roles.append(("fixed", want))
                else:
                    pv = self.var_of[placeholders[role]]
                    grad_edges[(u, idx, pv)] = grad_edges.get((u, idx, pv), 0) + 1
                    self._output_roles.append(("like", pv))
                continue
            k = role[1]
            given = self.output_placements[k] if self.output_placements is not None and \
                k < len(self.output_placements) else None
            if given is not None or joint:
                pl = given if given is not None else [Replicate()] * self.mesh.ndim
                want = self.sid(self.ann.spec(pl, val, what=f"output_placements[{k}]"))
                unary_edges[(u, idx, want)] = unary_edges.get((u, idx, want), 0) + 1
                self._output_roles.append(("fixed", want))
            else:
                unary_edges[(u, idx, None)] = unary_edges.get((u, idx, None), 0) + 1
                self._output_roles.append(("reduced", (u, idx)))

    # ---- solve ----
    def solve(self) -> list[int]:
        t0 = time.perf_counter()
        budget = self.opt.memory_budget
        self._check_budget(budget)
        nv = len(self.vars)
        unary = [v.unary.clone() for v in self.vars]
        factors = {k: t.clone() for k, t in self.factors.items()}
        nbrs: list[dict[int, tuple]] = [dict() for _ in range(nv)]
        for (u, v) in factors:
            nbrs[u][v] = (u, v)
            nbrs[v][u] = (u, v)
        protected = {i for i, v in enumerate(self.vars) if budget is not None and v.memory is not None}

        def table(a, b):  # factor oriented (a states) x (b states)
            t = factors[nbrs[a][b]]
            return t if nbrs[a][b][0] == a else t.T

        eliminated = []  # (var, kind, data) in order
        alive = [True] * nv
        queue = sorted(i for i in range(nv) if len(nbrs[i]) <= 2 and i not in protected)
        import heapq
        heapq.heapify(queue)
        while queue:
            v = heapq.heappop(queue)
            if not alive[v] or len(nbrs[v]) > 2 or v in protected:
                continue
            ns = sorted(nbrs[v])
            if not ns:
                eliminated.append((v, 0, None))
            elif len(ns) == 1:
                (u,) = ns
                m = table(u, v) + unary[v][None, :]
                best, arg = m.min(dim=1)
                unary[u] = unary[u] + best
                del factors[nbrs[u][v]], nbrs[u][v]
                eliminated.append((v, 1, (u, arg)))
                if len(nbrs[u]) <= 2 and u not in protected:
                    heapq.heappush(queue, u)
            else:
                u, w = ns
                m = table(u, v)[:, :, None] + unary[v][None, :, None] + table(v, w)[None, :, :]
                best, arg = m.min(dim=1)
                del factors[nbrs[u][v]], factors[nbrs[v][w]], nbrs[u][v], nbrs[w][v]
                if w in nbrs[u]:
                    k = nbrs[u][w]
                    factors[k] = factors[k] + (best if k[0] == u else best.T)
                else:
                    k = (u, w) if u < w else (w, u)
                    factors[k] = best if k[0] == u else best.T
                    nbrs[u][w] = nbrs[w][u] = k
                eliminated.append((v, 2, (u, w, arg)))
                for x in (u, w):
                    if len(nbrs[x]) <= 2 and x not in protected:
                        heapq.heappush(queue, x)
            alive[v] = False
            nbrs[v] = {}
        self.report.eliminated = len(eliminated) - self.report.followed
        t1 = time.perf_counter()
        core = [i for i in range(nv) if alive[i]]
        choice = [-1] * nv
        if core:
            keep = self._dominance(core, unary, factors, nbrs, budget)
            sub_unary = list(unary)
            memory = {}
            for v in core:
                sub_unary[v] = unary[v][keep[v]]
                if self.vars[v].memory is not None:
                    memory[v] = self.vars[v].memory[keep[v]]
            sub_factors = {(u, v): t[keep[u]][:, keep[v]] for (u, v), t in factors.items()}
            self.report.pruned_states = sum(len(unary[v]) - len(keep[v]) for v in core)
            self._ilp(core, sub_unary, sub_factors, memory, choice, budget)
            for v in core:
                choice[v] = int(keep[v][choice[v]])
        t2 = time.perf_counter()
        for v, kind, data in reversed(eliminated):
            if kind == 0:
                choice[v] = int(unary[v].argmin())
            elif kind == 1:
                u, arg = data
                choice[v] = int(arg[choice[u]])
            else:
                u, w, arg = data
                choice[v] = int(arg[choice[u], choice[w]])
        self.report.times["dp"] = (t1 - t0) + (time.perf_counter() - t2)
        self.report.times["ilp"] = t2 - t1
        self.choice = choice
        self.report.objective_us = self.objective(choice)
        self.report.memory_bytes = sum(float(v.memory[choice[i]]) for i, v in enumerate(self.vars)
                                       if v.memory is not None)
        if not math.isfinite(self.report.objective_us):
            raise AutoInfeasible("plan='auto' found no plan with finite cost: a fixed placement cannot be reached "
                                 "by any redistribution (see the warnings)")
        return choice

    def objective(self, choice) -> float:
        total = sum(float(v.unary[choice[i]]) for i, v in enumerate(self.vars))
        for (u, v), t in self.factors.items():
            total += float(t[choice[u], choice[v]])
        return total

    def _check_budget(self, budget):
        mins = [float(v.memory.min()) for v in self.vars if v.memory is not None]
        self.report.min_memory_bytes = sum(mins)
        if budget is None:
            return
        if self.report.min_memory_bytes > budget:
            what = "parameters + gradients + optimizer states" if self.training else "parameters and buffers"
            if self.opt.activations and self.training:
                what += " + saved activations"
            raise AutoInfeasible(
                f"memory_budget {_size(budget)} per rank is too small: the {what} need at least "
                f"{_size(self.report.min_memory_bytes)} per rank even when sharded as far as mesh "
                f"{self.mesh.shape} and the fixed placements allow ({_size(self.report.min_memory_bytes - budget)} "
                f"over); raise the budget or use a larger mesh")

    def _dominance(self, core, unary, factors, nbrs, budget) -> dict[int, torch.Tensor]:
        """{var: kept state indices}: a state is dropped when another costs no more on the var's own
        terms (compute, memory when budgeted) and on every edge to every kept neighbour state, since
        switching to it never raises the objective nor breaks the budget.  Exact (the ILP keeps an
        optimum); repeated until nothing changes, neighbours' pruning exposing more."""
        keep = {v: torch.nonzero(torch.isfinite(unary[v])).flatten() for v in core}
        for v in core:
            if not len(keep[v]):
                keep[v] = torch.arange(len(unary[v]))
        changed, rounds = True, 0
        while changed and rounds < 4:
            changed, rounds = False, rounds + 1
            for v in core:
                kv = keep[v]
                if len(kv) < 2:
                    continue
                feats = [unary[v][kv, None]]
                mem = self.vars[v].memory
                if budget is not None and mem is not None:
                    feats.append(mem[kv, None])
                for u, k in nbrs[v].items():
                    t = factors[k] if k[0] == v else factors[k].T
                    feats.append(t[kv][:, keep[u]])
                f = torch.cat(feats, dim=1)
                f = torch.where(torch.isfinite(f), f, torch.full_like(f, 1e300))
                # exact comparisons: "<=" with a tolerance is not transitive and could drop every state
                le = (f[:, None, :] <= f[None, :, :]).all(dim=2)  # [a, b]: a no worse than b anywhere
                n = len(kv)
                idx = torch.arange(n)
                strict = le & ~le.T  # a strictly better somewhere
                tie = le & le.T & (idx[:, None] < idx[None, :])  # equal rows: the lower index stays
                dominated = (strict | tie).any(dim=0)
                if bool(dominated.any()) and not bool(dominated.all()):
                    keep[v] = kv[~dominated]
                    changed = True
        return keep

    def _local_search(self, core, unary, factors, memory, start, budget, sweeps=20):
        """Iterated conditional modes from ``start``: each variable in turn takes its cheapest state
        given its neighbours', within the budget; first, while over budget, the swaps that save the
        most memory per unit of cost.  None when no state meets the budget."""
        nb: dict[int, list] = {v: [] for v in core}
        for (u, v), t in factors.items():
            nb[u].append((v, t))
            nb[v].append((u, t.T))
        cur = dict(start)
        used = sum(float(memory[v][cur[v]]) for v in memory) if budget is not None else 0.0
        limit = float(budget) if budget is not None else math.inf

        def local(v):
            c = unary[v].clone()
            for w, t in nb[v]:
                c += t[:, cur[w]]
            return c

        while used > limit:  # repair: cheapest cost increase per byte saved
            best = None
            for v in memory:
                c = local(v)
                saved = float(memory[v][cur[v]]) - memory[v]
                ok = saved > 0
                if not bool(ok.any()):
                    continue
                rate = torch.where(ok, (c - c[cur[v]]) / saved.clamp(min=1e-9), torch.full_like(c, math.inf))
                s = int(rate.argmin())
                if best is None or float(rate[s]) < best[0]:
                    best = (float(rate[s]), v, s)
            if best is None:
                return None
            _, v, s = best
            used -= float(memory[v][cur[v]] - memory[v][s])
            cur[v] = s
        for _ in range(sweeps):
            changed = False
            for v in core:
                c = local(v)
                if v in memory:
                    room = limit - used + float(memory[v][cur[v]])
                    c = torch.where(memory[v] <= room + 1e-6, c, torch.full_like(c, math.inf))
                s = int(c.argmin())
                if float(c[s]) < float(c[cur[v]]) - 1e-9 * (1 + abs(float(c[cur[v]]))):
                    if v in memory:
                        used += float(memory[v][s] - memory[v][cur[v]])
                    cur[v] = s
                    changed = True
            if not changed:
                break
        return cur

    def _ilp(self, core, unary, factors, memory, choice, budget):
        import highspy
        import numpy as np

        # columns: x[v, s] per core variable and state, then y per edge and (row class, col class)
        # pair; rows as COO triplets, converted to the compressed form HiGHS takes
        col_of, cost_parts = {}, []
        n = 0
        for v in core:
            col_of[v] = n
            cost_parts.append(unary[v].numpy())
            n += len(unary[v])
        nx = n
        r_idx, c_idx, vals = [], [], []
        lo, hi = [np.ones(len(core))], [np.ones(len(core))]
        nrow = len(core)
        for k, v in enumerate(core):  # one state per variable
            m = len(unary[v])
            r_idx.append(np.full(m, k))
            c_idx.append(np.arange(col_of[v], col_of[v] + m))
            vals.append(np.ones(m))
        classes = []  # per edge: (u, v, first marginal column, row class per u state, col class per v state)
        for (u, v), t in sorted(factors.items()):
            # states with identical rows / columns act alike on this edge: one marginal per class
            rk, rinv = torch.unique(t, dim=0, return_inverse=True)
            ck, cinv = torch.unique(rk, dim=1, return_inverse=True)
            nr, nc = ck.shape
            rinv, cinv = rinv.numpy(), cinv.numpy()
            classes.append((u, v, n, nc, rinv, cinv))
            cost_parts.append(ck.reshape(-1).numpy())
            y = n + np.arange(nr * nc).reshape(nr, nc)
            # sum_j y[i, j] = sum of x[u, a] over row class i;  sum_i y[i, j] = sum of x[v, b] over col class j
            r_idx += [np.repeat(nrow + np.arange(nr), nc), nrow + rinv,
                      np.repeat(nrow + nr + np.arange(nc), nr), nrow + nr + cinv]
            c_idx += [y.reshape(-1), col_of[u] + np.arange(len(rinv)),
                      y.T.reshape(-1), col_of[v] + np.arange(len(cinv))]
            vals += [np.ones(nr * nc), -np.ones(len(rinv)), np.ones(nr * nc), -np.ones(len(cinv))]
            lo.append(np.zeros(nr + nc))
            hi.append(np.zeros(nr + nc))
            nrow += nr + nc
            n += nr * nc
        if budget is not None:
            mv = [v for v in core if v in memory]
            r_idx.append(np.full(sum(len(memory[v]) for v in mv), nrow))
            c_idx += [np.arange(col_of[v], col_of[v] + len(memory[v])) for v in mv]
            vals += [memory[v].numpy() / 2**20 for v in mv]  # MiB: bytes would make the row badly scaled
            lo.append(np.array([-highspy.kHighsInf]))
            hi.append(np.array([float(budget) / 2**20]))
            nrow += 1
        costs = np.concatenate(cost_parts).astype(np.float64)
        ub = np.where(np.isfinite(costs), 1.0, 0.0)  # an infinite cost: that state / pair is excluded
        costs = np.where(np.isfinite(costs), costs, 0.0)
        r_idx, c_idx, vals = np.concatenate(r_idx), np.concatenate(c_idx), np.concatenate(vals)
        order = np.argsort(r_idx, kind="stable")
        starts = np.searchsorted(r_idx[order], np.arange(nrow)).astype(np.int32)
        h = highspy._Highs()  # the core class: Highs() prints a banner to stdout when constructed
        h.setOptionValue("output_flag", False)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("threads", 1)
        h.setOptionValue("time_limit", float(self.opt.time_limit_s))
        h.setOptionValue("mip_rel_gap", float(self.opt.mip_gap))
        h.addCols(n, costs, np.zeros(n), ub, 0, np.array([], dtype=np.int32), np.array([], dtype=np.int32),
                  np.array([]))
        h.addRows(nrow, np.concatenate(lo), np.concatenate(hi), len(order), starts,
                  c_idx[order].astype(np.int32), vals[order].astype(np.float64))
        self.report.ilp_variables = len(core)
        self.report.ilp_columns = n
        # The LP relaxation first: on this (marginal) formulation it is nearly integral and its value
        # bounds the optimum from below.  Rounded and improved by local search, its plan is taken when
        # within mip_gap of that bound (deterministic, and a fraction of the branch-and-bound time);
        # otherwise it warm-starts the integer program.
        h.setOptionValue("solve_relaxation", True)
        h.setOptionValue("presolve", "off")  # on this LP presolve costs 3x the dual simplex it saves
        t_lp = time.perf_counter()
        h.run()
        status = h.getModelStatus()
        start = None
        if status == highspy.HighsModelStatus.kOptimal:
            lp = h.getSolution().col_value
            bound = h.getInfo().objective_function_value
            start = {v: max(range(len(unary[v])), key=lambda s, v=v: lp[col_of[v] + s]) for v in core}
            start = self._local_search(core, unary, factors, memory, start, budget)
            if start is not None:
                obj = sum(float(unary[v][start[v]]) for v in core) + \
                    sum(float(t[start[u], start[v]]) for (u, v), t in factors.items())
                self.report.ilp_gap = (obj - bound) / max(abs(obj), 1e-12)
                if self.report.ilp_gap <= self.opt.mip_gap:
                    self.report.ilp_rounded = True
                    for v in core:
                        choice[v] = start[v]
                    return
        if status != highspy.HighsModelStatus.kInfeasible:
            h.setOptionValue("solve_relaxation", False)
            h.setOptionValue("presolve", "choose")
            # one time limit for both solves together
            h.setOptionValue("time_limit", max(1.0, float(self.opt.time_limit_s) - (time.perf_counter() - t_lp)))
            h.changeColsIntegrality(nx, np.arange(nx, dtype=np.int32),
                                    np.array([highspy.HighsVarType.kInteger] * nx))
            if status == highspy.HighsModelStatus.kOptimal and start is not None:  # warm start
                x0 = np.zeros(n)
                for v in core:
                    x0[col_of[v] + start[v]] = 1.0
                for u, v, base, nc, rinv, cinv in classes:
                    x0[base + rinv[start[u]] * nc + cinv[start[v]]] = 1.0
                h.setSolution(n, np.arange(n, dtype=np.int32), x0)
            h.run()
            status = h.getModelStatus()
            self.report.ilp_gap = h.getInfo().mip_gap
        if status == highspy.HighsModelStatus.kInfeasible:
            raise AutoInfeasible(
                f"plan='auto': no plan meets memory_budget {_size(budget)} per rank together with the fixed "
                f"placements (sharding each parameter as far as it goes needs {_size(self.report.min_memory_bytes)},"
                f" but the fixed placements and sharding rules rule out reaching it everywhere)"
                if budget is not None else "plan='auto': the fixed placements admit no plan")
        sol = h.getSolution().col_value
        if status != highspy.HighsModelStatus.kOptimal:
            if not sol or h.getInfo().mip_gap == highspy.kHighsInf:
                raise RuntimeError(f"plan='auto': HiGHS stopped with {status} before finding a plan")
            log.warning("fxshard auto: HiGHS stopped with %s (gap %.3g); using its best plan", status,
                        h.getInfo().mip_gap)
        for v in core:
            n = len(unary[v])
            xs = sol[col_of[v]:col_of[v] + n]
            choice[v] = max(range(n), key=lambda s: xs[s])

    # ---- write back ----
    def conditional(self, v: int, choice) -> torch.Tensor:
        c = self.vars[v].unary.clone()
        for (a, b), t in self.factors.items():
            if a == v:
                c += t[:, choice[b]]
            elif b == v:
                c += t[choice[a], :]
        return c

    def apply(self, choice):
        by_node = {}
        choice = list(choice)
        for i, var in enumerate(self.vars):  # followers take their root's choice (roots are never followers)
            if var.derived is not None:
                u, maps = var.derived
                choice[i] = maps[choice[u]]
        for i, var in enumerate(self.vars):
            if var.node is None:  # a hub: the redistribute pass routes consumers through it where cheaper
                hub = self.specs[var.states[choice[i]][1][0]]
                for x in self.hub_nodes[i]:
                    info(x).extra["hub"] = hub
                continue
            ins, outs = var.states[choice[i]]
            prov = self.provenance.get(i, "auto")
            if var.derived is not None:
                prov = f"auto: follows its input ({self.vars[var.derived[0]].node.name})"
            elif len(var.states) > 1 and prov.endswith("auto"):
                cond = self.conditional(i, choice)
                order = sorted(range(len(var.states)), key=lambda s: (float(cond[s]), s))
                alt = next((s for s in order if s != choice[i] and math.isfinite(float(cond[s]))), None)
                if alt is not None:
                    a_out = var.states[alt][1]
                    a_desc = placements_str(self.specs[a_out[0]].placements) if a_out and a_out[0] >= 0 else "-"
                    a_in = ",".join(placements_str(self.specs[x].placements) for x in var.states[alt][0])
                    delta = float(cond[alt]) - float(cond[choice[i]])
                    prov = f"{prov}; runner-up {a_desc}" + (f" from {a_in}" if a_in else "") + f" +{delta:.2f} us"
            for k, n in enumerate(var.nodes):
                by_node[n] = (ins, outs, prov if k == 0 else f"{prov} (shared with {var.nodes[0].name})")
        for n in self.gm.graph.nodes:
            rec = info(n)
            if n in by_node:
                ins, outs, prov = by_node[n]
                out_specs = tuple(self.specs[o] if o >= 0 else None for o in outs)
                if n.op == "placeholder":
                    rec.spec = out_specs[0]
                else:
                    rec.input_specs = tuple(self.specs[i] for i in ins)
                    rec.spec = out_specs if isinstance(n.meta.get("val"), (tuple, list)) else out_specs[0]
                rec.provenance = prov
                if n.target == strategies.EMBEDDING:
                    w = rec.input_specs[0]
                    rec.extra["vocab_dims"] = tuple(m for m, p in enumerate(w.placements)
                                                    if isinstance(p, Shard) and p.dim == 0)
            elif n.op == "call_function" and n.target is operator.getitem:
                parent = info(n.args[0]).spec
                rec.spec = parent[n.args[1]] if isinstance(parent, tuple) else parent
                rec.provenance = "getitem"
            elif n in self.transparent:
                rec.spec = info(n.args[0]).spec
                rec.input_specs = (rec.spec,)
                rec.provenance = "passthrough"
                if n.target is BOUNDARY:
                    rec.module = n.args[1].split(":")[0]
            elif n.op == "output":
                specs = []
                for role, o in zip(self._output_roles, _flat_outputs(n)):
                    if role is None:
                        specs.append(None)
                    elif role[0] == "fixed":
                        specs.append(self.specs[role[1]])
                    elif role[0] == "like":
                        specs.append(info(self.vars[role[1]].node).spec)
                    else:
                        specs.append(_reduced(self.ann, info(o).spec, o.meta["val"]))
                rec.input_specs = tuple(specs)
                rec.provenance = "outputs (auto)"


def _size(b: float) -> str:
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(b) >= k:
            return f"{b / k:.2f} {unit}"
    return f"{b:.0f} B"


def _flat_outputs(n):
    outs = n.args[0]
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def _fake(spec: ShardingSpec):
    return torch.empty(spec.shape, dtype=spec.dtype, device="meta")


def annotate_auto(gm, mesh, constraints, *, cost_model=None, options: AutoOptions | None = None,
                  input_placements=None, output_placements=None, fuse=True, blocks=(), training=False,
                  replicate_grads=False) -> tuple[list[str], AutoReport]:
    """``annotate`` for ``plan="auto"``: every node's placement from one global solve."""
    t0 = time.perf_counter()
    p = AutoPlanner(gm, mesh, cost_model or CostModel(mesh), constraints, options or AutoOptions(),
                    input_placements, output_placements, fuse, blocks, training, replicate_grads)
    p.build()
    choice = p.solve()
    t1 = time.perf_counter()
    p.apply(choice)
    p.report.times["apply"] = time.perf_counter() - t1
    p.report.times["total"] = time.perf_counter() - t0
    log.info("fxshard: %s", p.report)
    return p.warnings, p.report


def modelled_cost(gm: fx.GraphModule, cost_model) -> dict:
    """Modelled µs of an annotated, redistributed program: every redistribution's planned cost plus
    every op's compute under its placements (the same figures ``plan="auto"`` minimises), and the
    per-rank bytes of parameters and buffers."""
    comm = compute = 0.0
    state = 0.0
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.kind == "redistribute" and rec.plan is not None:
            comm += rec.plan.cost
        elif n.op == "placeholder" and rec.kind in (PARAM, BUFFER, CONSTANT) and isinstance(rec.spec, ShardingSpec):
            state += local_bytes(rec.spec)
        elif n.op == "call_function" and rec.kind not in ("boundary", "redistribute") \
                and n.target is not operator.getitem:
            outs = rec.spec if isinstance(rec.spec, tuple) else (rec.spec,)
            compute += compute_us(n, rec.input_specs, outs, cost_model)
    return {"comm_us": comm, "compute_us": compute, "total_us": comm + compute, "state_bytes": state}


__all__ = ["AutoOptions", "AutoReport", "AutoInfeasible", "annotate_auto", "modelled_cost", "repeated_blocks"]
