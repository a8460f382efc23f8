"""The redistribute stage: one explicit node per (value, wanted placement), shared by every
consumer that wants it, carrying the planner's plan; on global values it is the identity."""

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxshard
from fxshard.ir import NodeKind, info


def test_one_node_per_value_and_placement_shared_by_consumers():
    def f(x):
        return x.sum(0) + 1, x.sum(0) * 2, x.max(0).values

    x = torch.randn(8, 4)
    c = fxshard.annotate(
        fxshard.capture(f, (x,), mesh=fxshard.MeshSpec((2,))),
        input_placements=[(Shard(0),)],
        output_placements=[(Replicate(),)] * 3,
    )
    fxshard.redistribute(c)
    red = [n for n in c.gm.graph.nodes if info(n).kind == NodeKind.REDISTRIBUTE]
    plans = {(n.args[0], str(info(n).spec)) for n in red}
    assert len(red) == len(plans)  # never two nodes moving one value to one placement
    for n in red:
        assert info(n).plan.src == info(n).input_specs[0] and info(n).plan.dst == info(n).spec
    # the annotated graph is still the single-device program (a redistribute is the identity)
    for got, want in zip(c.gm(x), f(x)):
        torch.testing.assert_close(got, want)
    prog = fxshard.program(c)
    for got, want in zip(prog.simulate(x), f(x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_partial_value_is_reduced_before_it_is_handed_back():
    def f(a, b):
        return a @ b

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    c = fxshard.annotate(
        fxshard.capture(f, (a, b), mesh=fxshard.MeshSpec((2,))),
        input_placements=[(Shard(1),), (Shard(0),)],
    )
    fxshard.redistribute(c)
    (r,) = [n for n in c.gm.graph.nodes if info(n).kind == NodeKind.REDISTRIBUTE]
    assert isinstance(info(r).input_specs[0].placements[0], Partial) and info(
        r
    ).spec.placements == (Replicate(),)
    assert [s.collective for s in info(r).plan.steps] == ["all_reduce"]
