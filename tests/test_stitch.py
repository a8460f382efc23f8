"""capture(reuse_layers=True): each repeated layer traced once, copies stitched in.  The result
must be the very graph a plain trace gives (node for node) and compute the same values."""

import logging

import torch
import torch.fx as fx
import torch.nn as nn

import fxshard
from fxshard import zoo
from fxshard.passes import stitch
from fxshard.passes.capture import GRAD_TAG, capture_joint, info


def _tiny(n_layers=4):
    torch.manual_seed(0)
    cfg = zoo.LlamaConfig(dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=48,
                          max_seq_len=16)
    return zoo.init_weights(zoo.Llama(cfg)), torch.randint(0, 64, (2, 8))


def _canon(gm: fx.GraphModule) -> list:
    """Every node: op, target, arguments by position, value shape/dtype, joint-graph role, module."""
    idx = {n: i for i, n in enumerate(gm.graph.nodes)}
    by_name = {n.name: i for n, i in idx.items()}
    out = []
    for n in gm.graph.nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", idx[a]))
        if len(n.args) > 1 and isinstance(n.args[1], str) and n.args[1].startswith(GRAD_TAG):
            args = (args[0][0], GRAD_TAG + str(by_name[n.args[1][len(GRAD_TAG):]]))  # names differ, nodes not
        v = n.meta.get("val")
        rec = info(n)
        out.append((n.op, rec.fqn if n.op == "placeholder" else str(n.target), repr(args),
                    (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
                    n.meta.get("partitioner_tag"), rec.kind, rec.module))
    return out


def _run(c, tokens):
    args = []
    for p in c.gm.graph.nodes:
        if p.op == "placeholder":
            rec = info(p)
            args.append(c.state[rec.fqn] if rec.kind in ("param", "buffer") else
                        tokens if rec.kind == "input" else torch.ones(p.meta["val"].shape))
    return c.gm(*args)


def test_reuse_layers_gives_the_plain_trace_node_for_node(caplog):
    m, x = _tiny()
    blocks = {f"layers.{i}": (16, 1) for i in range(4)}  # plan="auto" marks every layer like this
    plain = capture_joint(m, [x], boundaries=blocks)
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        stitched = capture_joint(m, [x], boundaries=blocks, reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text  # really stitched
    assert _canon(stitched.gm) == _canon(plain.gm)
    a, b = _run(plain, x), _run(stitched, x)
    assert len(a) == len(b) and all(u is None and v is None or torch.equal(u, v) for u, v in zip(a, b))


def test_a_layer_with_its_own_state_is_traced_inline(caplog):
    m, x = _tiny()
    m.layers[2].attention.window = 4  # an attribute the others lack: layer 2 is not like them
    groups = stitch.repeated_layers(m)
    assert [[f for f, _ in g] for g in groups] == [["layers.0", "layers.1", "layers.3"]]
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        stitched = capture_joint(m, [x], reuse_layers=True)
    assert "reuse_layers does not apply" not in caplog.text
    assert _canon(stitched.gm) == _canon(capture_joint(m, [x]).gm)


class _KwargLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(input=x)
        return x.sum()


def test_calls_it_cannot_represent_fall_back_to_the_plain_trace(caplog):
    m, x = _KwargLayers(), torch.randn(2, 8)
    with caplog.at_level(logging.INFO, logger="fxshard.stitch"):
        c = capture_joint(m, [x], reuse_layers=True)
    assert "keyword or non-tensor arguments" in caplog.text
    assert _canon(c.gm) == _canon(capture_joint(m, [x]).gm)
    assert all("forward" not in vars(layer) for layer in m.layers)  # the class's forward again


def test_auto_plan_on_a_stitched_capture_matches_single_device():
    m = zoo.init_weights(zoo.Llama(zoo.LlamaConfig(n_layers=3)))
    x = zoo.example_input(m, batch=4)
    prog = fxshard.shard(m, fxshard.MeshSpec((2, 2), names=("dp", "tp")), plan="auto", example_inputs=x,
                         training=True, reuse_layers=True)
    assert prog.captured.auto.shared_layers == 2
    ref = m(*x)
    out, grads = prog.simulate(*x, grad_outputs=(torch.ones_like(ref),))
    ref.backward(torch.ones_like(ref))
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5
    for fqn, p in m.named_parameters():
        assert ((grads[fqn] - p.grad).abs().max() / p.grad.abs().max()).item() < 1e-5, fqn
