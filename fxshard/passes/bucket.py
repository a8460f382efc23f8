"""bucket: fewer collective launches in the per-rank graph.

Independent collectives of one kind, process group, reduce op and dtype become one collective on a
flat concatenated buffer, split afterwards (DDP-style, capped at ``cap_bytes``).  (One collective
over several mesh dims is the planner's business: ``multi_dim_collectives``.)

A bucket is only formed where it changes no dependency: the merged collective runs after the last
of its inputs is produced and before the first use of any of its outputs, so a collective whose
input depends on another's output never joins that one's bucket; a forward collective never shares
a bucket with a backward one.  A collective's result that goes through layout ops only
(``permute``, ``view``, ``clone``...) before its first real use counts as used there: those ops
move after the merged collective (a training graph's gradient all-gathers, each permuted into
the parameter's layout before the graph returns it, become one).  The merged node carries the
planned collectives of the ones it replaced (``info(node).carries``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .._torch import c10d, is_symbolic
from ..core.config import DEFAULT_BUCKET_BYTES
from ..ir import info

_F = c10d
DEFAULT_CAP_BYTES = DEFAULT_BUCKET_BYTES


def _collective_key(node: fx.Node):
    if node.target is _F.all_reduce.default:
        x, op, group = node.args
        return ("all_reduce", op, group, x.meta["val"].dtype)
    if node.target is _F.all_gather_into_tensor.default:
        x, k, group = node.args
        return ("all_gather", k, group, x.meta["val"].dtype)
    return None


_aten = torch.ops.aten
# one tensor in (the value before it in the chain), its layout or a copy out: free to run later
_LAYOUT = {
    _aten.permute.default,
    _aten.transpose.int,
    _aten.t.default,
    _aten.view.default,
    _aten.reshape.default,
    _aten._unsafe_view.default,
    _aten.clone.default,
    _aten.contiguous.default,
    _aten.alias.default,
    _aten.squeeze.dim,
    _aten.squeeze.dims,
    _aten.unsqueeze.default,
    _aten.narrow.default,
    _aten.slice.Tensor,
    _aten.expand.default,
}


def _layout_chain(wait: fx.Node) -> tuple[list, list]:
    """The layout ops that follow ``wait`` (each with no other tensor input) and the nodes that
    use the chain's values otherwise (its real first uses)."""
    chain, frontier, todo = [], [], [wait]
    while todo:
        x = todo.pop()
        for u in x.users:
            inputs = [a for a in u.all_input_nodes if a is not x]
            if u.op == "call_function" and u.target in _LAYOUT and not inputs:
                chain.append(u)
                todo.append(u)
            else:
                frontier.append(u)
    return chain, frontier


def _wait_of(node: fx.Node):
    users = list(node.users)
    if len(users) == 1 and users[0].target is _F.wait_tensor.default:
        return users[0]
    return None


def _phase(node: fx.Node) -> str:
    carries = info(node).carries
    return carries[0].phase if carries else "forward"


