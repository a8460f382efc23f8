"""Fewer collectives: planner-native fusion over flattened mesh dims, and bucketing."""


import pytest
import torch
from models import Llama, example_input, init_weights
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

import fxshard
from fxshard.passes.fuse import bucket_collectives
from fxshard.passes.lower import collective_nodes
from fxshard.planner.execute import execute_plan, group_names, mesh_coordinate
from fxshard.simulate import SimulatedMesh

R, P = Replicate(), Partial()


@pytest.mark.parametrize("mesh_shape", [(2, 2), (2, 4), (2, 2, 2)])
@pytest.mark.parametrize("src,dst,kind", [
    ("SS", "RR", "all_gather"), ("PP", "SS", "reduce_scatter"), ("PP", "RR", "all_reduce"),
    ("SS", "TT", "all_to_all")])
def test_fusable_patterns_become_one_collective(mesh_shape, src, dst, kind):
    n = len(mesh_shape)
    code = {"S": Shard(0), "T": Shard(1), "R": R, "P": P}
    s = tuple(code[src[0]] for _ in range(n))
    d = tuple(code[dst[0]] for _ in range(n))
    mesh = fxshard.MeshSpec(mesh_shape)
    fused = fxshard.plan_redistribute(mesh, s, d, (64, 64), fuse=True)
    plain = fxshard.plan_redistribute(mesh, s, d, (64, 64))
    colls = [st for st in fused.steps if st.collective]
    assert [c.collective for c in colls] == [kind] and colls[0].mesh_dims == tuple(range(n)), str(fused)
    assert len([st for st in plain.steps if st.collective]) == n
    assert fused.cost < plain.cost


def test_mixed_sum_and_avg_reduce_in_one_all_reduce():
    """Partial(sum) on one mesh dim, Partial(avg) on another: one sum all-reduce over both, then a scale."""
    mesh = fxshard.MeshSpec((2, 4))
    src = (Partial("sum"), Partial("avg"))
    plan = fxshard.plan_redistribute(mesh, src, (R, R), (8, 8), fuse=True)
    assert [(s.collective, s.mesh_dims) for s in plan.steps if s.collective] == [("all_reduce", (0, 1))]
    full = torch.randn(8, 8)
    with SimulatedMesh((2, 4)) as sim:
        x = sim.distribute(full, plan.src, partial_seed=0)
        y = execute_plan(plan, x, group_names(sim.device_mesh), mesh_coordinate(sim.device_mesh))
        torch.testing.assert_close(sim.assemble(y, plan.dst), full, rtol=1e-5, atol=1e-5)
    # max cannot share a collective with sum
    with pytest.raises(ValueError, match="only sum and avg may be mixed"):
        fxshard.plan_redistribute(mesh, (Partial("sum"), Partial("max")), (R, R), (8, 8))


def _make_graph():
    F = torch.ops._c10d_functional

    def f(x, y):
        a = F.wait_tensor(F.all_reduce(x, "sum", "g0"))
        b = F.wait_tensor(F.all_reduce(a * 2, "sum", "g0"))  # depends on a: never in a's bucket
        c = F.wait_tensor(F.all_reduce(y, "sum", "g0"))  # independent of both
        d = F.wait_tensor(F.all_gather_into_tensor(y + 1, 2, "g0"))
        e = F.wait_tensor(F.all_gather_into_tensor(x - 1, 2, "g0"))
        return a, b, c, d, e

    return make_fx(f, tracing_mode="fake")(torch.randn(4, 3), torch.randn(2, 5))


def test_bucketing_respects_dependencies_and_keeps_results():
    gm = _make_graph()
    with SimulatedMesh((2,)) as sim:
        from fxshard.adapter import make_local_tensor

        xs = make_local_tensor({r: torch.randn(4, 3) for r in range(2)})
        ys = make_local_tensor({r: torch.randn(2, 5) for r in range(2)})
        groups = group_names(sim.device_mesh)
        ref = _rename(gm, groups[0])(xs, ys)
        removed = bucket_collectives(gm)
        assert removed == 2  # (b, c) share a bucket, (d, e) another; a stays alone
        buckets = [n.meta.get("fxshard_bucket") for n in collective_nodes(gm)]
        assert sorted(map(len, (b or [None] for b in buckets))) == [1, 2, 2]
        out = _rename(gm, groups[0])(xs, ys)
        for o, r in zip(out, ref):
            from fxshard.adapter import local_tensor_values

            for a, b in zip(local_tensor_values(o, 2).values(), local_tensor_values(r, 2).values()):
                torch.testing.assert_close(a, b)


def _rename(gm, name):
    import copy

    out = copy.deepcopy(gm)
    for n in collective_nodes(out):
        n.args = (*n.args[:-1], name)
    out.recompile()
    return out


def test_bucketing_in_a_sharded_program():
    def f(a, b, c, d):
        return a @ b, c @ d

    xs = [torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 16), torch.randn(16, 6)]
    prog = fxshard.shard(f, fxshard.MeshSpec((2,)), example_inputs=xs,
                         input_placements=[(Shard(1),), (Shard(0),), (Shard(1),), (Shard(0),)],
                         output_placements=[(R,), (R,)])
    assert [c.kind for c in prog.collectives()] == ["all_reduce", "all_reduce"]
    assert len(collective_nodes(prog.local_graph)) == 1 and prog.bucketed == 1
    for o, r in zip(prog.simulate(*xs), f(*xs)):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)


def test_llama_sequence_on_two_mesh_dims_fuses():
    """On a 2-D (dp, tp) mesh with the sequence sharded over both dims (dp x cp-like), gathers and
    scatters run over the flattened mesh: fewer collectives, same numbers."""
    model = init_weights(Llama())
    x = example_input(model, batch=2, seq=16)
    mesh = fxshard.MeshSpec((2, 2), names=("dp", "tp"))
    kw = dict(example_inputs=x, input_placements=[(Shard(1), Shard(1))])
    plain = fxshard.shard(model, mesh, None, fuse=False, **kw)
    fused = fxshard.shard(model, mesh, None, **kw)
    before, after = len(plain.collectives()), len(fused.collectives())
    assert after < before
    assert any(c.mesh_dims == (0, 1) for c in fused.collectives())
    ref = model(*x)
    torch.testing.assert_close(fused.simulate(*x), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plain.simulate(*x), ref, rtol=1e-5, atol=1e-5)
    assert "missed fusion" in plain.explain() and "missed fusion" not in fused.explain()



def test_bucket_cap_is_respected():
    def f(a, b, c, d):
        return a @ b, c @ d

    xs = [torch.randn(8, 16), torch.randn(16, 4), torch.randn(8, 16), torch.randn(16, 6)]
    kw = dict(example_inputs=xs, input_placements=[(Shard(1),), (Shard(0),), (Shard(1),), (Shard(0),)],
              output_placements=[(R,), (R,)])
    small = fxshard.shard(f, fxshard.MeshSpec((2,)), bucket_bytes=100, **kw)  # 8*4*4 + 8*6*4 bytes > 100
    assert len(collective_nodes(small.local_graph)) == 2 and small.bucketed == 0
    off = fxshard.shard(f, fxshard.MeshSpec((2,)), bucket_bytes=0, **kw)
    assert len(collective_nodes(off.local_graph)) == 2
