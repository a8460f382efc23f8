"""Plots of the measured tables on the benchmark page, for readers who would rather look.

    make plots                         # installs matplotlib into the venv, then runs this
    python benchmarks/plots.py [--out docs/img] [--check]

The figures are drawn from the tables of ``docs/benchmarks.md`` as they stand (each table carries
its command, date and machine there), so a re-measured table and its plot cannot disagree: rerun
this after editing a table. ``--check`` only parses the tables (no matplotlib needed); the tests
run it, so a table whose header changes is noticed."""

from __future__ import annotations

import argparse
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "benchmarks.md")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of ``text``: (header cells, rows of cells)."""
    out, lines = [], text.splitlines()
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1]):
            head = _cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((head, rows))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip().strip("*") for c in line.strip().strip("|").split("|")]


def find(all_tables, *columns: str):
    """The first table whose header starts with ``columns``, as a list of {column: cell}."""
    for head, rows in all_tables:
        if head[: len(columns)] == list(columns):
            return [dict(zip(head, r)) for r in rows]
    raise LookupError(f"docs/benchmarks.md has no table with columns {columns}")


def _num(cell: str) -> float:
    return float(re.match(r"[-+0-9.e]+", cell.strip()).group(0))


# (file name, title, columns that identify the table, draw function name)
FIGURES = [
    ("planner_time.svg", "Planning one redistribution: fxshard vs torch's planner",
     ("mesh", "cases", "fxshard median / max ms", "torch graph median / max ms"), "planner"),
    ("hf_forward.svg", "transformers models, forward step on 4 gloo ranks: fxshard vs HF's own TP",
     ("arch", "collectives HF / fxshard", "step ms HF", "step ms fxshard"), "hf_forward"),
    ("hf_decode.svg", "transformers models, greedy decoding on 4 gloo ranks: tokens/s",
     ("arch, cache", "tok/s HF", "tok/s fxshard"), "hf_decode"),
    ("moe_ep.svg", "Expert parallelism, forward step on 4 gloo ranks",
     ("arch", "variant", "collectives", "bytes / rank", "step ms"), "moe_ep"),
    ("auto_plan_time.svg", "plan=\"auto\" on LLaMA-3-8B shapes, 8x8 mesh: time to plan by depth",
     ("layers", "nodes", "capture s", "auto plan s"), "auto_plan"),
]  # fmt: skip


def _bars(ax, labels, series, ylabel):
    import numpy as np

    x = np.arange(len(labels))
    w = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * w, values, w, label=name)
    ax.set_xticks(x, labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.legend()


def planner(ax, rows):
    meshes = [r["mesh"] for r in rows]
    for col, name in [
        ("fxshard median / max ms", "fxshard (median)"),
        ("torch graph median / max ms", "torch's graph planner (median)"),
        ("torch greedy median ms", "torch's greedy planner (median)"),
    ]:
        ax.plot(meshes, [_num(r[col]) for r in rows], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("mesh")
    ax.set_ylabel("ms per redistribution (log)")
    ax.tick_params(axis="x", rotation=30)
    ax.legend()


def hf_forward(ax, rows):
    labels = [f"{r['arch']}\n({r['collectives HF / fxshard']} coll.)" for r in rows]
    series = {
        "HF TP + torch.compile": [_num(r["step ms HF"]) for r in rows],
        "fxshard": [_num(r["step ms fxshard"]) for r in rows],
    }
    _bars(ax, labels, series, "forward step ms (median)")


def hf_decode(ax, rows):
    labels = [r["arch, cache"] for r in rows]
    series = {
        "HF TP + torch.compile": [_num(r["tok/s HF"]) for r in rows],
        "fxshard": [_num(r["tok/s fxshard"]) for r in rows],
    }
    _bars(ax, labels, series, "tokens/s (higher is better)")


def moe_ep(ax, rows):
    archs = list(dict.fromkeys(r["arch"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    step = {(r["arch"], r["variant"]): _num(r["step ms"]) for r in rows}
    series = {v: [step.get((a, v), 0.0) for a in archs] for v in variants}
    _bars(ax, archs, series, "forward step ms (median)")


def auto_plan(ax, rows):
    labels = [r["layers"] for r in rows]
    capture = [_num(r["capture s"]) for r in rows]
    plan = [_num(r["auto plan s"]) for r in rows]
    ax.bar(labels, capture, label="capture")
    ax.bar(labels, plan, bottom=capture, label="plan (annotate + redistribute)")
    ax.set_xlabel("layers")
    ax.set_ylabel("seconds")
    ax.tick_params(axis="x", rotation=15)
    ax.legend()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "img"))
    ap.add_argument("--check", action="store_true", help="parse the tables only; draw nothing")
    ap.add_argument("--format", default="svg", choices=["svg", "png"])
    args = ap.parse_args()
    with open(PAGE) as f:
        all_tables = tables(f.read())
    data = [(fig, find(all_tables, *fig[2])) for fig in FIGURES]
    for (name, _, _, _), rows in data:
        assert rows, f"{name}: its table is empty"
        print(f"{name}: {len(rows)} rows")
    if args.check:
        return
    import matplotlib

    matplotlib.use("svg" if args.format == "svg" else "agg")
    import matplotlib.pyplot as plt

    plt.rcParams["svg.hashsalt"] = "fxshard"  # the same table draws the same file
    os.makedirs(args.out, exist_ok=True)
    for (name, title, _, draw), rows in data:
        name = name.replace(".svg", f".{args.format}")
        fig, ax = plt.subplots(figsize=(8, 4.2))
        globals()[draw](ax, rows)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        meta = {"Date": None} if args.format == "svg" else {}
        fig.savefig(os.path.join(args.out, name), metadata=meta)
        plt.close(fig)
        print(f"wrote {os.path.relpath(os.path.join(args.out, name), ROOT)}")


if __name__ == "__main__":
    main()
