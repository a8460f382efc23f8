"""Plans people can read: ``explain`` (text / json / html), ``diff``, logging and trace artifacts.

A row per node that matters: parameters and inputs, module boundaries the plan constrains, every
redistribute (its state path in the planner's notation, each collective with bytes per rank and
modelled µs) and every fallback; ``verbose=True`` adds every other node.  Repeated layers whose rows
are identical but for the layer index are folded (``layers.0-31``).  Rows carry their module FQN,
source line and provenance: the plan entry, rule or planner decision that put the placement there.
"""

from __future__ import annotations

import html
import json
import logging
import math
import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ._torch import is_op_overload, trace_artifact
from .core.spec import is_even, levels_to_placements, local_extent, mesh_coords, placements_str
from .ir import info

if TYPE_CHECKING:  # annotations only
    from .runtime.program import ShardedProgram

log = logging.getLogger("fxshard")

_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def _pl(spec) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return ",".join(_pl(s) for s in spec)
    return placements_str(spec.placements, spec.levels) + _uneven_note(spec)


def _uneven_note(spec) -> str:
    """`` [d0 251x3,248]``: the local extents of each unevenly split dim, rank by rank (row-major
    mesh coordinates); empty for an even spec."""
    if is_even(spec):
        return ""
    parts = []
    for d, lv in enumerate(spec.levels):
        if not lv:
            continue
        mesh = spec.mesh.shape
        ext = [local_extent(spec.shape[d], lv, mesh, c) for c in mesh_coords(mesh)]
        if len(set(ext)) == 1:
            continue
        runs: list[list[int]] = []
        for e in ext:
            if runs and runs[-1][0] == e:
                runs[-1][1] += 1
            else:
                runs.append([e, 1])
        parts.append(f"d{d} " + ",".join(f"{e}x{k}" if k > 1 else str(e) for e, k in runs))
    return f" [{'; '.join(parts)}]"


def uneven_summary(prog: ShardedProgram) -> dict | None:
    """What uneven sharding costs the program (None where every shard is even): how many values
    are split unevenly, the largest shard against an even share (the slowest rank's extra work),
    the per-rank graphs (ranks grouped by their local shapes) and the padding collectives carry."""
    if not prog.uneven:
        return None
    specs = {}
    for n in prog.global_graph.graph.nodes:
        s = info(n).spec
        for x in s if isinstance(s, tuple) else (s,):
            if x is not None and hasattr(x, "levels") and not is_even(x):
                specs[n.name] = x
                break
    worst = 1.0
    for s in specs.values():
        share = math.prod(s.shape) / s.num_shards
        if share:
            big = max(math.prod(s.local_shape(c)) for c in mesh_coords(s.mesh.shape))
            worst = max(worst, big / share)
    colls = prog.collectives()
    return {
        "values": len(specs),
        "largest_shard_vs_even": round(worst, 3),
        "graphs": [[list(c) for c in g] for g in prog.local_shape_classes()],
        "padding_bytes": {
            ph: sum(c.padding for c in colls if c.phase == ph) for ph in ("forward", "backward")
        },
    }


def _uneven_lines(prog) -> list[str]:
    u = uneven_summary(prog)
    if u is None:
        return []
    groups = " | ".join(",".join(str(tuple(c)) for c in g) for g in u["graphs"])
    pad = ", ".join(f"{ph} {b} B" for ph, b in u["padding_bytes"].items() if b)
    return [
        f"uneven: {u['values']} values split unevenly (torch.chunk layout); the largest shard is "
        f"{u['largest_shard_vs_even']}x an even share; {len(u['graphs'])} per-rank graphs "
        f"(ranks by local shapes: {groups}); collective padding per step: {pad or 'none'}"
    ]


@dataclass
class Row:
    module: str
    op: str
    placements: str
    where: str = ""
    why: str = ""
    node: str = ""
    collectives: list = field(default_factory=list)  # [(kind, mesh_dims, bytes, us)]
    cost: float = 0.0

    def key(self):
        """What must match for two layers' rows to fold (everything but the layer index)."""
        return (
            _INDEX.sub(".#", self.module),
            _INDEX.sub(".#", self.op),
            self.placements,
            self.where,
            _INDEX.sub(".#", self.why),
            tuple(self.collectives),
        )


