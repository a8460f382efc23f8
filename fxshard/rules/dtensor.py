"""DTensor's op sharding rules, enumerated: every candidate (input placements, output placements).

The one adapter to DTensor's rules (``ShardingPropagator``'s single-dim strategies, strategy
functions, decomposition-based strategies and legacy rules); DTensor's private APIs are used here
and in ``fxshard/_torch.py``, nowhere else.  DTensor's own dispatch returns only the cheapest choice
for given input placements, and fills its per-mesh-dim templates only with shard types already
present on the inputs; fxshard wants *every* candidate, so enumeration seeds the templates (always
Shard) and calls "follow-the-input" strategy functions once per seed placement of the inputs.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
from collections.abc import Sequence

import torch
import torch.distributed.tensor._ops  # noqa: F401  (registers all strategies)
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import (
    _fill_single_dim_strategy_placeholders,
    _get_num_tensor_inputs,
    _insert_single_dim_replication_strategy,
)
from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, is_tensor_shardable
from torch.distributed.tensor.placement_types import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
)
from torch.utils._pytree import tree_flatten, tree_map

_SP = DTensor._op_dispatcher.sharding_propagator
log = logging.getLogger("fxshard")
Plc = tuple[Placement, ...]
Candidate = tuple[tuple[Plc | None, ...], tuple[Plc | None, ...]]


def _spec_schema(op, args, kwargs, mesh, placements) -> OpSchema:
    it = iter(placements)  # tensors in tree_flatten order of (args, kwargs)
    conv = lambda x: (
        DTensorSpec(mesh, tuple(next(it)), TensorMeta(x.shape, x.stride(), x.dtype))
        if isinstance(x, torch.Tensor)
        else x
    )
    a, k = tree_map(conv, (tuple(args), dict(kwargs)))
    info = _SP.op_to_schema_info.get(op) or _SP.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, tuple(a), k, schema_info=info)


# Mesh-dim ties of the enumeration (``tied_mesh_dims``): None, every combination of per-dim
# choices; else a list of groupings (each a partition of the mesh dims into groups), and only the
# combinations that choose alike on every group of one of them.
_TIES: list | None = None


@contextlib.contextmanager
def tied_mesh_dims(groupings):
    """Inside: the rules enumerate only per-mesh-dim combinations tied on some grouping (``[[[0,
    1], [2]], [[0], [1, 2]]]`` on a 3-D mesh: placements alike on dims 0 and 1, or on 1 and 2).
    A 3-D mesh then costs about twice a 2-D one instead of the cube of its per-dim choices;
    ``placement.auto`` solves such meshes over tied states (and filters what rules return)."""
    global _TIES
    old, _TIES = _TIES, [list(map(tuple, g)) for g in groupings] if groupings else None
    try:
        yield
    finally:
        _TIES = old


_GIVEN = False


@contextlib.contextmanager
def given_placements_only(on: bool = True):
    """Inside: rules that answer for given input placements (follow-the-input ones) are asked
    for the current placements only, not for every placement of each input (``placement.auto``
    asks what an op does with the strided inputs its producers can give)."""
    global _GIVEN
    old, _GIVEN = _GIVEN, on
    try:
        yield
    finally:
        _GIVEN = old


def mesh_products(options, ndim: int):
    """``itertools.product(options, repeat=ndim)``, or only its tied combinations inside
    ``tied_mesh_dims`` (in product order, each once)."""
    if _TIES is None:
        yield from itertools.product(options, repeat=ndim)
        return
    seen = set()
    for grouping in _TIES:
        for pick in itertools.product(range(len(options)), repeat=len(grouping)):
            idx = [0] * ndim
            for g, k in zip(grouping, pick):
                for m in g:
                    idx[m] = k
            key = tuple(idx)
            if key not in seen:
                seen.add(key)
                yield tuple(options[k] for k in idx)


def _enum_placements(t, mesh, current: Plc, with_partial: bool) -> list[Plc]:
    """Placement tuples to try as an input's placement (current first)."""
    opts = (
        [Replicate()]
        + [Shard(d) for d in range(t.ndim)]
        + ([Partial("sum")] if with_partial else [])
    )
    # keep StridedShard / P(avg) / ... already present
    opts += [p for p in current if p not in opts]
    out = [tuple(current)]
    for plc in mesh_products(opts, mesh.ndim):
        kinds = {(type(p), p.reduce_op) for p in plc if isinstance(p, Partial)}
        if plc == tuple(current) or (len(kinds) > 1 and {r for _, r in kinds} != {"sum", "avg"}):
            continue
        if _shardable(t.shape, mesh, plc):
            out.append(plc)
    return out


