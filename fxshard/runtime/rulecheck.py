"""The rule checker: every strategy fxshard would use for an op, run on simulated ranks against
single device.

    report = fxshard.check_rule(torch.ops.mylib.rmsnorm.default, samples=[((x, w), {})])
    print(report)   # strategies checked, and the wrong ones with why; those are excluded
                    # from now on (``exclude=False``: only report)

For each sample call and mesh, the op is placed in a one-node graph and asked for its legal states
exactly as annotation asks (``PlacementProblem.legal_states``: the rule's candidates, filtered to
plain, even ones); each state's inputs are distributed to simulated ranks (Partial inputs as random
addends, so a reduction has something to add up), the node runs through the lowering's own
per-rank interpreter (the local shape arguments, squeezes, group norms, vocab-parallel lookups and
random draws it rewrites), and every output is assembled and compared with the op on the full
inputs.  A state that disagrees, or raises, is wrong; ``fxshard.rules.excluded`` then never offers
it again.

Samples: ``samples=[(args, kwargs), ...]`` with real tensors, or the ATen calls of a function run
eagerly (``record_calls``: a model's training step), or, by default, torch's OpInfo samples of the
op (``op_db``; the sizes are made even, so that they shard).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .._torch import (
    OpOverload,
    OpOverloadPacket,
    Partial,
    Replicate,
    Shard,
    coordinate_tensor,
    opinfo_db,
    record_aten_calls,
    tree_flatten,
    tree_map,
    tree_unflatten,
)
from ..core.cost import CostModel
from ..core.mesh import MeshSpec
from ..core.spec import ShardingSpec, is_even
from ..ir import info
from ..passes.lower import run_per_rank
from ..placement.constraints import resolve_plan
from ..placement.problem import PlacementProblem
from ..planner.execute import group_names, mesh_coordinate
from ..rules import excluded
from .simulate import SimulatedMesh

log = logging.getLogger("fxshard")

DEFAULT_MESHES = ((2,), (2, 2))
# (rtol, atol) per output dtype: float32's covers the reordered sums of a reduction
_TOL = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


# ops whose outputs are uninitialised memory: only their (local) shapes can be compared
_SHAPE_ONLY = frozenset(
    {
        torch.ops.aten.empty_like.default,
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)


@dataclass
class Wrong:
    """One wrong strategy: the op, the call it was checked on, the mesh, the strategy, why."""

    op: str
    call: str
    mesh: tuple
    strategy: str
    why: str


@dataclass
class RuleReport:
    calls: int = 0  # sample calls checked
    checked: int = 0  # (call, mesh, strategy) runs
    wrong: list[Wrong] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)  # the exclusion keys recorded
    skipped: dict[str, int] = field(default_factory=dict)  # why -> count
    ops: set = field(default_factory=set)  # ops checked

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def merge(self, other: RuleReport) -> None:
        self.calls += other.calls
        self.checked += other.checked
        self.wrong += other.wrong
        self.excluded += other.excluded
        self.ops |= other.ops
        for k, v in other.skipped.items():
            self.skipped[k] = self.skipped.get(k, 0) + v

    def __str__(self) -> str:
        lines = [
            f"rule check: {len(self.ops)} ops, {self.calls} (call, mesh) pairs, "
            f"{self.checked} strategies run, {len(self.wrong)} wrong"
        ]
        if self.skipped:
            lines.append(
                "skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items()))
            )
        for w in self.wrong[:50]:
            lines.append(f"  WRONG {w.op} on mesh {w.mesh}: {w.strategy}: {w.why}  [{w.call}]")
        if len(self.wrong) > 50:
            lines.append(f"  ... {len(self.wrong) - 50} more")
        return "\n".join(lines)


# ---- samples -------------------------------------------------------------------------------------
def _clone(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


def record_calls(fn: Callable, *args, **kwargs) -> list[tuple]:
    """Every ATen call ``fn(*args, **kwargs)`` makes (autograd's backward included when ``fn``
    calls it), with copies of its real arguments: ``[(op, args, kwargs)]``."""
    return record_aten_calls(lambda: fn(*args, **kwargs), _clone)


def unique_calls(calls: Iterable[tuple], per_op: int = 4) -> list[tuple]:
    """One call per (op, argument shapes / values), at most ``per_op`` per op."""
    seen, count, out = set(), {}, []
    for op, args, kwargs in calls:
        key = (op, _describe(op, args, kwargs))
        if key in seen or count.get(op, 0) >= per_op:
            continue
        seen.add(key)
        count[op] = count.get(op, 0) + 1
        out.append((op, args, kwargs))
    return out


def opinfo_samples(op: OpOverload, max_samples: int = 4) -> list[tuple]:
    """Calls of ``op`` made by torch's OpInfo samples of the ops named like it (sizes made even)."""
    base = op.name().split("::")[-1].split(".")[0].lstrip("_")
    found = []
    for opinfo in opinfo_db():
        if opinfo.name.split(".")[-1].lstrip("_") != base and opinfo.aten_name != base:
            continue
        found += [c for c in opinfo_calls(opinfo, max_samples) if c[0] == op]
    return found


