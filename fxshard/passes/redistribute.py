"""redistribute: make every placement change an explicit node carrying its plan.

Wherever a consumer needs its input in other placements than the producer gives, one
``redistribute`` node is inserted between them (shared by every consumer that wants the same
placements), holding the ``RedistributePlan`` from the min-cost planner.  On global values a
redistribute is the identity, so the annotated graph still runs on one device.
"""

from __future__ import annotations

import torch.fx as fx

from ..core.cost import CostModel
from ..ir import NodeKind, flat_outputs, info, redistribute, tensor_args, where
from ..planner import plan_in_program


def _same(a, b) -> bool:
    return a.placements == b.placements and a.levels == b.levels


def insert_redistributes(
    gm: fx.GraphModule, cost_model: CostModel | None = None, fuse: bool = False
) -> int:
    """Insert redistribute nodes; returns how many were inserted."""
    count = 0
    cache: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        rec = info(node)
        if node.op == "placeholder" or rec.kind == NodeKind.REDISTRIBUTE:
            continue
        if node.op == "output":
            # aligned with input_specs (None for outputs that are not values)
            args = flat_outputs(node)
        else:
            args = tensor_args(node)
        for arg, want in zip(args, rec.input_specs):
            if want is None or not isinstance(arg, fx.Node):
                continue
            have = info(arg).spec
            if _same(have, want):
                continue
            key = (arg, want.placements, want.levels)
            if key not in cache:
                src, src_spec = arg, have
                hub = info(arg).hub  # plan="auto": the one placement this value is moved to
                if (
                    hub is not None
                    and not _same(hub, want)
                    and not _same(hub, have)
                    and plan_in_program(hub, want, cost_model, fuse=fuse).cost
                    < plan_in_program(have, want, cost_model, fuse=fuse).cost
                ):
                    hkey = (arg, hub.placements, hub.levels)
                    if hkey not in cache:
                        cache[hkey] = _insert(gm, node, arg, have, hub, cost_model, fuse)
                        count += 1
                    src, src_spec = cache[hkey], hub
                cache[key] = _insert(gm, node, src, src_spec, want, cost_model, fuse)
                count += 1
            if node.op == "output":
                _replace_output(node, arg, cache[key])
            else:
                node.replace_input_with(arg, cache[key])
    gm.graph.lint()
    gm.recompile()
    return count


def _insert(gm, node, arg, have, want, cost_model, fuse) -> fx.Node:
    with gm.graph.inserting_before(node):
        r = gm.graph.call_function(redistribute, (arg,))
    r.meta["val"] = arg.meta.get("val")
    rr = info(r)
    rr.kind = NodeKind.REDISTRIBUTE
    try:
        rr.plan = plan_in_program(have, want, cost_model, fuse=fuse)
    except ValueError as e:
        what = str(e)
        consumer = "the program's output" if node.op == "output" else f"node {node.name}"
        raise ValueError(
            f"fxshard: {arg.name} cannot be moved from {have} to {want} for {consumer}"
            f"{where(info(node))}: {what}"
        ) from e
    rr.spec = want
    rr.input_specs = (have,)
    rr.module = info(node).module
    rr.source, rr.code = info(node).source, info(node).code
    why = info(node).provenance
    rr.provenance = f"planner: {node.name} needs {want}" + (
        f" ({why})" if why and why != "rule" else ""
    )
    return r


def _replace_output(out_node, old, new):
    def sub(x):
        return new if x is old else x

    outs = out_node.args[0]
    if isinstance(outs, (tuple, list)):
        out_node.args = (type(outs)(sub(o) for o in outs),)
    else:
        out_node.args = (sub(outs),)