_SHARDABLE: dict = {}


def _shardable(shape, mesh, plc: Plc) -> bool:
    """``is_tensor_shardable(shape, DTensorSpec(mesh, plc))``, memoised for static shapes (a spec
    costs ~40 us to build, and the seeds of every op ask for the same few shapes)."""
    if not all(type(s) is int for s in shape):
        return is_tensor_shardable(shape, DTensorSpec(mesh, plc))
    key = (tuple(shape), tuple(mesh.shape), plc)
    hit = _SHARDABLE.get(key)
    if hit is None:
        if len(_SHARDABLE) > 1 << 16:
            _SHARDABLE.clear()
        hit = _SHARDABLE[key] = is_tensor_shardable(shape, DTensorSpec(mesh, plc))
    return hit


def _plc(spec):
    return None if spec is None else tuple(spec.placements)


def _collect(strategy, n_in: int, found: dict) -> None:
    if isinstance(strategy, TupleStrategy):  # foreach-style; children zipped by index
        kids = [c for c in strategy.children if isinstance(c, OpStrategy)]
        for specs in zip(*(c.strategies for c in kids)):
            ins = _foreach_inputs(specs, n_in)
            if ins is False:
                continue  # inputs that cannot be matched to the flat tensor list: not a candidate
            found.setdefault(
                (
                    ins,
                    tuple(
                        _plc(
                            s.output_specs
                            if isinstance(s.output_specs, DTensorSpec)
                            else s.output_specs[0]
                        )
                        for s in specs
                    ),
                ),
                None,
            )
        return
    for s in strategy.strategies:
        outs = s.output_specs
        o = (
            ()
            if outs is None
            else (_plc(outs),)
            if isinstance(outs, DTensorSpec)
            else tuple(map(_plc, outs))
        )
        # DTensor semantics: every tensor input takes the output placement
        if s.input_specs is None:
            i = (o[0],) * n_in
        else:
            i = tuple(map(_plc, s.input_specs))
            i += (None,) * (n_in - len(i))
        found.setdefault((i, o), None)


def _foreach_inputs(specs, n_in: int):
    """The flat input placements of one foreach candidate: child ``i`` places element ``i`` of
    every list argument, and the flat tensor order is list by list; False where the children's
    inputs do not cover the ``n_in`` tensors exactly."""
    if all(not s.input_specs for s in specs):
        return (None,) * n_in
    if any(not s.input_specs for s in specs):
        return False
    per_child = len(specs[0].input_specs)
    if any(len(s.input_specs) != per_child for s in specs) or per_child * len(specs) != n_in:
        return False
    return tuple(_plc(s.input_specs[j]) for j in range(per_child) for s in specs)


