"""fxshard's redistribution planner vs torch's graph-based (Dijkstra) and greedy planners.

Random (src, dst) cases on meshes from 1-D to 5-D.  In the same run, for every case: fxshard's plan,
torch's graph-based plan and torch's greedy plan, each timed uncached (fresh planner, caches
cleared) and each scored step by step with torch's own ``one_step_redistribute_cost``.  fxshard
plans with torch's cost figures for the same mesh (``torch_compatible``: same bandwidth/latency,
torch's +1 µs all-to-all placeholder) so that "lower cost" means a better search, not a different
model.

    python benchmarks/planner.py [--cases-per-mesh 40] [--seed 0] [--quick] [--fuse]

``--fuse`` instead times fxshard's fused planning (``fuse=True``: one collective may span several
mesh dims, the redistribute pass's default) against its unfused planning on the same cases; torch
has no fused plans to compare with.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import random
import statistics
import sys
import time

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard import _torch as adapter
from fxshard.core.spec import level_positions

MESHES = [(8,), (2, 4), (8, 8), (2, 2, 4), (4, 4, 4), (2, 2, 2, 8), (2, 4, 2, 4), (2, 2, 2, 2, 2)]


def random_placements(rng, mesh_ndim, ndim, partial_op):
    opts = [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial(partial_op)]
    weights = [2] + [3] * ndim + [1]
    return tuple(rng.choices(opts, weights, k=mesh_ndim))


def random_order(rng, placements):
    by_dim = {}
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            by_dim.setdefault(p.dim, []).append(m)
    if not any(len(v) > 1 for v in by_dim.values()) or rng.random() < 0.5:
        return None
    out = {}
    for d, ms in by_dim.items():
        ms = list(ms)
        rng.shuffle(ms)
        out[d] = tuple(ms)
    return out


def random_case(rng, mesh):
    ndim = rng.randint(1, 4)
    even = rng.random() < 0.5
    base = {1: 4096, 2: 1024, 3: 128, 4: 32}[ndim]
    if even:
        shape = tuple(base * rng.choice([1, 2]) for _ in range(ndim))
    else:
        shape = tuple(rng.randint(base // 2, base * 2) | 1 for _ in range(ndim))
    dtype = rng.choice([torch.float32, torch.bfloat16])
    op = rng.choice(["sum", "sum", "avg"])
    src = random_placements(rng, len(mesh), ndim, op)
    dst = random_placements(rng, len(mesh), ndim, op)
    return shape, dtype, src, random_order(rng, src), dst, random_order(rng, dst)


def timed(fn, repeat=1):
    """Best of ``repeat`` runs, with the garbage collector paused while timing (as ``timeit``
    does): a collection triggered by the other planners' garbage would otherwise land at random
    in whichever planner runs next.  Applied alike to every planner."""
    best = math.inf
    out = None
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeat):
            t = time.perf_counter()
            out = fn()
            best = min(best, time.perf_counter() - t)
    finally:
        if enabled:
            gc.enable()
    return out, best


def plan_uncached(ms, cm, src, dst, shape, dtype, so, do, fuse=False):
    fxshard.clear_plan_cache()
    level_positions.cache_clear()
    return fxshard.plan_redistribute(
        ms,
        src,
        dst,
        shape,
        dtype=dtype,
        src_order=so,
        dst_order=do,
        cost_model=cm,
        cache=False,
        multi_dim_collectives=fuse,
    )


def run_fused(n, rng):
    """fxshard fused vs unfused on the same random cases: times and how much fusion saves."""
    print(
        "| mesh | cases | fused median / max ms | unfused median / max ms | fused cheaper | "
        "median saving where cheaper |"
    )
    print("|" + "---|" * 6)
    for mesh in MESHES:
        dm = adapter.torch_planning_mesh(mesh)
        bw, lat = adapter.torch_topology(dm)
        ms = fxshard.MeshSpec(mesh, bandwidth=bw, latency=lat)
        cm = fxshard.torch_compatible(ms)
        tf, tu, saving = [], [], []
        for _ in range(n):
            shape, dtype, src, so, dst, do = random_case(rng, mesh)
            plan = functools.partial(plan_uncached, ms, cm, src, dst, shape, dtype, so, do)
            pf, t_f = timed(functools.partial(plan, fuse=True), repeat=3)
            pu, t_u = timed(plan, repeat=3)
            assert pf.cost <= pu.cost + 1e-6 * max(1.0, pu.cost), (
                src,
                dst,
                shape,
                pf.cost,
                pu.cost,
            )
            tf.append(t_f * 1e3)
            tu.append(t_u * 1e3)
            if pf.cost < pu.cost - 1e-9 * max(1.0, pu.cost):
                saving.append(100.0 * (1 - pf.cost / pu.cost))
        print(
            f"| {mesh} | {n} | {statistics.median(tf):.3f} / {max(tf):.2f} | "
            f"{statistics.median(tu):.3f} / "
            f"{max(tu):.2f} | {len(saving)} | {statistics.median(saving) if saving else 0.0:.1f}% "
            "|",
            flush=True,
        )
    return 0


def run_mesh(mesh, n_cases, rng, torch_graph=True):
    dm = adapter.torch_planning_mesh(mesh)
    bw, lat = adapter.torch_topology(dm)
    ms = fxshard.MeshSpec(mesh, bandwidth=bw, latency=lat)
    cm = fxshard.torch_compatible(ms)
    rows = []
    for _ in range(n_cases):
        shape, dtype, src, so, dst, do = random_case(rng, mesh)

        plan, t_ours = timed(
            functools.partial(plan_uncached, ms, cm, src, dst, shape, dtype, so, do), repeat=3
        )
        tsrc, _ = adapter.torch_plan(dm, src, dst, shape, dtype, so, do, graph=False)
        ours_steps = [(s.mesh_dims[0], s.src, s.dst) for s in plan.steps]
        c_ours = adapter.torch_score(tsrc, ours_steps)
        assert abs(c_ours - plan.cost) <= 1e-6 * max(1.0, plan.cost), (src, dst, c_ours, plan.cost)
        row = {"t_ours": t_ours, "c_ours": c_ours}
        if torch_graph:
            (_, steps), t_graph = timed(
                functools.partial(
                    adapter.torch_plan, dm, src, dst, shape, dtype, so, do, graph=True
                )
            )
            row.update(t_graph=t_graph, c_graph=adapter.torch_score(tsrc, steps))
        # greedy ignores shard order: only comparable on default orders
        if so is None and do is None:
            (_, steps), t_greedy = timed(
                functools.partial(adapter.torch_plan, dm, src, dst, shape, dtype, graph=False)
            )
            row.update(t_greedy=t_greedy, c_greedy=adapter.torch_score(tsrc, steps))
        rows.append(row)
    return rows


def compare(rows, key):
    lo = eq = hi = 0
    for r in rows:
        if key not in r:
            continue
        a, b = r["c_ours"], r[key]
        if math.isinf(b) and not math.isinf(a):
            lo += 1
        elif abs(a - b) <= 1e-6 * max(1.0, abs(b)):
            eq += 1
        elif a < b:
            lo += 1
        else:
            hi += 1
    return lo, eq, hi


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases-per-mesh", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="8 cases per mesh, for a smoke run")
    ap.add_argument("--fuse", action="store_true", help="fxshard fused vs unfused planning instead")
    args = ap.parse_args(argv)
    n = 8 if args.quick else args.cases_per_mesh
    rng = random.Random(args.seed)
    if args.fuse:
        return run_fused(n, rng)
    header = (
        "| mesh | cases | fxshard median / max ms | torch graph median / max ms | speedup (median) "
        "| "
        "torch greedy median ms | vs graph: lower/equal/higher | vs greedy: lower/equal/higher |"
    )
    print(header)
    print("|" + "---|" * 8)
    all_rows = []
    for mesh in MESHES:
        rows = run_mesh(mesh, n, rng)
        all_rows += rows
        to = [r["t_ours"] * 1e3 for r in rows]
        tg = [r["t_graph"] * 1e3 for r in rows]
        tgr = [r["t_greedy"] * 1e3 for r in rows if "t_greedy" in r]
        speed = statistics.median(g / o for g, o in zip(tg, to))
        print(
            f"| {mesh} | {len(rows)} | {statistics.median(to):.3f} / {max(to):.3f} | "
            f"{statistics.median(tg):.1f} / {max(tg):.1f} | {speed:.0f}x | "
            f"{statistics.median(tgr) if tgr else float('nan'):.3f} | "
            f"{'/'.join(map(str, compare(rows, 'c_graph')))} | "
            f"{'/'.join(map(str, compare(rows, 'c_greedy')))} |",
            flush=True,
        )
    lo, eq, hi = compare(all_rows, "c_graph")
    print(
        f"\nall: {len(all_rows)} cases; vs torch graph-based lower {lo}, equal {eq}, higher {hi}; "
        f"vs greedy {'/'.join(map(str, compare(all_rows, 'c_greedy')))}"
    )
    return 0 if hi == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
