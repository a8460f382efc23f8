"""The lower stage: one rank-agnostic per-rank graph (the mesh coordinate is an input), local
shapes, functional collectives that record the planned step each one runs."""

import torch
from models import MLP, Llama, LlamaConfig, example_input, init_weights, megatron_tp_plan, mlp_plan
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.ir import info
from fxshard.passes.lower import collective_nodes


def test_every_collective_carries_its_planned_step_in_order():
    model = init_weights(Llama(LlamaConfig(n_layers=2)))
    x = example_input(model)
    prog = fxshard.shard(
        model,
        fxshard.MeshSpec((2, 2), names=("dp", "tp")),
        megatron_tp_plan(),
        example_inputs=x,
        bucket_bytes=0,
    )
    planned = prog.planned_collectives()
    nodes = collective_nodes(prog.local_graph)
    assert len(nodes) == len(planned) == 4  # Megatron TP: 2 all-reduces per layer
    assert [info(n).carries for n in nodes] == [(c,) for c in planned]
    assert [c.kind for c in prog.collectives()] == [c.kind for c in planned]


def test_one_graph_serves_every_rank():
    """The coordinate is the first input and nothing rank-specific is baked in: the per-rank graph
    of a 4-rank mesh equals the 2-rank one's in structure (only group names and sizes differ)."""
    model = init_weights(MLP())
    x = example_input(model)
    prog = fxshard.shard(model, fxshard.MeshSpec((4,)), mlp_plan(), example_inputs=x)
    local = prog.local_graph
    first = next(n for n in local.graph.nodes if n.op == "placeholder")
    assert first.name == "mesh_coord"
    shapes = [tuple(n.meta["val"].shape) for n in local.graph.nodes if n.op == "placeholder"][1:]
    specs = [info(p).spec for p in prog.placeholders]
    assert shapes == [s.local_shape((0,)) for s in specs] == [s.local_shape((3,)) for s in specs]
    torch.testing.assert_close(prog.simulate(*x), model(*x), rtol=1e-5, atol=1e-5)


def test_vocab_parallel_embedding_is_a_masked_local_lookup():
    emb = torch.nn.Embedding(16, 4)
    idx = torch.randint(0, 16, (3, 5))
    prog = fxshard.shard(
        lambda t, w: torch.nn.functional.embedding(t, w),
        fxshard.MeshSpec((4,)),
        example_inputs=(idx, emb.weight.detach()),
        input_placements=[(Replicate(),), (Shard(0),)],
        output_placements=[(Replicate(),)],
    )
    assert [c.kind for c in prog.planned_collectives()] == [
        "all_reduce"
    ]  # the partial lookups summed
    assert any(n.target is torch.ops.aten.masked_fill.Scalar for n in prog.local_graph.graph.nodes)
    torch.testing.assert_close(prog.simulate(idx, emb.weight.detach()), emb(idx))