def _by_name(fn, first, **named):
    """Call a private DTensor helper whose parameters were renamed or added across torch
    releases: ``first`` positionally, then every parameter it has by name (``num_inputs`` or
    ``num_input_tensors``, ...); names it lacks are dropped."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    aliases = {"num_input_tensors": "num_inputs"}
    kwargs = {}
    for p in params:
        name = aliases.get(p.name, p.name)
        if name in named:
            kwargs[p.name] = named[name]
    return fn(first, **kwargs)


def _single_dim(op, info, spec_schema, n_in: int, found: dict, reference: bool = False) -> None:
    """Every full-mesh candidate of an op with a single-mesh-dim rule, into ``found``.  The
    expansion over mesh dims is ``_expand`` (what DTensor's ``expand_to_full_mesh_op_strategy``
    does, keeping only placements); ``reference`` runs DTensor's own (the tests compare the two)."""
    out_meta = _SP._propagate_tensor_meta_non_cached(spec_schema)
    schema = _SP._wrap_with_op_strategy(spec_schema)
    rules = [list(r) for r in info.func(op, schema.args_meta, schema.kwargs_meta)]
    n_in_rule = _get_num_tensor_inputs(schema)
    n_out = (
        len(rules[0]) - n_in_rule
        if rules
        else (0 if out_meta is None else 1 if isinstance(out_meta, TensorMeta) else len(out_meta))
    )
    rules = _by_name(
        _insert_single_dim_replication_strategy,
        rules,
        num_outputs=n_out,
        num_inputs=n_in_rule,
        output_tensor_meta=out_meta,
    )
    # DTensor fills _ShardingPlaceholder only with shard types present on the inputs, so
    # all-Replicate inputs would yield no sharded candidate: always seed Shard.
    seen = {
        p
        for x in tree_flatten((spec_schema.args_schema, spec_schema.kwargs_schema))[0]
        if isinstance(x, DTensorSpec)
        for p in x.placements
    } | {Shard(0)}
    rules = _fill_single_dim_strategy_placeholders(seen, rules)
    mesh = schema.get_mesh_from_args(validate=False)
    inplace = op.name().split("::")[1].split(".")[0].endswith("_")
    unbacked = getattr(info, "allow_unbacked_sharding", None)
    uneven = getattr(info, "allow_uneven_sharding", False)
    # torch 2.14+: an op-specific check of each full-mesh combination (convolution's sharded width,
    # mean over uneven shards, argmax's runtime handler); called as DTensor calls it
    rule_filter = getattr(info, "full_mesh_strategy_filter", None)
    keep = (
        None
        if rule_filter is None
        else lambda ins_specs, out_specs: rule_filter(mesh, schema, ins_specs, out_specs)
    )
    # out= variants: DTensor's (never in functional graphs)
    if reference or schema.is_out_variant_op():
        _collect(
            _by_name(
                expand_to_full_mesh_op_strategy,
                mesh,
                op_schema=schema,
                single_mesh_dim_strategies=rules,
                output_tensor_meta=out_meta,
                inplace_op=inplace,
                input_index=n_out,
                allow_unbacked_sharding=unbacked,
                allow_uneven_sharding=uneven,
                full_mesh_strategy_filter=keep,
            ),
            n_in,
            found,
        )
    else:
        _expand(mesh, schema, rules, n_out, n_in, found, inplace, unbacked, uneven, keep, out_meta)


def _expand(
    mesh,
    schema,
    rules,
    n_out: int,
    n_in: int,
    found: dict,
    inplace: bool,
    unbacked,
    uneven,
    keep=None,
    out_meta=None,
) -> None:
    """DTensor's ``expand_to_full_mesh_op_strategy`` reduced to what fxshard reads, the placements:
    every combination of one single-dim rule per mesh dim, dropping the same ones DTensor drops
    (mixed partial kinds other than sum with avg; an in-place op whose self would have to move; an
    input that cannot be sharded so), without building a DTensorSpec and redistribute costs per
    combination and input (that was ~1 s of planning a LLaMA-8B step).  Inputs are listed as DTensor
    lists them (rule positions without a tensor dropped), padded to ``n_in``."""
    ins = schema.args_strategy + schema.kwargs_strategy
    cur = [tuple(st.strategies[0].output_spec.placements) for st in ins]
    shapes = [st.shape for st in ins]
    shardable: dict = {}
    # into found only when the whole expansion succeeded (DTensor's raises and returns nothing)
    out = []
    for combo in mesh_products(rules, mesh.ndim):
        pos = [None if ps[0] is None else ps for ps in zip(*combo)]
        mixed = False
        for plc in pos:
            if plc is not None:
                kinds = {(type(p), p.reduce_op) for p in plc if isinstance(p, Partial)}
                if len(kinds) > 1 and not (
                    len({t for t, _ in kinds}) == 1 and {r for _, r in kinds} == {"sum", "avg"}
                ):
                    mixed = True
                    break
        if mixed:
            continue
        inputs = [plc for plc in pos[n_out:] if plc is not None]
        if len(inputs) != len(ins):
            raise AssertionError(f"input specs ({len(inputs)}) != strategies ({len(ins)})")
        if inplace and (cur[0] != inputs[0] or (pos[0] is not None and pos[0] != cur[0])):
            continue
        if n_out == 1 and pos[0] is None:
            raise RuntimeError("output spec is None")
        ok = True
        for j, plc in enumerate(inputs):
            v = shardable.get((j, plc))
            if v is None:
                v = shardable[j, plc] = is_tensor_shardable(
                    shapes[j], DTensorSpec(mesh, plc), allow_unbacked_sharding=unbacked
                ) or (uneven and cur[j] == plc)
            if not v:
                ok = False
                break
        if ok and keep is not None and not _kept(keep, mesh, ins, inputs, pos[:n_out], out_meta):
            ok = False
        if ok:
            out.append((tuple(inputs) + (None,) * (n_in - len(inputs)), tuple(pos[:n_out])))
    for cand in out:
        found.setdefault(cand, None)


