"""The researcher API: stages one by one, hand edits, rules, cost models, passes, calibration."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from models import MLP, Llama, example_input, init_weights, megatron_tp_plan, mlp_plan
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard.ir import info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = fxshard.MeshSpec((2, 2), names=("dp", "tp"))


def test_stages_one_by_one_equal_shard():
    model = init_weights(Llama())
    x = example_input(model)
    prog = fxshard.shard(model, MESH, megatron_tp_plan(), example_inputs=x)
    c = fxshard.capture(model, x, mesh=MESH, plan=megatron_tp_plan())
    fxshard.annotate(c)
    fxshard.redistribute(c)
    staged = fxshard.program(c)
    assert staged.explain() == prog.explain()
    assert staged.local_graph.code == prog.local_graph.code
    assert fxshard.diff(prog, staged) == "no difference"


class ExpensiveAllToAll:
    """A user cost model: the default costs, but all-to-all 1000x dearer."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.base = fxshard.CostModel(mesh)

    def collective(self, kind, mesh_dims, local_bytes):
        c = self.base.collective(kind, mesh_dims, local_bytes)
        return c * 1000 if kind == "all_to_all" else c


def test_custom_cost_model_changes_the_plan():
    mesh = fxshard.MeshSpec((4,))
    default = fxshard.plan_redistribute(mesh, (Shard(0),), (Shard(1),), (64, 64))
    assert [s.collective for s in default.steps] == ["all_to_all"]
    dear = fxshard.plan_redistribute(
        mesh, (Shard(0),), (Shard(1),), (64, 64), cost_model=ExpensiveAllToAll(mesh)
    )
    assert [s.collective for s in dear.steps if s.collective] == ["all_gather"]

    def f(x):
        return x.t() * 2  # Shard(0) in, Shard(0) out: transposing needs an all-to-all or a gather

    x = torch.randn(8, 8)
    kw = dict(example_inputs=(x,), input_placements=[(Shard(0),)], output_placements=[(Shard(0),)])
    a = fxshard.shard(f, mesh, **kw)
    b = fxshard.shard(f, mesh, cost_model=ExpensiveAllToAll(mesh), **kw)
    assert {c.kind for c in a.collectives()} == {"all_to_all"}
    assert "all_to_all" not in {c.kind for c in b.collectives()}
    torch.testing.assert_close(b.simulate(x), f(x))


def test_user_passes_run_at_their_points():
    seen = []

    def after_annotate(gm, c):
        seen.append(("after_annotate", c.stage))

    def after_redistribute(gm, c):
        seen.append(
            ("after_redistribute", sum(info(n).kind == "redistribute" for n in gm.graph.nodes))
        )

    def after_lower(local, prog):
        seen.append(("after_lower", sum("all_reduce" in str(n.target) for n in local.graph.nodes)))

    after_lower.stage = "after_lower"
    model = init_weights(MLP())
    x = example_input(model)
    prog = fxshard.shard(
        model,
        fxshard.MeshSpec((2,)),
        mlp_plan(),
        example_inputs=x,
        passes=[
            ("after_annotate", after_annotate),
            ("after_redistribute", after_redistribute),
            after_lower,
        ],
    )
    assert prog.local_graph is not None
    assert seen == [("after_annotate", "annotated"), ("after_redistribute", 2), ("after_lower", 1)]
    with pytest.raises(ValueError, match="is not one of"):
        fxshard.shard(
            model,
            fxshard.MeshSpec((2,)),
            mlp_plan(),
            example_inputs=x,
            passes=[("before_x", print)],
        )


@pytest.mark.parametrize("script", ["custom_op_rule.py", "user_pass.py", "step_through.py"])
def test_examples_run(script):
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "matches single device" in res.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _calibrate_worker(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        cm = fxshard.calibrate(dm, sizes=(1 << 10, 1 << 14, 1 << 18), repeats=3)
        plan = fxshard.plan_redistribute(
            cm.mesh, (Shard(0), Partial()), (Replicate(), Replicate()), (256, 256), cost_model=cm
        )
        if rank == 0:
            out.put((cm.mesh.bandwidth, cm.mesh.latency, plan.cost))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_calibrate_on_gloo():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(
        _calibrate_worker, args=(4, _free_port(), q), nprocs=4, join=True, start_method="spawn"
    )
    bw, lat, cost = q.get(timeout=10)
    assert all(b > 0 for b in bw) and all(x >= 0 for x in lat) and cost > 0