def opinfo_calls(opinfo, max_samples: int = 3) -> list[tuple]:
    """The ATen calls of an OpInfo's first float32 samples, those of a tensor with dims first
    (reductions' first samples are 0-d: nothing to shard)."""
    calls = []
    try:
        samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=False))
    except Exception:  # an OpInfo without float32 samples
        return calls
    samples.sort(key=lambda s: isinstance(s.input, torch.Tensor) and s.input.ndim == 0)
    for s in samples[:max_samples]:
        try:
            with torch.no_grad():
                calls += record_calls(opinfo.op, s.input, *s.args, **s.kwargs)
        except Exception:  # a sample the op rejects
            continue
    return calls


# ---- checking ------------------------------------------------------------------------------------
def check_rule(
    op: OpOverload | OpOverloadPacket,
    samples: Sequence[tuple] | None = None,
    *,
    meshes: Sequence[tuple] = DEFAULT_MESHES,
    exclude: bool = True,
) -> RuleReport:
    """Check every strategy fxshard would use for ``op`` (see the module docstring); with
    ``exclude`` the wrong ones are never offered again (logged)."""
    if isinstance(op, OpOverloadPacket):
        op = op.default
    if samples is None:
        samples = [(a, k) for _, a, k in opinfo_samples(op)]
        if not samples:
            raise ValueError(
                f"check_rule: torch's OpInfo has no samples of {op}; pass samples=[(args, kwargs), "
                "...] with real tensors of shapes that divide the mesh"
            )
    return check_calls(
        [(op, tuple(a), dict(k)) for a, k in samples], meshes=meshes, exclude=exclude
    )


def check_calls(
    calls: Sequence[tuple], *, meshes: Sequence[tuple] = DEFAULT_MESHES, exclude: bool = True
) -> RuleReport:
    """``check_rule`` over ``[(op, args, kwargs)]`` (e.g. ``unique_calls(record_calls(step))``)."""
    report = RuleReport()
    for mesh in meshes:  # one-dim meshes first: their wrong columns cover the larger meshes
        for op, args, kwargs in calls:
            report.merge(_check_call(op, args, kwargs, tuple(mesh), exclude))
    if report.wrong:
        log.warning("fxshard: %s", report)
    return report


def _describe(op, args, kwargs) -> str:
    def d(a):
        if isinstance(a, torch.Tensor):
            dt = "" if a.dtype == torch.float32 else ":" + str(a.dtype).replace("torch.", "")
            return f"T{list(a.shape)}{dt}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(d(x) for x in a) + "]"
        return repr(a)

    parts = [d(a) for a in args] + [f"{k}={d(v)}" for k, v in kwargs.items()]
    return f"{op}({', '.join(parts)})"


def _one_node_graph(op, args, kwargs, outs) -> tuple[fx.GraphModule, fx.Node, list]:
    graph = fx.Graph()
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    tensors, new = [], []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            p = graph.placeholder(f"in{len(tensors)}")
            p.meta["val"] = x
            tensors.append(x)
            new.append(p)
        else:
            new.append(x)
    a, k = tree_unflatten(new, spec)
    node = graph.call_function(op, tuple(a), k)
    node.meta["val"] = outs if len(outs) > 1 else outs[0]
    graph.output(node)
    return fx.GraphModule(torch.nn.Module(), graph), node, tensors


def _from_sharded_inputs(problem, node, tensors) -> list:
    """The states a rule offers when one input arrives sharded on one dim (on each mesh dim in
    turn): DTensor's follow-the-input rules propose from the inputs' current placements, and some
    proposals appear only then (torch 2.11's ``argmax`` of a ``Shard(0)`` input along dim 0 as
    ``Partial(max)``: local indices, a wrong result)."""
    out = []
    for i, t in enumerate(tensors):
        for d in range(t.ndim):
            for m in range(problem.mesh.ndim):
                plc = [Replicate()] * problem.mesh.ndim
                plc[m] = Shard(d)
                try:
                    spec = problem.spec(plc, t)
                except ValueError:  # a size this mesh dim does not split
                    continue
                cur = [spec if j == i else problem.replicated(u) for j, u in enumerate(tensors)]
                try:
                    found = problem.legal_states(node, cur)
                except Exception:
                    continue
                if found.source == "rule":
                    out += found.states
    return out