# DecompShardingStrategy: an instance on the propagator from torch 2.12; static methods taking the
# propagator as their last argument in 2.11
_DECOMP = getattr(_SP, "decomp_strategy", None)
_FAKE_MESHES: dict = {}  # cache: device type -> the one-rank mesh decompositions are traced on


def _kept(keep, mesh, ins, inputs, outputs, out_meta) -> bool:
    """An op's full-mesh filter, on the specs DTensor would build for one combination."""
    metas = [out_meta] if isinstance(out_meta, TensorMeta) else list(out_meta or ())
    outs = [
        None if plc is None else DTensorSpec(mesh, plc, meta)
        for plc, meta in zip(outputs, metas + [None] * len(outputs))
    ]
    if not outs or all(o is None for o in outs):
        return True  # DTensor skips the filter for ops without outputs
    in_specs = [
        DTensorSpec(mesh, plc, st.strategies[0].output_spec.tensor_meta)
        for st, plc in zip(ins, inputs)
    ]
    return bool(keep(in_specs, outs[0] if len(outs) == 1 else tuple(outs)))


def _decomp_schema_info(op) -> None:
    if _DECOMP is not None:
        _DECOMP.ensure_schema_info(op)
    else:
        DecompShardingStrategy.ensure_schema_info(op, _SP)


def _decomp_fake_mesh(device_type: str):
    if _DECOMP is not None:
        return _DECOMP._get_fake_mesh(device_type)
    if device_type not in _FAKE_MESHES:
        _FAKE_MESHES[device_type] = DeviceMesh(device_type, [0], _init_backend=False, _rank=0)
    return _FAKE_MESHES[device_type]


def _decomp_propagate(spec_schema, placements, fake_mesh):
    if _DECOMP is not None:
        return _DECOMP._propagate_through_decomp(spec_schema, placements, fake_mesh)
    return DecompShardingStrategy._propagate_through_decomp(spec_schema, placements, fake_mesh, _SP)


def _decomp(op, spec_schema, mesh, input_placements, with_partial, max_cands):
    """DecompShardingStrategy.propagate_strategy with a seeded (input-independent) candidate set."""
    _decomp_schema_info(op)
    fake_mesh = _decomp_fake_mesh(mesh.device_type)
    leaves = tree_flatten(list(spec_schema.args_schema) + list(spec_schema.kwargs_schema.values()))[
        0
    ]
    shared = (
        {Replicate()}
        | {p for c in input_placements for p in c}
        | ({Partial("sum")} if with_partial else set())
    )

    def options(spec, full):  # one list per leaf (None for non-tensor leaves), like DTensor
        if not isinstance(spec, DTensorSpec):
            return [None]
        o = (
            {p for p in shared if not isinstance(p, (Shard, _StridedShard))}
            if full
            else {Replicate()}
        )
        o |= {Shard(d) for d in range(spec.ndim)}
        o |= {
            _StridedShard(d, split_factor=p.split_factor)
            for p in shared
            if isinstance(p, _StridedShard)
            for d in range(spec.ndim)
        }
        return sorted(o, key=repr)

    per_leaf = [options(s, True) for s in leaves]
    if max_cands and torch.Size([len(o) for o in per_leaf]).numel() > max_cands:
        per_leaf = [options(s, False) for s in leaves]
    rules, n_out = [], None
    for cand in itertools.product(*per_leaf):
        try:
            res = _decomp_propagate(spec_schema, cand, fake_mesh)
        except NotImplementedError:
            return (
                None  # a decomposed op has no strategy (e.g. factory aten.ones): DTensor fails too
            )
        except Exception:
            continue  # would need redistribution inside the decomposition
        res = list(res) if isinstance(res, tuple) else [res]
        n_out = len(res) if n_out is None else n_out
        if len(res) == n_out:
            rules.append(res + [p for p in cand if p is not None])
    return (
        expand_to_full_mesh_op_strategy(
            mesh, _SP._wrap_with_op_strategy(spec_schema), rules, input_index=n_out
        )
        if rules
        else None
    )


# input combinations tried through a decomposition (then: Shard / Replicate only)
_MAX_DECOMP_CANDIDATES = 256