def _redistribute_text(plan) -> str:
    states = []
    for lv, part in zip(plan.levels, plan.partials):
        states.append(placements_str(levels_to_placements(lv, part, plan.src.mesh.ndim), lv))
    return " -> ".join(states)


def _consumer(n):
    """The op a redistribute feeds, looking through boundary markers."""
    seen = 0
    while seen < 16:
        users = list(n.users)
        if not users:
            return n
        u = users[0]
        if info(u).kind != "boundary":
            return u
        n = u
        seen += 1
    return n


def _paddings(prog: ShardedProgram) -> dict[str, list[int]]:
    """{redistribute node: the padding bytes of each of its collectives} (uneven programs)."""
    out: dict[str, list[int]] = {}
    for c in prog.collectives():
        for planned in c.carries:
            out.setdefault(planned.node, []).append(planned.padding)
    return out


def node_rows(prog: ShardedProgram, verbose: bool = False) -> list[Row]:
    rows = []
    pads = _paddings(prog) if prog.uneven else {}
    for n in prog.global_graph.graph.nodes:
        rec = info(n)
        if n.op == "output":
            continue
        if rec.kind == "redistribute":
            plan = rec.plan
            colls = [
                (step.collective, step.mesh_dims, nbytes, round(step.cost, 2))
                for step, nbytes in plan.collective_bytes()
            ]
            if n.name in pads and len(pads[n.name]) == len(colls):
                colls = [(*c, pad) if pad else c for c, pad in zip(colls, pads[n.name])]
            first = next(iter(n.users))
            if info(first).kind == "boundary" and info(first).provenance != "passthrough":
                why = info(first).provenance  # the plan entry that asked for it
            else:
                why = f"{_op_name(_consumer(n))} needs {_pl(rec.spec)}"
            rows.append(
                Row(
                    rec.module,
                    "redistribute",
                    _redistribute_text(plan),
                    rec.source,
                    why,
                    n.name,
                    colls,
                    plan.cost,
                )
            )
        elif n.op == "placeholder":
            module = rec.fqn.rsplit(".", 1)[0] if rec.fqn and "." in rec.fqn else ""
            what = f"{rec.kind} {rec.fqn}" if rec.fqn else f"input {rec.input_index}"
            rows.append(Row(module, what, _pl(rec.spec), "", rec.provenance, n.name))
        else:
            important = rec.provenance.startswith(("fallback", "factory")) or (
                rec.kind == "boundary" and rec.provenance != "passthrough"
            )
            if not (verbose or important):
                continue
            rows.append(
                Row(rec.module, _op_name(n), _pl(rec.spec), rec.source, rec.provenance, n.name)
            )
    return rows


def _op_name(n) -> str:
    if n.op != "call_function":
        return n.op
    t = n.target
    name = getattr(t, "__name__", str(t))
    if is_op_overload(t):  # aten.mm.default -> mm
        name = str(t).split(".")[-2] if str(t).count(".") >= 2 else str(t)
    if info(n).kind == "boundary":
        return "boundary " + info(n).tag.split(":", 1)[1]
    return name


def fold(rows: list[Row]) -> list[Row]:
    """Fold runs of layers (same container, consecutive indices) whose rows match."""
    out: list[Row] = []
    i = 0
    while i < len(rows):
        m = _INDEX.search(rows[i].module)
        if not m:
            out.append(rows[i])
            i += 1
            continue
        container = rows[i].module[: m.start()]

        # the block of rows belonging to layer idx
        def block(start, container=container):
            mm = _INDEX.search(rows[start].module)
            if not mm or rows[start].module[: mm.start()] != container:
                return None, start
            idx = mm.group(1)
            j = start
            while j < len(rows):
                m2 = _INDEX.search(rows[j].module)
                if not m2 or rows[j].module[: m2.start()] != container or m2.group(1) != idx:
                    break
                j += 1
            return int(idx), j

        first_idx, end = block(i)
        blocks = [(first_idx, i, end)]
        while end < len(rows):
            idx, nxt = block(end)
            if idx is None or idx != blocks[-1][0] + 1:
                break
            a = [r.key() for r in rows[blocks[0][1] : blocks[0][2]]]
            b = [r.key() for r in rows[end:nxt]]
            if a != b:
                break
            blocks.append((idx, end, nxt))
            end = nxt
        if len(blocks) == 1:
            out.extend(rows[i : blocks[0][2]])
            i = blocks[0][2]
            continue
        lo, hi = blocks[0][0], blocks[-1][0]
        for r in rows[blocks[0][1] : blocks[0][2]]:
            r2 = Row(**{**asdict(r)})
            r2.module = re.sub(
                rf"^{re.escape(container)}\.{lo}(?=\.|$)", f"{container}.{lo}-{hi}", r.module
            )
            r2.why = r.why.replace(f"{container}.{lo}.", f"{container}.{lo}-{hi}.")
            r2.op = r.op.replace(f"{container}.{lo}.", f"{container}.{lo}-{hi}.")
            r2.node = f"{r.node} (x{len(blocks)})"
            out.append(r2)  # collectives and cost stay per layer; the module range says how many
        i = blocks[-1][2]
    return out


