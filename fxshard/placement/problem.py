"""The placement problem, defined once: what each node may be and what each choice costs.

* an op's **legal states**: the (input placements, output placements) pairs its sharding rule
  allows for these shapes (uneven shards included, in torch.chunk's layout as DTensor runs them:
  the program is then lowered per rank), kept where every output something reads is placed;
* a placeholder's **options**: what the plan, the user or the data-parallel default asks for, and
  which mesh dims are still free;
* a planned module boundary's **requirement** on the plan's mesh dim, and the placement a complete
  gradient takes (like its forward value);
* every output's **requirement**: a fixed placement, "like this parameter" (its gradient), or
  "reduced" (pending reductions finished before it is handed back);
* **costs**: redistributions priced by the planner, compute by flops and bytes of the local shards.

The greedy annotator picks the cheapest legal state per node in graph order, the global solver
(``plan="auto"``) builds its factors from the same states, and ``set_placement`` validates a hand
edit against them.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import rules
from .._torch import (
    Partial,
    Placement,
    Replicate,
    Shard,
    flop_count,
    is_strided_shard,
    tree_map,
)
from ..core.cost import CostModelLike
from ..core.mesh import MeshSpec
from ..core.spec import (
    ShardingSpec,
    has_empty_shard,
    is_even,
    local_numels,
    reshape_keeps_shards,
)
from ..ir import (
    BUFFER,
    GRAD_TAG,
    INPUT,
    KEPT_STATE,
    OWN_PLACEMENT,
    PARAM,
    STATE_KINDS,
    TANGENT,
    NodeInfo,
    NodeKind,
    NotSymbolic,
    Role,
    arg_key,
    flat_outputs,
    info,
    is_custom_op,
    output_roles,
    tensor_args,
    used_outputs,
    where,
    whole_dims,
)
from ..planner import plan_in_program
from ..rules.dtensor import given_placements_only, tied_mesh_dims
from .constraints import PlanConstraints

log = logging.getLogger("fxshard")


@dataclass(frozen=True)
class PlaceholderOptions:
    """What a placeholder is asked to be (``requested``: the plan's placement, the user's, or the
    data-parallel default), why, and the mesh dims a global solve may still choose (``free``)."""

    requested: ShardingSpec
    provenance: str
    free: tuple[int, ...]


@dataclass(frozen=True)
class OutputRequirement:
    """What one flat output must be handed back as: ``kind`` "fixed" (``spec``), "like" (the
    placement of ``placeholder``: a gradient is placed like its parameter or input) or "reduced"
    (its own placement with pending reductions finished)."""

    kind: str
    spec: ShardingSpec | None = None
    placeholder: fx.Node | None = None
    role: Role | None = None


# ops whose output is new (its shape an argument): nothing of the input's layout carries over
_FRESH_OUTPUT = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided")
)


def runs_unevenly(node: fx.Node, ins: Sequence, outs: Sequence) -> bool:
    """Whether a candidate whose shards may be uneven computes the op's value on every rank.
    Sharding rules are written for shards of one size; with torch.chunk's uneven layout two things
    break them, so such candidates are excluded for the op (never a wrong result):

    * a rank whose shard of a non-empty dim is empty (6 heads on 4 ranks: 2, 2, 2, 0): reductions
      (max, mean), pooling and kernels fail or make up a value on nothing (DTensor's rules ask for
      at least one element per shard);
    * an op keeping its bytes (a view, reshape, permute, an elementwise op, a view as another
      dtype) whose input and output shards hold different bytes on some rank: the rule assumed
      evenly divisible dims (flattening a batch of 2 split 1, 1, 0, 0 with its sequence into rows
      of ``ceil(32/4)``; 5 float columns split 3, 2 viewed as 10 bf16 ones split 5, 5);
    * a Partial(avg) output of an unevenly split input: the mean of local means is not the mean.
    """
    specs = [s for s in (*ins, *outs) if isinstance(s, ShardingSpec)]
    if all(is_even(s) for s in specs):
        return True
    if any(has_empty_shard(s) for s in specs):
        return False
    tin = [s for s in ins if isinstance(s, ShardingSpec)]
    tout = [s for s in outs if isinstance(s, ShardingSpec)]
    if any(not is_even(s) for s in tin) and any(
        isinstance(p, Partial) and p.reduce_op == "avg" for s in tout for p in s.placements
    ):
        return False
    if (
        len(tin) == 1
        and len(tout) == 1
        and node.target not in _FRESH_OUTPUT
        and _nbytes(tin[0].shape, tin[0].dtype) == _nbytes(tout[0].shape, tout[0].dtype)
        and _local_nbytes(tin[0]) != _local_nbytes(tout[0])
    ):
        return False
    return True


# row-major reshapes of one input: what a rank's view of its shard computes is checked exactly for
# strided candidates (``reshape_keeps_shards``)
_RESHAPE_OPS = frozenset(
    {
        torch.ops.aten.view.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten.view_copy.default,
    }
)


def _strided_spec(s) -> bool:
    """Whether spec ``s`` holds a strided shard (memoised on the spec)."""
    if not isinstance(s, ShardingSpec):
        return False
    hit = s.__dict__.get("_strided")
    if hit is None:
        hit = any(is_strided_shard(p) for p in s.placements)
        object.__setattr__(s, "_strided", hit)
    return hit


def tied(state, ties) -> bool:
    """Whether a state ((input specs), (output specs)) places alike on every group of mesh dims of
    one of the groupings ``ties`` (``((0, 1), (2,))``: dims 0 and 1 alike)."""
    specs = [s for side in state for s in side if isinstance(s, ShardingSpec)]
    cols = list(zip(*(s.placements for s in specs))) if specs else []
    if not cols:
        return True
    return any(all(all(cols[m] == cols[g[0]] for m in g[1:]) for g in gr) for gr in ties)


def reshapes_soundly(node: fx.Node, ins: Sequence, outs: Sequence) -> bool:
    """A reshape candidate with a strided shard on either side is kept only where every rank's
    view of its shard is its shard of the result (DTensor's view rule gets some wrong: a dim split
    in 2 strided pieces merged with a later one, ``x[4, 120].view(48, 10)``)."""
    if node.target not in _RESHAPE_OPS or not ins or not outs:
        return True
    src, dst = ins[0], outs[0]
    if not isinstance(src, ShardingSpec) or not isinstance(dst, ShardingSpec):
        return True
    if not any(is_strided_shard(p) for p in (*src.placements, *dst.placements)):
        return True
    return reshape_keeps_shards(src, dst)


def _is_zero(a) -> bool:
    """A value the graph states is 0: a Python 0, or a 0 scalar tensor / zeros factory node."""
    if isinstance(a, (bool, int, float)):
        return a == 0
    if not isinstance(a, fx.Node) or a.op != "call_function":
        return False
    aten = torch.ops.aten
    if a.target in (aten.scalar_tensor.default, aten.full.default):
        return len(a.args) > 0 and not isinstance(a.args[-1], fx.Node) and a.args[-1] == 0
    return a.target in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default)


_WHERE = frozenset({"aten::where.self", "aten::where.ScalarSelf", "aten::where.ScalarOther"})
_MASKED_FILL = frozenset({"aten::masked_fill.Scalar", "aten::masked_fill.Tensor"})


def zero_filled(node: fx.Node) -> tuple | None:
    """For a select that puts either a value or 0 (``where(c, x, 0)``, ``where(c, x, y)``,
    ``x.masked_fill(m, 0)``): per tensor input, its role: "c" (the condition), "x" (a value that
    may be Partial: the select is linear in it where the condition is replicated), "0" (a zero,
    replicated); None for other ops.  Expert outputs masked after the down projection are such
    selects: summed later, they need not be reduced first."""
    name = node.target.name() if hasattr(node.target, "name") else None
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not (val.is_floating_point() or val.is_complex()):
        return None  # a sum of bool or integer addends is not the select
    if name in _WHERE:
        cond, a, b = (list(node.args) + [None, None, None])[:3]
        if any(not isinstance(v, fx.Node) and not _is_zero(v) for v in (a, b)):
            return None  # a Python number other than 0 would be added once per rank
        roles = ["c"] + ["0" if _is_zero(v) else "x" for v in (a, b)]
        kept = [r for v, r in zip((cond, a, b), roles) if isinstance(v, fx.Node)]
        return tuple(kept) if "x" in kept else None
    if name in _MASKED_FILL:
        x, mask, value = (list(node.args) + [None, None, None])[:3]
        if not _is_zero(value):
            return None
        return ("x", "c") + (("0",) if isinstance(value, fx.Node) else ())
    return None


def _partial_selects(found: list, roles: tuple, mesh_ndim: int) -> list:
    """Candidates of a zero select with its values and output Partial(sum) on mesh dims where the
    candidate replicates everything (the condition and zeros stay replicated)."""
    extra = []
    for ins, outs in found:
        if len(ins) != len(roles) or len(outs) != 1 or outs[0] is None:
            continue
        if any(plc is None for plc in ins):
            continue
        free = [
            m
            for m in range(mesh_ndim)
            if all(isinstance(plc[m], Replicate) for plc in (*ins, outs[0]))
        ]
        for k in range(1, len(free) + 1):
            for dims in itertools.combinations(free, k):
                new_ins = tuple(
                    _partial_on(plc, dims if r == "x" else ()) for plc, r in zip(ins, roles)
                )
                extra.append((new_ins, (_partial_on(outs[0], dims),) + tuple(outs[1:])))
    return extra


def _partial_on(plc: tuple, dims) -> tuple:
    return tuple(Partial("sum") if m in dims else p for m, p in enumerate(plc))


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * (dtype.itemsize if dtype is not None else 1)


def _local_nbytes(spec: ShardingSpec) -> tuple[int, ...]:
    size = spec.dtype.itemsize if spec.dtype is not None else 1
    return tuple(n * size for n in local_numels(spec))


def shards_align(node: fx.Node, ins: Sequence) -> bool:
    """Inputs split along the same tensor dim by the same mesh dim hold matching slices only where
    that dim has one size in all of them.  DTensor's gather rule shards an input and a shorter
    index alike on a dim that is not gathered (rows 0-3 of 12 against index rows 0-1 of 6): each
    rank then gathers from rows its index does not address; such candidates are excluded.  An
    experts region splits its tokens' rows and its experts, unrelated dims 0, by design."""
    if node.target in rules.VARIANTS:
        return True
    sizes: dict[tuple[int, int], int] = {}
    for s in ins:
        if not isinstance(s, ShardingSpec):
            continue
        for d, lv in enumerate(s.levels):
            for m, _sf in lv:
                if sizes.setdefault((m, d), s.shape[d]) != s.shape[d]:
                    return False
    return True