def dtensor_candidates(
    op: OpOverload,
    args: Sequence,
    kwargs: dict,
    device_mesh: DeviceMesh,
    input_placements: Sequence[Sequence[Placement]],
    *,
    drop_strided_shard: bool = False,
    reference: bool = False,
) -> list[Candidate] | None:
    """All DTensor candidates (per-tensor-input placements, per-tensor-output placements).
    Tensors are counted in tree_flatten order of (args, kwargs) (lists flattened, None skipped).
    Output entries: one per returned tensor (None = not a DTensor output, e.g. philox seed);
    List[Tensor] outputs give one entry per element. None => DTensor has no rule.
    ``reference``: expand single-mesh-dim rules with DTensor's own helper (for tests)."""
    tensors = [
        x for x in tree_flatten((tuple(args), dict(kwargs or {})))[0] if isinstance(x, torch.Tensor)
    ]
    cur = [tuple(p) for p in input_placements]
    assert len(tensors) == len(cur), (len(tensors), len(cur))
    kwargs, n_in, found = dict(kwargs or {}), len(tensors), {}
    single, strat_fn = _SP.op_single_dim_strategy_funcs.get(op), _SP.op_strategy_funcs.get(op)
    has_decomp, rule = DecompShardingStrategy.has_decomp(op), _SP.op_to_rules.get(op)
    if n_in == 0 or not (single or strat_fn or has_decomp or rule):
        return None  # e.g. factory ops (arange/full/zeros): DTensor never sees them
    spec_schema = _spec_schema(op, args, kwargs, device_mesh, cur)

    if single is not None and _foreach_list(op, args):
        _single_dim_foreach(op, single, args, kwargs, tensors, device_mesh, cur, n_in, found)
    elif single is not None:  # preferred by DTensor when an op has both (mm, addmm, bmm, conv)
        try:
            _single_dim(op, single, spec_schema, n_in, found, reference)
        except (
            Exception
        ) as e:  # an input placement the rule rejects; logged: also a torch-version drift
            log.debug(
                "fxshard: DTensor's single-dim rule for %s raised %s: %s", op, type(e).__name__, e
            )
    elif strat_fn is not None:
        _follow_the_input(op, strat_fn, args, kwargs, tensors, device_mesh, cur, n_in, found)
    elif not _decomposed_or_legacy(
        op, has_decomp, rule, spec_schema, device_mesh, cur, n_in, found
    ):
        return None
    res = [c for c in (_plain_outputs(c) for c in found) if c is not None]
    if torch.Tag.pointwise in op.tags:
        res = res + _pointwise_strided(res, cur)
    if op not in _RESHAPES and any(
        isinstance(p, _StridedShard) for side in res for c in side for plc in c if plc for p in plc
    ):
        res = _strided_as_plain(op, args, kwargs, device_mesh, cur, res)
    if drop_strided_shard:
        res = [
            c
            for c in res
            if not any(
                isinstance(p, _StridedShard) for side in c for plc in side if plc for p in plc
            )
        ]
    return res


_PLAIN = (Replicate, Shard, _StridedShard)

# reshapes map dims onto others: their strided candidates are checked index by index where they
# are placed (``placement.problem.reshapes_soundly``)
_RESHAPES = frozenset(
    {
        torch.ops.aten.view.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten.view_copy.default,
    }
)


def _as_plain(plc):
    if plc is None:
        return None
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in plc)


def _pointwise_strided(res, cur) -> list:
    """A pointwise op's candidates for inputs strided on a dim, from its plain ones: on a mesh dim
    where an input is ``_S(d, sf)`` and a plain candidate has it ``Shard(d)``, every ``Shard`` of
    that mesh dim strided alike (broadcasting aligns the sharded dims, so every tensor's positions
    are the same ones).  torch 2.12 on proposes these itself (duplicates are dropped); torch
    2.11's pointwise rules do not, so a packed gate/up output was gathered before its mask."""
    have = set(res)
    extra = []
    for i, plc in enumerate(cur):
        for m, p in enumerate(plc or ()):
            if not isinstance(p, _StridedShard):
                continue
            sf = p.split_factor
            for ins, outs in res:
                q = ins[i][m] if i < len(ins) and ins[i] else None
                if not (isinstance(q, Shard) and type(q) is Shard and q.dim == p.dim):
                    continue

                def strided(side, m=m, sf=sf):
                    return tuple(
                        None if c is None else tuple(
                            _StridedShard(x.dim, split_factor=sf)
                            if k == m and type(x) is Shard else x
                            for k, x in enumerate(c)
                        )
                        for c in side
                    )  # fmt: skip

                cand = (strided(ins), strided(outs))
                if cand not in have:
                    have.add(cand)
                    extra.append(cand)
    return extra