def _fmt_colls(colls) -> str:
    # (kind, mesh dims, bytes, us[, padding bytes of an uneven shard's collective])
    return "; ".join(
        f"{c[0]}{list(c[1])} {c[2]}B" + (f" +{c[4]}B pad" if len(c) > 4 else "") + f" {c[3]:.2f}us"
        for c in colls
    )


def summary(prog: ShardedProgram, phase: str | None = None) -> dict:
    """{kind: {count, bytes, us}} of what the per-rank graph runs (``phase``: only "forward" or
    "backward" collectives)."""
    kinds: dict[str, list] = {}
    for c in prog.collectives():
        if phase is not None and c.phase != phase:
            continue
        k = kinds.setdefault(c.kind, [0, 0, 0.0])
        k[0] += 1
        k[1] += c.bytes
        k[2] += c.cost
    return {
        k: {"count": v[0], "bytes": v[1], "us": round(v[2], 2)} for k, v in sorted(kinds.items())
    }


def _phase_lines(prog) -> list[str]:
    """The footer: per phase, what the per-rank graph runs (after bucketing) and its totals."""
    lines = []
    for phase in ("forward", "backward"):
        s = summary(prog, phase)
        if not s and (
            phase == "backward" or any(c.phase == "backward" for c in prog.collectives())
        ):
            continue
        total_b = sum(v["bytes"] for v in s.values())
        total_us = sum(v["us"] for v in s.values())
        lines.append(
            f"{phase}: "
            + (
                ", ".join(
                    f"{k} x{v['count']} ({v['bytes']} B, {v['us']:.2f} us)" for k, v in s.items()
                )
                or "no collectives"
            )
            + (f"; total {total_b} B, {total_us:.2f} us per step" if s else "")
        )
    return lines


def explain(prog: ShardedProgram, verbose: bool = False, format: str = "text") -> str:
    if format == "json":
        return to_json(prog, verbose)
    if format == "html":
        return to_html(prog, verbose)
    if format != "text":
        raise ValueError(f"explain: unknown format {format!r}; use text, json or html")
    rows = fold(node_rows(prog, verbose))
    head = ("module", "op", "placements", "where", "why", "collectives")
    table = [head] + [
        (r.module or "-", r.op, r.placements, r.where, r.why, _fmt_colls(r.collectives))
        for r in rows
    ]
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    lines = [
        f"fxshard plan on mesh {prog.mesh.shape}"
        + (f" {prog.mesh.names}" if prog.mesh.names else "")
    ]
    for t in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip())
    lines.append("")
    lines += _phase_lines(prog)
    lines += _uneven_lines(prog)
    for w in prog.warnings:
        lines.append(f"fallback: {w}")
    for m in missed_fusions(prog):
        lines.append(f"missed fusion: {m}")
    if prog.bucketed:
        lines.append(
            f"bucketed: {prog.bucketed} collectives merged into others in the per-rank graph"
        )
    return "\n".join(lines)


