"""Every legal state of a reshape from a sharded input, plain or strided, run on simulated ranks.

    python scripts/strided_reshapes.py              # with fxshard's check (expect 0 wrong)
    python scripts/strided_reshapes.py --unchecked  # DTensor's view rule alone

For shapes (4, 120), (2, 3, 24), (6, 8), a handful of views each, every ``Shard`` and
``_StridedShard`` input placement (each tensor dim, split factors 1 (plain) to 4, each mesh dim,
the other mesh dim replicated or sharded) on meshes (2,), (2, 2), (2, 3), (3, 2): each state
``PlacementProblem.legal_states`` offers for the view with the input so placed runs through the
lowering's per-rank interpreter (``rulecheck``) and is compared with single device.
``--unchecked`` turns off ``placement.problem.reshapes_soundly`` (fxshard's index-by-index check)
to count what the rules alone propose.  About a minute.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import fxshard  # noqa: E402
from fxshard._torch import Replicate, Shard, StridedShard  # noqa: E402
from fxshard.core.cost import CostModel  # noqa: E402
from fxshard.core.spec import ShardingSpec  # noqa: E402
from fxshard.placement import problem as problem_mod  # noqa: E402
from fxshard.placement.constraints import resolve_plan  # noqa: E402
from fxshard.runtime import rulecheck  # noqa: E402
from fxshard.runtime.simulate import SimulatedMesh  # noqa: E402

CASES = [
    ((4, 120), [(48, 10), (480,), (4, 2, 60), (4, 60, 2), (2, 2, 120), (8, 60), (4, 12, 10)]),
    ((2, 3, 24), [(6, 24), (2, 72), (2, 3, 2, 12), (2, 3, 12, 2), (144,)]),
    ((6, 8), [(48,), (3, 2, 8), (6, 2, 4), (12, 4), (2, 24)]),
]
MESHES = [(2,), (2, 2), (2, 3), (3, 2)]


def states(x, view, mesh_shape, placements):
    """(strided states offered, wrong ones) of ``x.view(view)`` with ``x`` in ``placements``."""
    op = torch.ops.aten.view.default
    want = op(x, list(view))
    gm, node, tensors = rulecheck._one_node_graph(op, (x, list(view)), {}, [want])
    mesh = fxshard.MeshSpec(mesh_shape)
    pb = problem_mod.PlacementProblem(mesh, CostModel(mesh), resolve_plan(None, None, mesh))
    given = ShardingSpec.make(mesh, placements, x.shape, x.dtype)
    n = bad = 0
    with SimulatedMesh(mesh_shape) as sim:
        for ins, outs in pb.legal_states(node, [given]).states:
            if ins[0] != given:
                continue
            n += 1
            bad += rulecheck._run_state(sim, gm, node, tensors, ins, outs, [want]) is not None
    return n, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unchecked", action="store_true", help="DTensor's view rule alone")
    args = ap.parse_args()
    if args.unchecked:
        problem_mod.reshapes_soundly = lambda node, ins, outs: True
    total = wrong = 0
    for mesh in MESHES:
        m_total = m_wrong = 0
        for shape, views in CASES:
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
            for d in range(len(shape)):
                for sf in (1, 2, 3, 4):
                    for m in range(len(mesh)):
                        others = [None]
                        if len(mesh) > 1:
                            others += [Shard(e) for e in range(len(shape))]
                        for other in others:
                            plc = [Replicate()] * len(mesh)
                            plc[m] = Shard(d) if sf == 1 else StridedShard(d, split_factor=sf)
                            if other is not None:
                                plc[1 - m] = other
                            for v in views:
                                try:
                                    n, bad = states(x, v, mesh, tuple(plc))
                                except ValueError:  # a placement these sizes do not take
                                    continue
                                m_total, m_wrong = m_total + n, m_wrong + bad
        print(f"mesh {str(mesh):8} view states {m_total:5d}  wrong {m_wrong:4d}")
        total, wrong = total + m_total, wrong + m_wrong
    print(f"all: {total} states, {wrong} wrong ({'unchecked' if args.unchecked else 'checked'})")


if __name__ == "__main__":
    main()
