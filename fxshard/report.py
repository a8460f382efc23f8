"""Readable plans: ``explain`` (a first version; a later issue polishes it)."""

from __future__ import annotations

from .passes.capture import info
from .spec import placements_str


def _pl(spec) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return ",".join(_pl(s) for s in spec)
    return placements_str(spec.placements, spec.levels)


def explain(prog, verbose: bool = False) -> str:
    """One row per node that matters: parameters and inputs, constrained module boundaries, every
    redistribute with its collectives and cost, and fallbacks (``verbose=True``: every node)."""
    rows = []
    for n in prog.graph.graph.nodes:
        rec = info(n)
        if n.op == "output":
            continue
        if not verbose and rec.kind not in ("redistribute", "param", "buffer", "constant", "input") \
                and not rec.provenance.startswith(("fallback", "factory")) \
                and not (rec.kind == "boundary" and rec.provenance != "passthrough"):
            continue
        if rec.kind == "redistribute":
            plan = rec.plan
            coll = [s for s in plan.steps if s.collective]
            what = ", ".join(f"{s.collective}[{','.join(map(str, s.mesh_dims))}]" for s in coll) or "local"
            rows.append((rec.module, n.name, "redistribute", _pl(plan.src) + " -> " + _pl(plan.dst),
                         f"{what} {plan.cost:.1f}us", rec.provenance))
        elif n.op == "placeholder":
            rows.append((rec.module, n.name, rec.kind + (f" {rec.fqn}" if rec.fqn else ""), _pl(rec.spec), "",
                         rec.provenance))
        else:
            target = getattr(n.target, "__name__", str(n.target))
            rows.append((rec.module, n.name, target, _pl(rec.spec), rec.source, rec.provenance))
    widths = [max(len(r[i]) for r in rows + [("module", "node", "op", "placements", "where", "why")])
              for i in range(6)]
    head = ("module", "node", "op", "placements", "where", "why")
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    colls = prog.collectives()
    kinds = {}
    for c in colls:
        k = kinds.setdefault(c.kind, [0, 0, 0.0])
        k[0] += 1
        k[1] += c.bytes
        k[2] += c.cost
    lines.append("")
    summary = ", ".join(f"{k} x{v[0]} ({v[1]} B, {v[2]:.1f} us)" for k, v in sorted(kinds.items()))
    lines.append("collectives: " + (summary or "none"))
    for w in prog.warnings:
        lines.append(f"fallback: {w}")
    return "\n".join(lines)