def _uniform_strides(ins, outs) -> bool:
    """Per mesh dim, the shards of a candidate all plain or all strided in one split factor:
    a strided shard paired with a plain one (``mm`` of ``_S(1,2)`` rows by ``S(0)``) pairs
    other positions, and a changed split factor on a non-reshape op moves data."""
    sides = [c for side in (ins, outs) for c in side if c]
    for m in range(max((len(c) for c in sides), default=0)):
        kinds = set()
        for c in sides:
            p = c[m]
            if isinstance(p, _StridedShard):
                kinds.add(p.split_factor)
            elif isinstance(p, Shard):
                kinds.add(1)
        if len(kinds) > 1:
            return False
    return True


def _strided_as_plain(op, args, kwargs, device_mesh, cur, res) -> list:
    """The candidates with a strided shard that the rule also offers with plain shards of the same
    dims (the op treats the dim as independent positions, and a strided shard is some of them).

    Releases whose rules test ``isinstance(p, Shard)`` take a ``_StridedShard`` (no Shard there)
    for an unsharded dim: torch 2.11's ``cat`` passes ``_S(2,2)`` inputs through a cat on dim 2
    as an ``_S(2,2)`` output, a wrong result.  What the rule would not do with the plain shard it
    is not trusted to do with the strided one."""
    plain_cur = [_as_plain(c) for c in cur]
    plain = (
        res
        if plain_cur == cur
        else (dtensor_candidates(op, args, kwargs, device_mesh, plain_cur) or [])
    )
    offered = {
        (tuple(_as_plain(i) for i in ins), tuple(_as_plain(o) for o in outs))
        for ins, outs in (*plain, *res)
        if not any(isinstance(p, _StridedShard) for side in (ins, outs) for c in side if c
                   for p in c)
    }  # fmt: skip
    kept = []
    for ins, outs in res:
        strided = any(isinstance(p, _StridedShard) for side in (ins, outs) for c in side if c
                      for p in c)  # fmt: skip
        key = (tuple(_as_plain(i) for i in ins), tuple(_as_plain(o) for o in outs))
        if strided and not _uniform_strides(ins, outs):
            continue
        if not strided or key in offered:
            kept.append((ins, outs))
        else:
            log.debug("fxshard: %s: strided candidate %s dropped (no plain counterpart)", op, key)
    return kept


def _plain_outputs(cand: Candidate) -> Candidate | None:
    """The candidate with outputs in placements whose meaning fxshard's planner knows, or None.

    DTensor marks some partial values with a Partial subclass that reduces differently from its
    ``reduce_op`` (a p-norm's partial sums of |x|^p, reduced then raised to 1/p: ``_NormPartial``;
    an embedding's masked partial lookup: ``_MaskPartial``).  Taken as the plain Partial its
    ``reduce_op`` names, such a value reduces to a wrong result; p = 1 is the one norm that is a
    plain sum.  Any other such candidate is dropped (the op keeps its other candidates)."""
    ins, outs = cand
    new_outs = []
    for plc in outs:
        if plc is None:
            new_outs.append(plc)
            continue
        fixed = []
        for p in plc:
            if type(p) in _PLAIN or type(p) is Partial:
                fixed.append(p)
            elif type(p).__name__ == "_NormPartial" and getattr(p, "norm_type", None) == 1:
                fixed.append(Partial("sum"))
            else:
                return None
        new_outs.append(tuple(fixed))
    return ins, tuple(new_outs)


def _foreach_list(op, args) -> bool:
    """A foreach op called on a list of tensors (DTensor's single-dim rules for these, where a
    release has them, are per element: 2.14 moved most foreach ops there)."""
    return op.name().startswith(
        ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")
    ) and any(isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) for a in args)