def _check_call(op, args, kwargs, mesh_shape, exclude) -> RuleReport:
    report = RuleReport(ops={str(op)})
    call = _describe(op, args, kwargs)
    try:
        torch.manual_seed(0)
        ref = op(*tree_map(_clone, args), **tree_map(_clone, kwargs))
    except Exception:
        report.skip("sample the op rejects")
        return report
    outs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    if not any(isinstance(o, torch.Tensor) for o in outs):
        report.skip("no tensor output")
        return report
    report.calls += 1
    gm, node, tensors = _one_node_graph(op, args, kwargs, outs)
    mesh = MeshSpec(mesh_shape)
    problem = PlacementProblem(mesh, CostModel(mesh), resolve_plan(None, None, mesh))
    try:
        states = problem.legal_states(node, [problem.replicated(t) for t in tensors])
    except Exception as e:  # a rule that raises is no rule (annotation treats it so)
        report.skip(f"rule raised ({type(e).__name__})")
        return report
    if states.source != "rule":
        report.skip(f"no rule ({states.source})")
        return report
    todo, seen = [], set()
    for in_specs, out_specs in (*states.states, *_from_sharded_inputs(problem, node, tensors)):
        if (in_specs, out_specs) in seen:
            continue
        seen.add((in_specs, out_specs))
        if all(_replicated(s) for s in (*in_specs, *out_specs)):
            continue
        if any(
            t.dtype == torch.bool and any(isinstance(p, Partial) for p in s.placements)
            for t, s in zip(tensors, in_specs)
        ):
            report.skip("Partial bool input")
            continue
        todo.append((in_specs, out_specs))
    if not todo:
        return report
    with SimulatedMesh(mesh_shape) as sim:
        for in_specs, out_specs in todo:
            report.checked += 1
            why = _run_state(sim, gm, node, tensors, in_specs, out_specs, outs)
            if why is None:
                continue
            cand = (
                tuple(s.placements for s in in_specs),
                tuple(s.placements if s is not None else None for s in out_specs),
            )
            report.wrong.append(Wrong(str(op), call, mesh_shape, excluded.whole(cand), why))
            if exclude and excluded.is_excluded(op, cand) is None:
                report.excluded.append(excluded.exclude(op, cand, f"{why} [{call}]"))
    return report


def _replicated(spec) -> bool:
    return spec is None or all(isinstance(p, Replicate) for p in spec.placements)


def _run_state(sim, gm, node, tensors, in_specs, out_specs, outs) -> str | None:
    """None if the state computes the op's outputs on the simulated ranks, else why not."""
    rec = info(node)
    rec.spec = tuple(out_specs) if len(out_specs) > 1 else out_specs[0]
    rec.input_specs = tuple(in_specs)
    try:
        local = [
            sim.distribute(t.clone(), s, partial_seed=i + 1)
            for i, (t, s) in enumerate(zip(tensors, in_specs))
        ]
        torch.manual_seed(0)
        # even shards: the rank-agnostic coordinate tensor, as the per-rank graph takes it; uneven
        # ones: per-rank coordinates, so that every rank gets its own local shapes
        even = all(is_even(s) for s in (*in_specs, *out_specs) if isinstance(s, ShardingSpec))
        coord = coordinate_tensor(sim.device_mesh) if even else mesh_coordinate(sim.device_mesh)
        got = run_per_rank(gm, group_names(sim.device_mesh), coord, local)
        got = list(got) if isinstance(got, (tuple, list)) else [got]
        for i, (g, s, want) in enumerate(zip(got, out_specs, outs)):
            if s is None or not isinstance(want, torch.Tensor):
                continue
            shape_only = node.target in _SHAPE_ONLY
            full = sim.assemble(g, s, check_replicas=not shape_only)
            with sim.outside():
                why = _differ(full, want, shape_only, tensors)
            if why:
                return f"output {i}: {why}"
    except Exception as e:  # noqa: BLE001 - a strategy that raises is wrong
        msg = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
        return f"raises {type(e).__name__}: {msg}"
    return None


def _differ(
    got: torch.Tensor, want: torch.Tensor, shape_only: bool = False, inputs: Sequence = ()
) -> str | None:
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, single device {tuple(want.shape)}"
    if shape_only:
        return None
    if want.dtype.is_floating_point or want.dtype.is_complex:
        # the least precise of the output and the inputs (a float32 Partial input's addends are
        # float32 sums, whatever the output's dtype)
        floats = [t for t in (want, *inputs) if t.is_floating_point() or t.is_complex()]
        tols = [_TOL.get(t.dtype, (1e-4, 1e-4)) for t in floats]
        rtol, atol = max(t[0] for t in tols), max(t[1] for t in tols)
        wide = torch.complex128 if want.is_complex() else torch.float64
        a, b = got.to(wide), want.to(wide)
        finite_b = b[torch.isfinite(b)]
        scale = max(1.0, float(finite_b.abs().max())) if finite_b.numel() else 1.0
        if torch.allclose(a, b, rtol=rtol, atol=atol * scale, equal_nan=True):
            return None
        finite = torch.isfinite(a) & torch.isfinite(b)
        err = float((a - b).abs()[finite].max()) if finite.any() else math.nan
        return f"max error {err:.3g}"
    if want.dtype == torch.bool and got.dtype != torch.bool:
        got = got != 0
    if torch.equal(got.to(want.dtype), want):
        return None
    return "values differ"
