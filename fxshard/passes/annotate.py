"""annotate: give every node its output placements, the input placements its strategy needs, and
the reason (provenance).

Fixed placements come first: parameters from the plan (replicated otherwise), graph inputs from
explicit ``input_placements`` or the plan's hints (data-parallel mesh dims shard the batch), module
boundaries from the plan.  Every other op takes, among the candidates its sharding rule allows, the
one with the least total redistribution cost from its producers' placements (planner costs); ties go
to the candidate that changes fewer inputs.  Only even shardings are accepted, so one per-rank graph
serves every rank.  An op without a rule is computed replicated, with a logged warning that names
the op, the node and its source line.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

import torch
import torch.fx as fx

from .. import strategies
from ..adapter import Partial, Replicate, Shard, is_strided_shard
from ..cost import CostModel
from ..mesh import MeshSpec
from ..planner import plan_between
from ..plans import PlanConstraints
from ..spec import ShardingSpec, level_positions, placements_str
from .capture import BUFFER, CONSTANT, GRAD_TAG, INPUT, PARAM, TANGENT, info

log = logging.getLogger("fxshard")


def is_even(spec: ShardingSpec) -> bool:
    """Every level splits its extent exactly (the rank-agnostic lowering needs it)."""
    for n, lv in zip(spec.shape, spec.levels):
        e = n
        for m, sf in lv:
            k = spec.mesh.shape[m]
            if e % (k * sf):
                return False
            e = len(level_positions(e, k, sf)[0])
    return True


def flat_args(x, out: list | None = None) -> list:
    """Leaves of nested lists / tuples / dicts in ``tree_flatten`` order (FX arguments hold only
    those containers; pytree's general machinery is the slow part of a pass over a large graph)."""
    out = [] if out is None else out
    if isinstance(x, (list, tuple)):
        for y in x:
            flat_args(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            flat_args(y, out)
    else:
        out.append(x)
    return out


def arg_key(x, leaf):
    """A hashable key of nested arguments: containers by type and length, leaves through ``leaf``."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(arg_key(y, leaf) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, arg_key(y, leaf)) for k, y in x.items()))
    return leaf(x)


def used_outputs(node: fx.Node) -> set[int]:
    """Indices of the node's outputs something reads (getitem users of a multi-output op)."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return {u.args[1] for u in node.users if u.target is operator.getitem}
    return {0} if node.users else set()


def leaves_used_output_unplaced(used: set[int], out_specs, outs) -> bool:
    """A rule that gives a read tensor output no placement leaves its consumers nothing to start from."""
    return any(s is None and isinstance(v, torch.Tensor) and i in used
               for i, (s, v) in enumerate(zip(out_specs, outs)))


def tensor_args(node: fx.Node) -> list[fx.Node | None]:
    """The node's tensor inputs in tree_flatten order of (args, kwargs) (what the rules count)."""
    leaves = flat_args(node.args)
    flat_args(node.kwargs, leaves)
    return [a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _val(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x


def _normalize(p, ndim):
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim % ndim)
    return p


def _where(rec) -> str:
    where = f" at {rec.source}" if rec.source else ""
    code = f" ({rec.code})" if rec.code else ""
    return where + code


def state_spec(mesh, cons, fqn: str, shape: tuple, dtype) -> tuple[ShardingSpec, str, str | None]:
    """(spec, provenance, warning) of a parameter / buffer: the plan's placement on the plan dim,
    replicated otherwise (and where the plan's placement does not divide the shape evenly)."""
    want = cons.params.get(fqn)
    pl = [Replicate()] * mesh.ndim
    if want is not None:
        pl[cons.dim] = _normalize(want[0], len(shape))
        spec = ShardingSpec.make(mesh, tuple(pl), shape, dtype, what=f"parameter {fqn}")
        if is_even(spec):
            return spec, want[1], None
        warning = (f"{want[1]} asks for {placements_str(spec.placements)} on {fqn} of shape {shape}, which mesh "
                   f"{mesh.shape} does not divide evenly; keeping {fqn} replicated")
        return ShardingSpec.make(mesh, (Replicate(),) * mesh.ndim, shape, dtype), \
            f"replicated (indivisible for {want[1]})", warning
    return ShardingSpec.make(mesh, tuple(pl), shape, dtype), "replicated (no plan entry)", None


class Annotator:
    def __init__(self, mesh: MeshSpec, cost_model: CostModel, constraints: PlanConstraints,
                 input_placements: Sequence | None, output_placements: Sequence | None, fuse: bool = False):
        self.mesh = mesh
        self.cm = cost_model
        self.fuse = fuse
        self.cons = constraints
        self.input_placements = input_placements
        self.output_placements = output_placements
        self.rules_mesh = strategies.rules_mesh(mesh.shape)
        self.warnings: list[str] = []
        self._cand_cache: dict = {}
        self._decisions: dict = {}
        self.batch_size: int | None = None  # when known, only inputs with this leading size are batch-sharded
        self.replicate_grads = False  # joint graphs: hand back global gradients (the torch.compile backend)

    # ---- helpers ----------------------------------------------------------------------------------
    def spec(self, placements, val: torch.Tensor, order=None, what="") -> ShardingSpec:
        placements = tuple(_normalize(p, val.ndim) for p in placements)
        return ShardingSpec.make(self.mesh, placements, tuple(val.shape), val.dtype, order, what=what)

    def warn(self, msg: str):
        self.warnings.append(msg)
        log.warning("fxshard: %s", msg)

    def cost(self, src: ShardingSpec, dst: ShardingSpec) -> float:
        if src.levels == dst.levels and src.placements == dst.placements:
            return 0.0
        return plan_between(src, dst, self.cm, even_only=True, fuse=self.fuse).cost

    def dp_default(self, val) -> list:
        """Data-parallel default for a graph input: batch (dim 0) sharded on every non-plan mesh dim."""
        out = [Replicate()] * self.mesh.ndim
        if self.cons.dim is None and self.input_placements is None:
            return out
        shards = 1
        for m in range(self.mesh.ndim):
            if m == self.cons.dim:
                continue
            k = self.mesh.shape[m]
            if self.batch_size is not None and (val.ndim == 0 or val.shape[0] != self.batch_size):
                break
            if val.ndim >= 1 and val.shape[0] % (shards * k) == 0:
                out[m] = Shard(0)
                shards *= k
        return out

    # ---- per node kind ---------------------------------------------------------------------------
    def placeholder(self, node):
        rec = info(node)
        val = node.meta["val"]
        if rec.kind in (PARAM, BUFFER, CONSTANT):
            rec.spec, rec.provenance, warning = state_spec(self.mesh, self.cons, rec.fqn, tuple(val.shape), val.dtype)
            if warning:
                self.warn(warning)
            return
        if rec.kind == TANGENT:  # an incoming gradient, placed like its output (replicated by default)
            i = rec.input_index
            given = self.output_placements[i] if self.output_placements is not None and \
                i < len(self.output_placements) else None
            rec.spec = self.spec(given if given is not None else [Replicate()] * self.mesh.ndim, val)
            rec.provenance = f"gradient of output {i}"
            return
        assert rec.kind == INPUT
        i = rec.input_index
        if self.input_placements is not None:
            if i >= len(self.input_placements):
                raise ValueError(f"input_placements has {len(self.input_placements)} entries, but the program "
                                 f"takes input {i} ({node.name})")
            rec.spec = self.spec(self.input_placements[i], val, what=f"input_placements[{i}]")
            rec.provenance = f"input_placements[{i}]"
        else:
            pl = self.dp_default(val)
            hint = None
            for user in node.users:
                tag = info(user).extra.get("tag")
                if tag in self.cons.input_hints:
                    hint = self.cons.input_hints[tag]
            if hint is not None and self.cons.dim is not None:
                pl[self.cons.dim] = hint
            rec.spec = self.spec(pl, val, what=f"input {i}")
            rec.provenance = "input (plan hint)" if hint is not None else "input (data parallel)"
        if not is_even(rec.spec):
            self.warn(f"input {i} ({node.name}) of shape {tuple(val.shape)} does not divide evenly as "
                      f"{rec.spec}; replicating it")
            rec.spec = self.spec([Replicate()] * self.mesh.ndim, val)
            rec.provenance += " -> replicated (indivisible)"

    def boundary(self, node):
        rec = info(node)
        src = info(node.args[0]).spec
        tag = rec.extra["tag"]
        if tag.startswith(GRAD_TAG):
            return self.gradient_boundary(node, rec, src, tag[len(GRAD_TAG):])
        want = self.cons.boundaries.get(tag)
        rec.module = tag.split(":")[0]
        if want is None or want[0] is None:
            rec.spec, rec.provenance = src, "passthrough"
        else:
            pl = list(src.placements)
            pl[self.cons.dim] = want[0]
            # the other mesh dims keep what the value has, but only the plan dim may shard a tensor dim
            # twice if it already was sharded there: drop clashing shards on other dims
            spec = self.spec(pl, node.meta["val"], what=f"{want[1]} ({tag})")
            if is_even(spec):
                rec.spec, rec.provenance = spec, f"{want[1]} ({tag.split(':', 1)[1]})"
            else:
                self.warn(f"{want[1]}: {tag} wants {spec}, which does not divide shape "
                          f"{tuple(node.meta['val'].shape)} evenly; leaving it as {src}")
                rec.spec, rec.provenance = src, "passthrough (indivisible)"
        rec.input_specs = (rec.spec,)

    def gradient_boundary(self, node, rec, src, forward_name):
        """The gradient of a forward value, once complete (all contributions summed): placed like the
        value itself (Partial -> Replicate), which is what Megatron-style backward passes do.  Partial
        gradients meeting at one value are summed before this one reduction."""
        want = self.gradient_target(node)
        if want is None:
            rec.spec, rec.provenance = src, "gradient (passthrough)"
        else:
            rec.spec, rec.provenance = want, f"gradient of {forward_name}: placed like it"
        rec.input_specs = (rec.spec,)

    def gradient_target(self, node) -> ShardingSpec | None:
        """The spec a gradient boundary asks for (None: ``node`` is not one, or its value has none)."""
        rec = info(node)
        tag = rec.extra.get("tag", "") if rec.kind == "boundary" else ""
        if not tag.startswith(GRAD_TAG):
            return None
        fwd = self._by_name(node.graph).get(tag[len(GRAD_TAG):])
        spec = info(fwd).spec if fwd is not None else None
        if not isinstance(spec, ShardingSpec) or spec.shape != tuple(node.meta["val"].shape):
            return None
        return self.spec([Replicate() if isinstance(p, Partial) else p for p in spec.placements],
                         node.meta["val"], spec.shard_order)

    def _by_name(self, graph):
        if getattr(self, "_names_of", None) is None or self._names_of[0] is not graph:
            self._names_of = (graph, {n.name: n for n in graph.nodes})
        return self._names_of[1]

    def getitem(self, node):
        rec = info(node)
        parent = info(node.args[0]).spec
        rec.spec = parent[node.args[1]] if isinstance(parent, tuple) else parent
        rec.provenance = "getitem"

    def op(self, node):
        rec = info(node)
        targs = tensor_args(node)
        cur = [info(a).spec for a in targs]
        out_val = node.meta.get("val")
        outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
        # Repeated layers ask the same question: same op, shapes, arguments and input placements.
        args = torch.utils._pytree.tree_map(_val, tuple(node.args))
        kwargs = torch.utils._pytree.tree_map(_val, dict(node.kwargs))
        # one step of lookahead: a consumer that is a gradient boundary will ask for its target
        targets = tuple(t for t in (self.gradient_target(u) for u in node.users) if t is not None)
        key = (node.target, _shape_key(args), _shape_key(kwargs), tuple(cur), targets)
        hit = self._decisions.get(key)
        if hit is not None:
            rec.input_specs, rec.spec, rec.provenance, vocab, why = hit
            if vocab is not None:
                rec.extra["vocab_dims"] = vocab
            if why:
                self.warn(f"{node.target} at node {node.name}{_where(rec)} {why}; computing it replicated")
            return
        why = self._decide(node, rec, targs, cur, outs, out_val, targets)
        self._decisions[key] = (rec.input_specs, rec.spec, rec.provenance, rec.extra.get("vocab_dims"), why)

    def _decide(self, node, rec, targs, cur, outs, out_val, targets=()):
        cands = self.candidates(node, cur)
        if cands == "factory":
            rec.spec = self.spec([Replicate()] * self.mesh.ndim, out_val)
            rec.input_specs = ()
            rec.provenance = "factory: replicated"
            return None
        best = None
        if cands:
            used = used_outputs(node)
            for ins, o in cands:
                try:
                    specs = self._specs_for(ins, targs, cur)
                    out_specs = tuple(self.spec(p, v) if p is not None and isinstance(v, torch.Tensor) else None
                                      for p, v in zip(o, outs))
                except ValueError:
                    continue
                if specs is None or len(out_specs) != len(outs):
                    continue
                if not all(s is None or is_even(s) for s in out_specs):
                    continue
                if leaves_used_output_unplaced(used, out_specs, outs):
                    continue
                c = sum(self.cost(a, b) for a, b in zip(cur, specs))
                if targets and out_specs and out_specs[0] is not None:
                    c += sum(self.cost(out_specs[0], t) for t in targets if t.shape == out_specs[0].shape)
                changed = sum(a.placements != b.placements or a.levels != b.levels for a, b in zip(cur, specs))
                key = (round(c, 9), changed)
                if best is None or key < best[0]:
                    best = (key, specs, out_specs)
        why = None
        if cands is None and _is_custom_op(node.target):
            raise custom_op_error(node, rec)
        if best is None:
            why = "has no sharding rule" if not cands else "has no even sharding for these shapes"
            self.warn(f"{node.target} at node {node.name}{_where(rec)} {why}; computing it replicated")
            rep = tuple(self.spec([Replicate()] * self.mesh.ndim, _val(a)) for a in targs)
            out_specs = tuple(self.spec([Replicate()] * self.mesh.ndim, v) if isinstance(v, torch.Tensor)
                              else None for v in outs)
            best = ((0, 0), rep, out_specs)
            rec.provenance = "fallback: replicated (no rule)"
        else:
            rec.provenance = "rule" if best[0][0] == 0 else f"rule (min redistribution {best[0][0]:.2f} us)"
        _, specs, out_specs = best
        rec.input_specs = specs
        rec.spec = out_specs if isinstance(out_val, (tuple, list)) else out_specs[0]
        if node.target == strategies.EMBEDDING:
            w = specs[0]
            rec.extra["vocab_dims"] = tuple(m for m, p in enumerate(w.placements)
                                            if isinstance(p, Shard) and p.dim == 0)
        return why

    def _specs_for(self, ins, targs, cur):
        specs = []
        for plc, a, c in zip(ins, targs, cur):
            if plc is None:
                specs.append(c)
                continue
            if any(is_strided_shard(p) or (isinstance(p, Partial) and type(p) is not Partial) for p in plc):
                return None
            s = self.spec(plc, _val(a))
            if not is_even(s):
                return None
            specs.append(s)
        return tuple(specs)

    def candidates(self, node, cur):
        args = torch.utils._pytree.tree_map(_val, tuple(node.args))
        kwargs = torch.utils._pytree.tree_map(_val, dict(node.kwargs))
        placements = [s.placements for s in cur]
        key = (node.target, _shape_key(args), _shape_key(kwargs), tuple(placements))
        if key not in self._cand_cache:
            try:
                self._cand_cache[key] = strategies.candidates(node.target, args, kwargs, self.rules_mesh, placements)
            except Exception as e:  # a rule that raises is treated as no rule, loudly
                log.debug("rule for %s raised %r", node.target, e)
                self._cand_cache[key] = None
        return self._cand_cache[key]

    def output(self, node):
        rec = info(node)
        outs = node.args[0]
        flat = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        specs = []
        # joint graphs: a parameter's gradient is placed like the parameter, an input's like the input
        joint = bool(rec.extra.get("outputs"))
        roles = rec.extra.get("outputs") or [("output", i) for i in range(len(flat))]
        placeholders = {}
        for p in node.graph.nodes:
            if p.op == "placeholder":
                r = info(p)
                if r.kind in (PARAM, BUFFER):
                    placeholders[("grad_param", r.fqn)] = r.spec
                elif r.kind == INPUT:
                    placeholders[("grad_input", r.input_index)] = r.spec
        for i, o in enumerate(flat):
            if not isinstance(o, fx.Node):
                specs.append(None)
                continue
            cur = info(o).spec
            role = tuple(roles[i]) if i < len(roles) else ("output", i)
            if role[0] != "output":
                if self.replicate_grads or role not in placeholders:  # global gradients (the backend)
                    specs.append(self.spec([Replicate()] * self.mesh.ndim, o.meta["val"]))
                else:
                    specs.append(placeholders[role])
                continue
            i = role[1]
            if joint and (self.output_placements is None or i >= len(self.output_placements)
                          or self.output_placements[i] is None):
                # training hands back global values: its incoming gradient (tangent) is replicated too
                specs.append(self.spec([Replicate()] * self.mesh.ndim, o.meta["val"]))
                continue
            if self.output_placements is not None and i < len(self.output_placements) \
                    and self.output_placements[i] is not None:
                specs.append(self.spec(self.output_placements[i], o.meta["val"], what=f"output_placements[{i}]"))
            else:  # hand back usable values: finish pending reductions
                specs.append(self.spec([Replicate() if isinstance(p, Partial) else p for p in cur.placements],
                                       o.meta["val"]))
        rec.input_specs = tuple(specs)
        rec.provenance = "output_placements" if self.output_placements is not None else "outputs (reduced)"


def custom_op_error(node, rec) -> ValueError:
    ns, name = node.target.name().split("::")
    name = name.split(".")[0]
    return ValueError(
        f"{node.target} at node {node.name}{_where(rec)} is a custom op with no sharding rule; register "
        f"one, e.g. fxshard.register_rule(torch.ops.{ns}.{name}.default, [((Shard(0), ...), (Shard(0),))]) "
        f"listing per-mesh-dim (input placements, output placements), or register an all-Replicate "
        f"rule to compute it replicated")


def _is_custom_op(op) -> bool:
    name = getattr(op, "name", None)
    if not callable(name):
        return False
    return name().split("::")[0] not in ("aten", "prims", "fxshard")


def _leaf_key(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype)
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)


def _shape_key(x):
    return arg_key(x, _leaf_key)


def annotate(gm: fx.GraphModule, mesh: MeshSpec, constraints: PlanConstraints, *, cost_model: CostModel | None = None,
             input_placements=None, output_placements=None, fuse: bool = False,
             batch_size: int | None = None, replicate_grads: bool = False) -> list[str]:
    """Fill ``node.meta["fxshard"]`` with placements for every node; returns the warnings.

    ``batch_size``: data-parallel mesh dims shard only inputs of this leading size (default: every
    input's dim 0 where it divides)."""
    a = Annotator(mesh, cost_model or CostModel(mesh), constraints, input_placements, output_placements, fuse)
    a.batch_size = batch_size
    a.replicate_grads = replicate_grads
    for node in gm.graph.nodes:
        rec = info(node)
        if node.op == "placeholder":
            a.placeholder(node)
        elif node.op == "output":
            a.output(node)
        elif rec.kind == "boundary":
            a.boundary(node)
        elif node.target is operator.getitem:
            a.getitem(node)
        elif node.op == "call_function":
            a.op(node)
        else:
            raise NotImplementedError(f"fxshard.annotate: node {node.name} ({node.op}) is not supported")
    return a.warnings
