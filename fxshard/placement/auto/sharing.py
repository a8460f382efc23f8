"""Repeated layers share decisions: which nodes of which layer instance are alike.

A layer instance's nodes are the forward nodes between its input and output markers, their
backward nodes (by AOT's ``seq_nr``) and its parameters; two instances whose node signatures are
equal (op, target, role, FQN inside the layer, shapes, arguments by position) take one decision
per node.  Gradient accumulations are compared separately: the first and last layers, bordering
the embedding and the head, accumulate differently.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ...ir import BUFFER, CONSTANT, GRAD_TAG, PARAM, NodeKind, arg_key, flat_args, info


def layer_instances(
    gm: fx.GraphModule, blocks: list[list[str]]
) -> dict[str, list[tuple[list, list]]]:
    """{first block fqn: [(core nodes, accumulation nodes) of each instance]} from the capture's
    block markers (forward nodes between a block's input and output boundaries), backward nodes by
    their forward op (AOT's ``seq_nr``), parameters by FQN prefix; gradient accumulations (no
    layer's
    ``seq_nr``) by their most recent input, kept apart since the first and last layers differ
    there."""
    owner = {f: g[0] for g in blocks for f in g}
    inst_of: dict[fx.Node, str] = {}
    current = None
    seq_owner: dict[int, str] = {}
    for n in gm.graph.nodes:
        rec = info(n)
        if n.op == "placeholder":
            if rec.fqn and rec.kind in (PARAM, BUFFER, CONSTANT):
                for f in owner:
                    if rec.fqn.startswith(f + "."):
                        inst_of[n] = f
            continue
        if n.op != "call_function" or n.meta.get("partitioner_tag") == "is_backward":
            continue
        if rec.kind == NodeKind.BOUNDARY:
            tag = rec.tag
            mod, _, rest = tag.partition(":")
            if mod in owner:
                if rest.startswith("in:") and current is None:
                    current = mod
                if current == mod:
                    inst_of[n] = mod
                    if rest.startswith("out:"):
                        current = None
                    continue
        if current is not None:
            inst_of[n] = current
            if "seq_nr" in n.meta:
                seq_owner.setdefault(n.meta["seq_nr"], current)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    add = torch.ops.aten.add.Tensor
    accumulation: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.meta.get("partitioner_tag") != "is_backward":
            continue
        f = seq_owner.get(n.meta.get("seq_nr"))
        if f is None and (n.target is add or info(n).kind == NodeKind.BOUNDARY):
            # Gradient accumulations carry no layer's seq_nr (AOT tags them with the engine's last
            # one): they join the layer of their most recently computed input, so that every middle
            # layer holds the same accumulations and its signature matches its neighbours'.
            owned = [a for a in n.all_input_nodes if a in inst_of]
            if owned:
                f = inst_of[max(owned, key=order.__getitem__)]
                accumulation.add(n)
        if f is not None:
            inst_of[n] = f
    out: dict[str, list[list[fx.Node]]] = {}
    for g in blocks:
        per = {f: [] for f in g}
        for n in gm.graph.nodes:
            f = inst_of.get(n)
            if f in per:
                per[f].append(n)
        for f in g:  # parameters first, by their name inside the layer
            per[f].sort(
                key=lambda n, f=f: (0, info(n).fqn[len(f) :]) if n.op == "placeholder" else (1, 0)
            )
        out[g[0]] = [
            ([n for n in per[f] if n not in accumulation], [n for n in per[f] if n in accumulation])
            for f in g
        ]
    return out


def signature(nodes: list[fx.Node], prefix: str, memo: dict | None = None) -> list:
    """A layer instance's nodes as comparable tuples: op, target, role, FQN inside the layer, output
    shapes, and arguments (nodes of the instance by position, others by shape).  ``memo`` keeps each
    node's position-free part between calls."""
    pos = {n: i for i, n in enumerate(nodes)}
    memo = {} if memo is None else memo

    def arg(a):
        if isinstance(a, fx.Node):
            if a in pos:
                return ("in", pos[a])
            v = a.meta.get("val")
            return ("out", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("out",)
        if isinstance(a, str):
            if a.startswith(prefix + ":"):
                return a[len(prefix) :]
            if a.startswith(GRAD_TAG):
                return GRAD_TAG
            return a
        if isinstance(a, float):
            return ("float", a.hex())  # exact: signatures are compared as tuples (1 == 1.0 == True)
        if isinstance(a, (bool, int)):
            return (type(a).__name__, a)
        return a if isinstance(a, (type(None), torch.dtype)) else repr(a)

    sig = []  # a tuple of hashable, exactly comparable parts (cheaper to compare than its repr)
    for n in nodes:
        static = memo.get(n)
        if static is None:
            v = n.meta.get("val")
            shape = tuple(
                (tuple(x.shape), x.dtype) for x in flat_args(v) if isinstance(x, torch.Tensor)
            )
            rec = info(n)
            static = memo[n] = (
                n.op,
                str(n.target) if n.op == "call_function" else None,
                rec.kind,
                rec.fqn[len(prefix) :] if rec.fqn else None,
                shape,
            )
        sig.append((static, arg_key((n.args, n.kwargs), arg)))
    return sig


def shared_nodes(gm: fx.GraphModule, blocks: list[list[str]]) -> tuple[dict[fx.Node, fx.Node], int]:
    """({node: the node of an earlier instance whose decision it takes}, layers shared)."""
    share: dict[fx.Node, fx.Node] = {}
    shared_layers = 0
    for prefix, insts in layer_instances(gm, blocks).items():
        # An instance's ops share the decisions of the first instance with the same signature; its
        # gradient accumulations those of the first with the same signature including them (the
        # first and last layers, bordering the embedding and the head, accumulate differently:
        # they keep their own, the middle ones share).
        members = [f for g in blocks if g[0] == prefix for f in g]
        first_core: dict = {}
        first_all: dict = {}
        memo: dict = {}
        for k, (core, acc) in enumerate(insts):
            sig = tuple(signature(core, members[k], memo))
            base = first_core.setdefault(sig, k)
            if base != k:
                share.update(zip(core, insts[base][0]))
                shared_layers += 1
            base = first_all.setdefault(tuple(signature(core + acc, members[k], memo)), k)
            if base != k:
                share.update(zip(acc, insts[base][1]))
    return share, shared_layers