def missed_fusions(prog: ShardedProgram) -> list[str]:
    """Runs of same-kind collectives on different mesh dims inside one redistribute that one
    collective over the flattened dims could have done, with the reason they were not fused."""
    out = []
    fuse = prog.config.multi_dim_collectives
    for n in prog.global_graph.graph.nodes:
        rec = info(n)
        if rec.kind != "redistribute":
            continue
        steps = [s for s in rec.plan.steps if s.collective]
        for a, b in zip(steps, steps[1:]):
            if a.collective == b.collective and a.mesh_dims != b.mesh_dims:
                where = f"{rec.module}: " if rec.module else ""
                if not fuse:
                    why = "fusion off (multi_dim_collectives=False)"
                elif any(sf != 1 for lv in rec.plan.levels for st in lv for _, sf in st):
                    why = "strided levels are not fused"
                else:
                    why = "cheaper unfused under the cost model"
                out.append(
                    f"{where}{n.name} {a.collective} on mesh dims {list(a.mesh_dims)} then "
                    f"{list(b.mesh_dims)} ({why})"
                )
    return out


def to_json(prog: ShardedProgram, verbose: bool = False) -> str:
    rows = fold(node_rows(prog, verbose))
    return json.dumps(
        {
            "mesh": {"shape": list(prog.mesh.shape), "names": list(prog.mesh.names or [])},
            "rows": [asdict(r) for r in rows],
            "collectives": [asdict(c) for c in prog.collectives()],
            "summary": summary(prog),
            "phases": {ph: summary(prog, ph) for ph in ("forward", "backward")},
            "fallbacks": list(prog.warnings),
            "uneven": uneven_summary(prog),
        },
        indent=1,
    )


def to_html(prog: ShardedProgram, verbose: bool = False) -> str:
    """A self-contained page: the plan table and a per-layer timeline of collectives (inline
    SVG)."""
    rows = fold(node_rows(prog, verbose))
    colls = prog.collectives()
    e = html.escape
    body = [
        "<table><tr><th>module</th><th>op</th><th>placements</th><th>where</th><th>why</th>"
        "<th>collectives</th></tr>"
    ]
    for r in rows:
        cls = ' class="redist"' if r.collectives else ""
        body.append(
            f"<tr{cls}><td>{e(r.module or '-')}</td><td>{e(r.op)}</td><td>{e(r.placements)}</td>"
            f"<td>{e(r.where)}</td><td>{e(r.why)}</td><td>{e(_fmt_colls(r.collectives))}</td></tr>"
        )
    body.append("</table>")
    # timeline: one lane per layer (module prefix up to the layer index), bars in program order
    lanes: dict[str, list] = {}
    for c in colls:
        m = _INDEX.search(c.provenance.split(":")[0])
        lane = (
            c.provenance.split(":")[0][: m.end()] if m else (c.provenance.split(":")[0] or "(top)")
        )
        lanes.setdefault(lane, []).append(c)
    colors = {
        "all_gather": "#4e79a7",
        "reduce_scatter": "#f28e2b",
        "all_reduce": "#e15759",
        "all_to_all": "#76b7b2",
    }
    scale = 600.0 / max(1e-9, max((sum(c.cost for c in v) for v in lanes.values()), default=1.0))
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="820" height="{24 * len(lanes) + 10}">']
    for i, (lane, cs) in enumerate(lanes.items()):
        y = 5 + 24 * i
        svg.append(f'<text x="0" y="{y + 14}" font-size="11">{e(lane)}</text>')
        x = 200.0
        for c in cs:
            w = max(1.0, c.cost * scale)
            svg.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="18" '
                f'fill="{colors.get(c.kind, "#999")}">'
                f"<title>{e(c.kind)} mesh dims {list(c.mesh_dims)} {c.bytes} B {c.cost:.2f} us "
                f"{e(c.provenance)}</title></rect>"
            )
            x += w
    svg.append("</svg>")
    foot = "; ".join(_phase_lines(prog))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>fxshard plan</title><style>"
        "body{font-family:monospace;font-size:12px} table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;text-align:left} tr.redist{background:#fff3e0}"
        "</style></head><body>"
        f"<h3>fxshard plan on mesh {e(str(prog.mesh.shape))}</h3>"
        f"<p>{e(foot)}</p>"
        + "".join(svg)
        + "".join(body)
        + "".join(f"<p>fallback: {e(w)}</p>" for w in prog.warnings)
        + "</body></html>"
    )


# ---- diff ----------------------------------------------------------------------------------------