def _single_dim_foreach(op, info, args, kwargs, tensors, device_mesh, cur, n_in, found) -> None:
    """A foreach op's per-element single-dim rule, expanded by DTensor itself (it translates the
    list to its elements' op), asked with seeded placements: DTensor fills a rule's placeholders
    only with the shard types its inputs have."""
    from torch.distributed.tensor._ops import single_dim_strategy as sds

    expand = getattr(sds, "_expand_single_dim_strategy_to_mesh", None)
    if expand is None:
        return
    for seed in _seeds(tensors, device_mesh, cur):
        try:
            schema = _spec_schema(op, args, kwargs, device_mesh, seed)
            wrapped = _SP._wrap_with_op_strategy(schema)
            out_meta = _SP._propagate_tensor_meta_non_cached(schema)
            strategy = expand(device_mesh, wrapped, info, out_meta)
            _collect(strategy(op, wrapped.args_meta, wrapped.kwargs_meta), n_in, found)
        except Exception as e:  # placements the rule rejects
            log.debug("fxshard: DTensor's foreach rule for %s raised %r", op, e)


def _seeds(tensors, device_mesh, cur) -> list:
    """Input placements to ask a rule that answers for given inputs only: the current ones, and
    every placement of the inputs of each rank (the first input's rank first), those of one rank
    placed alike where they can be (``where(cond, x, y)`` with a broadcast ``cond``: x and y
    together, enumerated from the largest of them)."""
    seeds = [list(cur)]
    if _GIVEN:
        return seeds
    ranks = list(dict.fromkeys(t.ndim for t in tensors))
    for ndim in ranks:
        group = [j for j, t in enumerate(tensors) if t.ndim == ndim]
        largest = max(group, key=lambda j: (tensors[j].numel(), -j))
        tried = set()
        for lead in dict.fromkeys((group[0], largest)):
            for plc in _enum_placements(tensors[lead], device_mesh, cur[lead], True)[1:]:
                if plc in tried:
                    continue
                tried.add(plc)
                seeds.append(
                    [
                        plc if t.ndim == ndim and _shardable(t.shape, device_mesh, plc) else c
                        for t, c in zip(tensors, cur)
                    ]
                )
    return seeds


def _follow_the_input(
    op, strat_fn, args, kwargs, tensors, device_mesh, cur, n_in: int, found: dict
) -> None:
    """ "Follow-the-input" strategy functions (view, reductions, slice, cat, softmax...) return one
    OpSpec per input OpSpec: call once per seed input placement (one call with every seed as the
    input strategy is slower: DTensor prices each answer's redistribution from every input
    strategy).  A function returning more than one spec for the first seed already enumerates
    everything (expand_to_full_mesh style): stop."""
    for k, seed in enumerate(_seeds(tensors, device_mesh, cur)):
        before = len(found)
        try:
            _collect(
                strat_fn(
                    _SP._wrap_with_op_strategy(_spec_schema(op, args, kwargs, device_mesh, seed))
                ),
                n_in,
                found,
            )
        except Exception:
            pass  # strategy raises for this input placement (strict view on uneven dim, expand)
        if k == 0 and len(found) - before > 1:
            break


def _decomposed_or_legacy(
    op, has_decomp, rule, spec_schema, device_mesh, cur, n_in: int, found: dict
) -> bool:
    """Candidates through the op's decomposition, else its legacy OutputSharding rule (one answer
    for the given placements).  False when it has neither."""
    st = None
    if has_decomp:
        try:
            st = _decomp(op, spec_schema, device_mesh, cur, True, _MAX_DECOMP_CANDIDATES)
        except Exception:
            st = None
    if st is not None:
        _collect(st, n_in, found)
        return True
    if rule is None:
        return False
    # one answer for the given input placements (torch 2.11's index, index_select, convolution);
    # asked for the current ones only: such a rule does not check that its inputs can be so placed
    # (asked with others, 2.11's convolution rule accepts a sharded weight)
    try:
        res, in_schema = rule(spec_schema), spec_schema
        if res.output_spec is None and res.redistribute_schema is not None:
            in_schema = res.redistribute_schema
            res = rule(in_schema)
        if res.output_spec is not None:
            o = res.output_spec
            i = tuple(map(_plc, in_schema.args_spec))
            found[
                (
                    i + (None,) * (n_in - len(i)),
                    (_plc(o),) if isinstance(o, DTensorSpec) else tuple(map(_plc, o)),
                )
            ] = None
    except Exception:
        pass
    return True


def has_single_dim_rule(op: OpOverload) -> bool:
    return op in _SP.op_single_dim_strategy_funcs


def single_dim_rule_count() -> int:
    """How many ops DTensor rules per mesh dim (4 in torch 2.11, ~1000 in 2.13, ~1200 in 2.14)."""
    return len(_SP.op_single_dim_strategy_funcs)