def bucket_collectives(gm: fx.GraphModule, cap_bytes: int = DEFAULT_CAP_BYTES) -> int:
    """Bucket independent all-reduces / all-gathers; returns how many collectives were removed."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    items = []
    for n in gm.graph.nodes:
        key = _collective_key(n)
        if key is not None:
            # joint graphs: a forward collective never shares a bucket with a backward one (the
            # partitioner must be able to split them, and a forward value must not wait on a
            # gradient)
            key = (*key, _phase(n))
        wait = _wait_of(n) if key else None
        if key is None or wait is None or not isinstance(n.args[0], fx.Node):
            continue
        x = n.args[0]
        if any(is_symbolic(d) for d in x.meta["val"].shape):
            continue  # dynamic shapes: its size is not known until it runs
        chain, frontier = _layout_chain(wait)
        first_use = min((order[u] for u in frontier), default=math.inf)
        items.append(
            (
                key,
                n,
                wait,
                order[x],
                first_use,
                x.meta["val"].numel() * x.meta["val"].element_size(),
                chain,
            )
        )
    buckets: list[list] = []
    open_by_key: dict = {}
    for it in items:
        key, n, _w, produced, first_use, nbytes, _chain = it
        b = open_by_key.get(key)
        # an input that is a layout op of an earlier result depends on that result: the layout
        # chain must not hide it
        if b is not None and any(n.args[0] in m[6] for m in b):
            b = None
        if b is not None:
            ready = max(produced, max(m[3] for m in b))
            needed = min(first_use, min(m[4] for m in b))
            if ready < needed and sum(m[5] for m in b) + nbytes <= cap_bytes:
                b.append(it)
                continue
        b = [it]
        buckets.append(b)
        open_by_key[key] = b
    removed = 0
    for b in buckets:
        if len(b) > 1:
            _rewrite(gm, b, order)
            removed += len(b) - 1
    if removed:
        gm.graph.lint()
        gm.recompile()
    return removed


def _rewrite(gm, bucket, order):
    key = bucket[0][0]
    inputs = [it[1].args[0] for it in bucket]
    g = gm.graph
    cursor = max(inputs, key=lambda x: order[x])

    def emit(target, args, like=None):
        """A node after the last one emitted, with its fake value (AOTAutograd's partitioner
        reads every node's ``val``: Cohere's parallel attention and MLP all-reduces, bucketed
        in the forward, failed its min-cut); a collective's is ``like``'s shape, else the op
        run on its inputs' values."""
        nonlocal cursor
        with g.inserting_after(cursor):
            cursor = g.call_function(target, args)
        try:
            vals = fx.node.map_arg(args, lambda a: a.meta["val"])
            cursor.meta["val"] = like(vals) if like is not None else target(*vals)
        except Exception:  # a value we cannot make: the node goes without (as it did before)
            cursor.meta.pop("val", None)
        return cursor

    flats = [emit(torch.ops.aten.reshape.default, (x, [-1])) for x in inputs]
    cat = emit(torch.ops.aten.cat.default, (flats, 0))
    if key[0] == "all_reduce":
        coll = emit(_F.all_reduce.default, (cat, key[1], key[2]), lambda v: v[0].clone())
    else:
        coll = emit(
            _F.all_gather_into_tensor.default,
            (cat, key[1], key[2]),
            lambda v: v[0].new_empty((v[1] * v[0].shape[0],)),
        )
    info(coll).carries = tuple(c for it in bucket for c in info(it[1]).carries)
    wait = emit(_F.wait_tensor.default, (coll,), lambda v: v[0].clone())
    sizes = [x.meta["val"].numel() for x in inputs]
    total = sum(sizes)
    grid = (
        emit(torch.ops.aten.reshape.default, (wait, [key[1], total]))
        if key[0] == "all_gather"
        else None
    )
    for i, (it, x) in enumerate(zip(bucket, inputs)):
        val = x.meta["val"]
        if key[0] == "all_reduce":
            part = emit(torch.ops.aten.narrow.default, (wait, 0, sum(sizes[:i]), sizes[i]))
            out = emit(torch.ops.aten.reshape.default, (part, list(val.shape)))
        else:
            part = emit(torch.ops.aten.narrow.default, (grid, 1, sum(sizes[:i]), sizes[i]))
            out = emit(
                torch.ops.aten.reshape.default, (part, [key[1] * val.shape[0], *val.shape[1:]])
            )
        it[2].replace_all_uses_with(out)
    # the layout ops after each result run after the merged collective, in their order (their
    # other uses come after the last input, the bucket's condition)
    for m in sorted((m for it in bucket for m in it[6]), key=lambda m: order[m]):
        cursor.append(m)
        cursor = m
    for it in bucket:
        g.erase_node(it[2])
        g.erase_node(it[1])