def _diff_rows(prog) -> dict:
    """{op node name: (module, op, placements, incoming collectives, cost)} for every ATen op
    node."""
    incoming: dict[str, list] = {}
    costs: dict[str, float] = {}
    for n in prog.global_graph.graph.nodes:
        rec = info(n)
        if rec.kind != "redistribute":
            continue
        cons = _consumer(n)
        plan = rec.plan
        for step, nbytes in plan.collective_bytes():
            incoming.setdefault(cons.name, []).append(
                f"{step.collective}{list(step.mesh_dims)} {nbytes}B"
            )
        costs[cons.name] = costs.get(cons.name, 0.0) + plan.cost
    out = {}
    for n in prog.global_graph.graph.nodes:
        rec = info(n)
        if n.op != "call_function" or rec.kind in ("redistribute", "boundary"):
            continue
        out[n.name] = (
            rec.module,
            _op_name(n),
            _pl(rec.spec),
            tuple(incoming.get(n.name, ())),
            costs.get(n.name, 0.0),
        )
    out_node = next(n for n in prog.global_graph.graph.nodes if n.op == "output")
    out["output"] = (
        "",
        "output",
        _pl(info(out_node).input_specs),
        tuple(incoming.get("output", ())),
        costs.get("output", 0.0),
    )
    return out


def diff(a: ShardedProgram, b: ShardedProgram, names: tuple[str, str] = ("a", "b")) -> str:
    """Unified-diff-style comparison of two programs of the same model: only ops whose placements or
    incoming collectives differ, runs of ops with the same change merged, repeated layers folded,
    with the modelled cost delta per row and in total."""
    ra, rb = _diff_rows(a), _diff_rows(b)
    changed: list[Row] = []
    for k in list(ra) + [k for k in rb if k not in ra]:
        x, y = ra.get(k), rb.get(k)
        if x is not None and y is not None and x[2:4] == y[2:4]:
            continue
        module, op = (x or y)[0], (x or y)[1]
        minus = "-" if x is None else x[2] + (f"  <- {'; '.join(x[3])}" if x[3] else "")
        plus = "-" if y is None else y[2] + (f"  <- {'; '.join(y[3])}" if y[3] else "")
        delta = (y[4] if y else 0.0) - (x[4] if x else 0.0)
        prev = changed[-1] if changed else None
        if (
            prev is not None
            and prev.module == module
            and prev.placements == f"{minus}\n{plus}"
            and "<-" not in prev.placements
            and abs(delta) < 1e-9
        ):
            prev.op += f", {op}"
            continue
        changed.append(Row(module, op, f"{minus}\n{plus}", cost=delta))
    if not changed:
        return "no difference"
    lines = []
    total = 0.0
    for r in fold(changed):
        minus, plus = r.placements.split("\n")
        mult = _layers(r.module)
        total += r.cost * mult
        lines.append(
            f"@@ {r.module or '-'}: {r.op} @@ {r.cost:+.2f} us" + (f" x{mult}" if mult > 1 else "")
        )
        lines.append(f"-{minus}")
        lines.append(f"+{plus}")
    sa = sum(v["us"] for v in summary(a).values())
    sb = sum(v["us"] for v in summary(b).values())
    head = [
        f"--- {names[0]} (mesh {a.mesh.shape}, {sa:.2f} us of collectives)",
        f"+++ {names[1]} (mesh {b.mesh.shape}, {sb:.2f} us of collectives)",
    ]
    return "\n".join(head + lines + [f"total: {sb - sa:+.2f} us ({sa:.2f} -> {sb:.2f})"])


def _layers(module: str) -> int:
    m = re.search(r"\.(\d+)-(\d+)(?=\.|$)", module)
    return int(m.group(2)) - int(m.group(1)) + 1 if m else 1


# ---- logging -------------------------------------------------------------------------------------


def log_program(prog: ShardedProgram) -> None:
    """Plan summary on the ``fxshard`` logger (``TORCH_LOGS=fxshard``) and as a structured-trace
    artifact (``TORCH_TRACE``; tlparse shows it)."""
    if log.isEnabledFor(logging.INFO):
        log.info("fxshard plan:\n%s", explain(prog))
    for m in missed_fusions(prog):
        log.info("fxshard: missed fusion: %s", m)
    trace_artifact("fxshard_explain", lambda: explain(prog))