@dataclass
class LegalStates:
    """An op's legal states and where they come from: "rule", "factory" (replicated) or
    "fallback" (no rule, or none that applies to these shapes: computed replicated, ``why``)."""

    states: list[tuple[tuple, tuple]]  # (input specs, output specs), in the rule's order
    source: str
    why: str | None = None


def _val(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x


def normalize(p: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` -> ``Shard(ndim - 1)``: placements compare equal only normalised."""
    if isinstance(p, Shard) and p.dim < 0:
        return Shard(p.dim % ndim)
    return p


def _leaf_key(v):
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), v.dtype, whole_dims(v))
    return v if isinstance(v, (int, float, bool, str, type(None), torch.dtype)) else repr(v)


def shape_key(x: object) -> object:
    """A hashable key of an op's arguments by shapes and values (repeated layers ask alike)."""
    return arg_key(x, _leaf_key)


def custom_op_error(node: fx.Node, rec: NodeInfo) -> ValueError:
    ns, name = node.target.name().split("::")
    name = name.split(".")[0]
    return ValueError(
        f"{node.target} at node {node.name}{where(rec)} is a custom op with no sharding rule; "
        "register "
        f"one, e.g. fxshard.register_rule(torch.ops.{ns}.{name}.default, [((Shard(0), ...), "
        "(Shard(0),))]) "
        f"listing per-mesh-dim (input placements, output placements), or register an all-Replicate "
        f"rule to compute it replicated"
    )


class PlacementProblem:
    """The placement problem of one graph under one plan (see the module docstring)."""

    def __init__(
        self,
        mesh: MeshSpec,
        cost_model: CostModelLike,
        constraints: PlanConstraints,
        *,
        input_placements: Sequence | None = None,
        output_placements: Sequence | None = None,
        multi_dim: bool = False,
        batch_size: int | None = None,
        replicate_grads: bool = False,
        training: bool = False,
    ):
        self.mesh = mesh
        self.cm = cost_model
        self.cons = constraints
        self.input_placements = input_placements
        self.output_placements = output_placements
        self.multi_dim = multi_dim
        self.batch_size = batch_size
        self.replicate_grads = replicate_grads
        self.training = training  # a joint graph: forward outputs handed back global
        self.rules_mesh = rules.rules_mesh(mesh.shape)
        self.warnings: list[str] = []
        # (op, source line) -> [index into warnings, nodes]: one fallback warning per place
        self._fallbacks: dict[tuple, list] = {}
        self._candidates: dict = {}
        self._legal: dict = {}  # legal_states per (op, argument shapes, input specs, used outputs)
        self._names_of: tuple | None = None  # (graph, {node name: node}), for gradient markers

    # ---- specs and costs ------------------------------------------------------------------------
    def spec(
        self, placements: Sequence, val: torch.Tensor, order: tuple | None = None, what: str = ""
    ) -> ShardingSpec:
        if isinstance(placements, ShardingSpec):  # given whole (a DTensor's, shard order kept)
            if (
                placements.shape != tuple(val.shape)
                or placements.mesh.shape != self.mesh.shape
                or placements.dtype != val.dtype
            ):
                raise ValueError(
                    f"{what or 'a value'}: the sharding {placements} is for shape "
                    f"{placements.shape} ({placements.dtype}) on mesh {placements.mesh.shape}, the "
                    f"value is {tuple(val.shape)} ({val.dtype}) on {self.mesh.shape}"
                )
            spec = placements
        else:
            placements = tuple(normalize(p, val.ndim) for p in placements)
            spec = ShardingSpec.make(
                self.mesh, placements, tuple(val.shape), val.dtype, order, what=what
            )
        whole = whole_dims(val)
        if whole and any(spec.levels[d] for d in whole):
            raise NotSymbolic(
                f"{what or 'a value'}: {spec} splits dim(s) {whole}, whose size changes between "
                "calls (dynamic shapes): a program for every size keeps them whole"
            )
        return spec

    def replicated(self, val: torch.Tensor) -> ShardingSpec:
        return self.spec([Replicate()] * self.mesh.ndim, val)

    def reduced(self, spec: ShardingSpec) -> ShardingSpec:
        """``spec`` with every partial mesh dim reduced (Partial -> Replicate)."""
        return ShardingSpec.make(
            self.mesh,
            [Replicate() if isinstance(p, Partial) else p for p in spec.placements],
            spec.shape,
            spec.dtype,
            spec.shard_order,
        )

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)
        log.warning("fxshard: %s", msg)

    def cost(self, src: ShardingSpec, dst: ShardingSpec) -> float:
        """Modelled µs of redistributing ``src`` to ``dst`` (the plan the program would run)."""
        if src.levels == dst.levels and src.placements == dst.placements:
            return 0.0
        return plan_in_program(src, dst, self.cm, fuse=self.multi_dim).cost

    # ---- ops ------------------------------------------------------------------------------------
    def _op_key(self, node: fx.Node) -> tuple:
        """What an op's rule and legality checks read of it: op, argument shapes and values,
        output shapes, which inputs are zeros (repeated layers ask alike)."""
        args = tree_map(_val, tuple(node.args))
        kwargs = tree_map(_val, dict(node.kwargs))
        return (
            node.target,
            shape_key(args),
            shape_key(kwargs),
            shape_key(node.meta.get("val")),
            zero_filled(node),
        )

    def candidates(
        self,
        node: fx.Node,
        placements: Sequence,
        op_key: tuple | None = None,
        ties=None,
        given: bool = False,
    ) -> list | str | None:
        """The sharding rule's candidates for ``node`` given its tensor inputs' ``placements``
        (memoised by op, argument shapes and placements); "factory"; None without a rule.
        ``ties``: mesh-dim groupings the enumeration keeps to (``rules.tied_mesh_dims``)."""
        op_key = op_key or self._op_key(node)
        key = (op_key, tuple(placements), ties, given)
        if key not in self._candidates:
            args = tree_map(_val, tuple(node.args))
            kwargs = tree_map(_val, dict(node.kwargs))
            zeros = op_key[-1]
            try:
                with tied_mesh_dims(ties), given_placements_only(given):
                    found = rules.candidates(node.target, args, kwargs, self.rules_mesh, placements)
            except Exception as e:  # a rule that raises is treated as no rule, loudly
                log.debug("rule for %s raised %r", node.target, e)
                found = None
            if zeros is not None and isinstance(found, list):
                found = found + _partial_selects(found, zeros, self.mesh.ndim)
            self._candidates[key] = found
        return self._candidates[key]

    def input_specs_for(self, placements: Sequence, targs: Sequence, cur: Sequence) -> tuple | None:
        """The input specs of a candidate (an input it leaves unplaced keeps ``cur``), or None where
        one is a Partial other than sum (strided shards are kept: a view that merges a sharded dim
        into an outer one gives one, eager attention's bmm takes it)."""
        if len(placements) != len(targs):
            return None  # a rule that places some inputs only would leave the rest where they are
        specs = []
        for plc, a, c in zip(placements, targs, cur):
            if plc is None:
                specs.append(c)
                continue
            if any(isinstance(p, Partial) and type(p) is not Partial for p in plc):
                return None
            specs.append(self.spec(plc, _val(a)))
        return tuple(specs)

    def legal_states(
        self,
        node: fx.Node,
        cur: Sequence[ShardingSpec],
        ties=None,
        plain: bool = False,
        given: bool = False,
    ) -> LegalStates:
        """The op's legal states; ``cur``: its tensor inputs' current specs, the placements
        DTensor's follow-the-input rules enumerate from.  A custom op without a rule is an error;
        an op whose rule allows nothing here is computed replicated (``source="fallback"``).
        ``ties`` (mesh-dim groupings, see ``tied``): only the states that place alike on every
        group of one of them, where there are any (else all).  ``plain``: the states without a
        strided shard, where there are any (else the strided ones); the candidates left out are
        never checked (a reshape's strided candidates are checked rank by rank).  ``given``:
        follow-the-input rules are asked for ``cur`` only (``rules.given_placements_only``)."""
        op_key = self._op_key(node)
        used = used_outputs(node)
        key = (op_key, tuple(cur), frozenset(used), ties, plain, given)
        hit = self._legal.get(key)
        if hit is None:
            hit = self._legal_states(node, cur, op_key, used, ties, plain, given)
            if plain and hit.source != "rule":  # no plain state is legal: the strided ones
                hit = self.legal_states(node, cur, ties, given=given)
            if ties is not None and hit.source == "rule":
                kept = [st for st in hit.states if tied(st, ties)]
                if not kept:  # nothing tied: every state (the tied enumeration may miss some)
                    kept = self.legal_states(node, cur, plain=plain, given=given).states
                hit = LegalStates(kept, hit.source, hit.why)
            self._legal[key] = hit
        return LegalStates(list(hit.states), hit.source, hit.why)

    def _legal_states(
        self, node, cur, op_key, used, ties=None, plain=False, given=False
    ) -> LegalStates:
        targs = tensor_args(node)
        out_val = node.meta.get("val")
        outs = out_val if isinstance(out_val, (tuple, list)) else (out_val,)
        cands = self.candidates(node, [s.placements for s in cur], op_key, ties, given)
        rep_out = tuple(self.replicated(v) if isinstance(v, torch.Tensor) else None for v in outs)
        if cands == "factory":
            return LegalStates(
                [(tuple(self.replicated(_val(a)) for a in targs), rep_out)], "factory"
            )
        states, seen = [], set()
        for ins, o in cands or ():
            if out_val is None and not o:
                o = (None,)  # an op that returns nothing (an assert): nothing to place
            try:
                specs = self.input_specs_for(ins, targs, cur)
                out_specs = tuple(
                    self.spec(p, v) if p is not None and isinstance(v, torch.Tensor) else None
                    for p, v in zip(o, outs)
                )
            except ValueError:
                continue
            if specs is None or len(out_specs) != len(outs):
                continue
            if plain and any(_strided_spec(x) for x in (*specs, *out_specs)):
                continue  # (a strided candidate may still be a plain one in another shard order)
            if not runs_unevenly(node, specs, out_specs) or not shards_align(node, specs):
                continue
            if not reshapes_soundly(node, specs, out_specs):
                continue
            if any(
                s is None and isinstance(v, torch.Tensor) and i in used
                for i, (s, v) in enumerate(zip(out_specs, outs))
            ):
                continue  # a read output left unplaced: its consumers have nothing to start from
            if (specs, out_specs) not in seen:
                seen.add((specs, out_specs))
                states.append((specs, out_specs))
        if cands is None and is_custom_op(node.target):
            raise custom_op_error(node, info(node))
        if states:
            return LegalStates(states, "rule")
        if not targs:  # nothing to place (a constant, a profiler call): every rank computes it
            return LegalStates([((), rep_out)], "factory")
        why = "has no sharding rule" if not cands else "has no sharding for these shapes"
        return LegalStates(
            [(tuple(self.replicated(_val(a)) for a in targs), rep_out)], "fallback", why
        )

    def fallback_warning(self, node: fx.Node, why: str) -> str:
        return (
            f"{node.target} at node {node.name}{where(info(node))} {why}; computing it replicated"
        )

    def warn_fallback(self, node: fx.Node, why: str, inputs: Sequence[ShardingSpec]) -> None:
        """Warn that ``node`` runs replicated, unless its inputs are replicated already (it then
        costs nothing), once per op and source line (later nodes are counted in that warning)."""
        if all(all(isinstance(p, Replicate) for p in s.placements) for s in inputs if s):
            return
        key = (node.target, info(node).source, why)
        seen = self._fallbacks.get(key)
        if seen is None:  # logged once; the warnings list (explain) counts the later nodes
            text = self.fallback_warning(node, why)
            self._fallbacks[key] = [len(self.warnings), 1, text]
            self.warn(text)
            return
        seen[1] += 1
        self.warnings[seen[0]] = f"{seen[2]} (and {seen[1] - 1} more nodes there)"

    # ---- placeholders ---------------------------------------------------------------------------
    def data_parallel(self, val: torch.Tensor) -> list:
        """Data-parallel default for a graph input: batch (dim 0) sharded on every non-plan mesh
        dim, unevenly where it does not divide (a last batch of 3 on 2 ranks: 2 and 1), but not
        onto ranks that would get no sample (a batch of 1 stays replicated)."""
        out = [Replicate()] * self.mesh.ndim
        if self.cons.dim is None:  # no plan: inputs not given (None entries too) are replicated
            return out
        for m in range(self.mesh.ndim):
            if m == self.cons.dim:
                continue
            if self.batch_size is not None and (val.ndim == 0 or val.shape[0] != self.batch_size):
                break
            if val.ndim >= 1:
                more = list(out)
                more[m] = Shard(0)
                if not has_empty_shard(self.spec(more, val)):
                    out = more
        return out

    def state_options(self, fqn: str, val: torch.Tensor) -> PlaceholderOptions:
        """A parameter / buffer / constant: the plan's placement on the plan dim (the other dims
        free), replicated where the plan says nothing (every dim free)."""
        want = self.cons.params.get(fqn)
        every = tuple(range(self.mesh.ndim))
        if want is None:
            return PlaceholderOptions(self.replicated(val), "replicated (no plan entry)", every)
        pl = [Replicate()] * self.mesh.ndim
        pl[self.cons.dim] = normalize(want[0], val.ndim)
        spec = self.spec(pl, val, what=f"parameter {fqn}")
        return PlaceholderOptions(spec, want[1], tuple(m for m in every if m != self.cons.dim))

    def kept_state(self, node: fx.Node) -> bool:
        """Whether a placeholder is a plain input kept sharded between calls (``KEPT_STATE``): a
        global solve places it like an op's output."""
        rec = info(node)
        return rec.kind == INPUT and self._given_input(rec.input_index) is KEPT_STATE

    def _given_input(self, i: int):
        given = self.input_placements
        return given[i] if given is not None and i < len(given) else None

    def placeholder_options(self, node: fx.Node) -> PlaceholderOptions:
        rec, val = info(node), node.meta["val"]
        every = tuple(range(self.mesh.ndim))
        if rec.kind in STATE_KINDS:
            return self.state_options(rec.fqn, val)
        # an incoming gradient, placed like its output (replicated by default)
        if rec.kind == TANGENT:
            i = rec.output_index
            given = (
                self.output_placements[i]
                if self.output_placements is not None and i < len(self.output_placements)
                else None
            )
            if given is OWN_PLACEMENT:
                given = None
            return PlaceholderOptions(
                self.spec(given if given is not None else [Replicate()] * self.mesh.ndim, val),
                f"gradient of output {i}",
                (),
            )
        assert rec.kind == INPUT
        i = rec.input_index
        if self.input_placements is not None:
            if i >= len(self.input_placements):
                raise ValueError(
                    f"input_placements has {len(self.input_placements)} entries, but the program "
                    f"takes input {i} ({node.name})"
                )
            given = self.input_placements[i]
            if isinstance(given, ShardingSpec):  # a DTensor argument's own spec, shard order kept
                spec = self.spec(given, val, what=f"input {i} ({node.name})")
                return PlaceholderOptions(spec, f"DTensor input {i}", ())
            if given is not None and given is not KEPT_STATE:  # None, KEPT_STATE: the default below
                return PlaceholderOptions(
                    self.spec(given, val, what=f"input_placements[{i}]"),
                    f"input_placements[{i}]",
                    (),
                )
        pl = self.data_parallel(val)
        hint = None
        for user in node.users:
            if info(user).tag in self.cons.input_hints:
                hint = self.cons.input_hints[info(user).tag]
        if hint is not None and self.cons.dim is not None:
            pl[self.cons.dim] = hint
        return PlaceholderOptions(
            self.spec(pl, val, what=f"input {i}"),
            "input (plan hint)" if hint is not None else "input (data parallel)",
            every,
        )

    def even_options(self, val: torch.Tensor, fixed: dict | None = None) -> list[ShardingSpec]:
        """Every even (Replicate | Shard(d)) placement per mesh dim, default shard order, with the
        mesh dims of ``fixed`` ({mesh dim: placement}) as given; where none is even (``fixed``
        itself splits a dim unevenly), every such placement, uneven ones included."""
        per_dim = []
        for m in range(self.mesh.ndim):
            if fixed and m in fixed:
                per_dim.append([fixed[m]])
            else:
                per_dim.append([Replicate()] + [Shard(d) for d in range(val.ndim)])
        out = []
        for plc in itertools.product(*per_dim):
            try:
                out.append(self.spec(plc, val))
            except ValueError:
                continue
        even = [s for s in out if is_even(s)]
        return even or out

    # ---- boundaries -----------------------------------------------------------------------------
    def boundary_requirement(self, node: fx.Node) -> tuple[object, str] | None:
        """(placement on the plan dim, plan entry) a module boundary asks for; None for a
        passthrough (no plan entry, or a gradient marker)."""
        tag = info(node).tag
        if tag.startswith(GRAD_TAG):
            return None
        want = self.cons.boundaries.get(tag)
        return None if want is None or want[0] is None else want

    def forward_value(self, node: fx.Node) -> fx.Node | None:
        """The forward node a gradient marker's value is the complete gradient of."""
        tag = info(node).tag if info(node).kind == NodeKind.BOUNDARY else ""
        if not tag.startswith(GRAD_TAG):
            return None
        graph = node.graph
        if self._names_of is None or self._names_of[0] is not graph:
            self._names_of = (graph, {n.name: n for n in graph.nodes})
        return self._names_of[1].get(tag[len(GRAD_TAG) :])

    def gradient_target(self, node: fx.Node) -> ShardingSpec | None:
        """The spec a gradient marker asks for: its forward value's, reduced (Megatron-style: the
        complete gradient is placed like the value).  None: not a gradient marker, or its value
        has no such spec."""
        fwd = self.forward_value(node)
        spec = info(fwd).spec if fwd is not None else None
        if not isinstance(spec, ShardingSpec) or spec.shape != tuple(node.meta["val"].shape):
            return None
        return self.reduced(spec)

    # ---- outputs --------------------------------------------------------------------------------
    def output_requirements(self, output: fx.Node) -> list[OutputRequirement | None]:
        """What every flat output must be handed back as (None for an output that is no value)."""
        roles = output_roles(output)
        placeholders = {}
        for p in output.graph.nodes:
            if p.op == "placeholder":
                r = info(p)
                if r.kind in (PARAM, BUFFER):
                    for name in (r.fqn, *r.aliases):
                        placeholders[Role("grad_param", name)] = p
                        placeholders[Role("mutate", name)] = p
                elif r.kind == INPUT:
                    placeholders[Role("grad_input", r.input_index)] = p
                    placeholders[Role("mutate_input", r.input_index)] = p
        out = []
        for i, o in enumerate(flat_outputs(output)):
            if not isinstance(o, fx.Node):
                out.append(None)
                continue
            role = Role(*roles[i]) if i < len(roles) else Role("output", i)
            val = o.meta["val"]
            if role.kind == "mutate" and not self.replicate_grads:
                # a parameter / buffer updated in place: placed like it (the backend wants its
                # global value back, as it does gradients)
                out.append(OutputRequirement("like", None, placeholders[role], role))
                continue
            if role.kind == "mutate_input":
                # a user input updated in place (a static KV cache): a DTensor input's new local
                # shard is written into it (the cache stays sharded between calls); a plain
                # (global) input gets its new global value
                given = self._given_input(role.what)
                if given is KEPT_STATE and role in placeholders:
                    # state kept sharded between calls: handed back in the placement it came in
                    out.append(OutputRequirement("like", None, placeholders[role], role))
                    continue
                spec = given if isinstance(given, ShardingSpec) else self.replicated(val)
                out.append(OutputRequirement("fixed", spec, placeholders.get(role), role))
                continue
            # a DTensor input's gradient: placed like it, partial dims reduced (its to_local()'s
            # backward labels the gradient so: a Partial input's gradient is the whole gradient)
            given = self._given_input(role.what) if role.kind == "grad_input" else None
            if isinstance(given, ShardingSpec):
                out.append(
                    OutputRequirement("fixed", self.reduced(given), placeholders.get(role), role)
                )
                continue
            # a gradient: like its parameter / input, or handed back global
            if role.kind != "output":
                if self.replicate_grads or role not in placeholders:
                    out.append(
                        OutputRequirement(
                            "fixed", self.replicated(val), placeholders.get(role), role
                        )
                    )
                else:
                    out.append(OutputRequirement("like", None, placeholders[role], role))
                continue
            k = role.what
            given = (
                self.output_placements[k]
                if self.output_placements is not None and k < len(self.output_placements)
                else None
            )
            if given is OWN_PLACEMENT:
                out.append(OutputRequirement("reduced", role=role))
            elif given is not None:
                out.append(
                    OutputRequirement(
                        "fixed", self.spec(given, val, what=f"output_placements[{k}]"), role=role
                    )
                )
            # training hands back global values: its incoming gradient is replicated too
            elif self.training:
                out.append(OutputRequirement("fixed", self.replicated(val), role=role))
            else:  # hand back usable values: finish pending reductions
                out.append(OutputRequirement("reduced", role=role))
        return out


# ---- the objective -------------------------------------------------------------------------------


def local_bytes(spec: ShardingSpec) -> float:
    return spec.nbytes / spec.num_shards


def compute_us(node: fx.Node, in_specs: Sequence, out_specs: Sequence, cm: CostModelLike) -> float:
    """Modelled µs of ``node`` under a strategy: its flops split over the mesh dims that shard an
    input (a contraction split over ranks leaves Partial outputs), plus the local bytes it reads and
    writes (Partial values are full size).  One state of ``compute_us_states``."""
    ins = [s for s in in_specs if isinstance(s, ShardingSpec)]
    outs = [s for s in out_specs if isinstance(s, ShardingSpec)]
    state = (range(len(ins)), range(len(ins), len(ins) + len(outs)))
    return compute_us_states(node, [state], ins + outs, {}, cm, in_specs=[in_specs])[0]


def compute_us_states(
    node: fx.Node,
    states: Sequence,
    specs: Sequence,
    terms: dict,
    cm: CostModelLike,
    in_specs: Sequence | None = None,
) -> list[float]:
    """``compute_us`` of ``node`` under each of ``states`` (``(input spec ids, output spec ids)``
    into ``specs``, -1 for an output left unplaced), with each spec's local bytes and sharded mesh
    dims looked up once in ``terms`` (a cache kept by the caller across nodes): ``plan="auto"``
    asks for every state of every op (115k for a LLaMA-3-8B on a 4x4x4 mesh).  ``in_specs``: each
    state's inputs as given (the expert ops' dispatch term reads them by position)."""
    rec = info(node)
    if rec.flops is None:
        rec.flops = flop_count(node)
    flops_us, bytes_us = getattr(cm, "flops_per_us", None), getattr(cm, "hbm_bytes_per_us", None)
    if not flops_us or not bytes_us:
        return [0.0] * len(states)

    def term(i):
        t = terms.get(i)
        if t is None:
            s = specs[i]
            mask = sum(1 << m for m, p in enumerate(s.placements) if isinstance(p, Shard))
            t = terms[i] = (local_bytes(s), mask, s.mesh.shape)
        return t

    out = []
    splits: dict = {}
    for k, (ins, outs) in enumerate(states):
        mask, moved, shape = 0, 0, None
        for i in ins:
            lb, m, shape = term(i)
            mask |= m
            moved += lb
        for i in outs:
            if i >= 0:
                moved += term(i)[0]
        split = splits.get(mask)
        if split is None:
            split = splits[mask] = math.prod(n for m, n in enumerate(shape or ()) if mask >> m & 1)
        dispatch = 0.0
        if node.target in rules.VARIANTS:
            given = in_specs[k] if in_specs is not None else [specs[i] for i in ins]
            dispatch = _dispatch_us(node, given, cm)
        out.append(rec.flops / split / flops_us + moved / bytes_us + dispatch)
    return out


def _dispatch_us(node: fx.Node, in_specs: Sequence, cm: CostModelLike) -> float:
    """The all-to-alls inside an experts region that dispatches tokens (``rules.experts``)."""
    if node.target not in rules.VARIANTS:
        return 0.0
    backward = node.target is rules.MOE_EXPERTS_BACKWARD
    n_tok = 4 if backward else 3
    x, idx, w, params = in_specs[n_tok - 3 : n_tok + 1]
    for m, (a, b) in enumerate(zip(x.placements, params.placements)):
        if isinstance(a, Shard) and isinstance(b, Shard):
            first = (0,) * len(x.placements)  # the largest shard (torch.chunk's layout)
            local = [
                torch.empty(s.local_shape(first), dtype=s.dtype, device="meta") for s in (x, idx, w)
            ]
            steps = rules.dispatch_steps(backward, *local, params.shape[0])
            return sum(cm.collective("all_to_all", (m,), b) for _, b in steps)
    return 0.0


def modelled_cost(gm: fx.GraphModule, cost_model: CostModelLike) -> dict:
    """Modelled µs of an annotated, redistributed program: every redistribution's planned cost plus
    every op's compute under its placements (the same figures ``plan="auto"`` minimises), and the
    per-rank bytes of parameters and buffers."""
    comm = compute = 0.0
    state = 0.0
    for n in gm.graph.nodes:
        rec = info(n)
        if rec.kind == NodeKind.REDISTRIBUTE and rec.plan is not None:
            comm += rec.plan.cost
        elif (
            n.op == "placeholder" and rec.kind in STATE_KINDS and isinstance(rec.spec, ShardingSpec)
        ):
            state += local_bytes(rec.spec)
        elif (
            n.op == "call_function"
            and rec.kind not in (NodeKind.BOUNDARY, NodeKind.REDISTRIBUTE)
            and n.target is not operator.getitem
        ):
            outs = rec.spec if isinstance(rec.spec, tuple) else (rec.spec,)
            compute += compute_us(n, rec.input_specs, outs, cost_model)
    return {
        "comm_us": comm,
        "compute_us": compute,
        "total_us": comm + compute,
        "state_bytes": state,
    }
