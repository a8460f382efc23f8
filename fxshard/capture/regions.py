"""Regions: a module's traced body replaced by one op with a sharding rule of its own.

Today one kind: the experts of a mixture of experts whose weights the plan splits by experts
(``rules.experts``: expert parallelism by token dispatch).  A forward capture's nodes record the
module they came from (``NodeInfo.module``); the nodes of such a module become one
``fxshard::moe_experts`` node where they form a region of the expected form (three tensor inputs,
hidden states [T, H], expert ids [T, k], weights [T, k], plus the module's parameters, and one
output like the hidden states), and the module passes the contract check on a probe.  Anything else
keeps its traced body (logged): the grouped-matmul rules shard it as before.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
import torch.nn as nn

from ..ir import BOUNDARY, PARAM, NodeInfo, NodeKind, info
from ..rules.experts import MOE_EXPERTS, contract_violation, region, register

log = logging.getLogger("fxshard.regions")


def _val(n: fx.Node):
    return n.meta.get("val")


def _inside(rec: NodeInfo, fqn: str) -> bool:
    return rec.module == fqn or rec.module.startswith(fqn + ".")


def expert_regions(gm: fx.GraphModule, experts: dict[str, nn.Module], mesh_shape) -> list[str]:
    """Replace the traced body of every experts module of ``experts`` ({FQN: module}) by one
    ``moe_experts`` node where it has the region's form; returns the FQNs replaced."""
    if not experts:
        return []
    done = []
    for fqn, module in experts.items():
        nodes = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not BOUNDARY and _inside(info(n), fqn)
        ]
        if not nodes:
            continue
        why = _replace(gm, fqn, module, nodes, mesh_shape)
        if why:
            log.info("fxshard: %s keeps its traced body (%s)", fqn, why)
        else:
            done.append(fqn)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _replace(gm, fqn, module, nodes, mesh_shape) -> str | None:
    body = set(nodes)
    inputs: list[fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in body and a not in inputs:
                inputs.append(a)
    outs = [n for n in nodes if any(u not in body for u in n.users)]
    if len(outs) != 1:
        return f"{len(outs)} values leave the module's body, expected 1"
    (out,) = outs
    params, tensors = {}, []
    for a in inputs:
        rec = info(a)
        if a.op == "placeholder" and rec.kind == NodeKind(PARAM) and rec.fqn.startswith(fqn + "."):
            params[rec.fqn[len(fqn) + 1 :]] = a
        elif isinstance(_val(a), torch.Tensor):
            tensors.append(a)
        else:
            return f"input {a.name} is not a tensor"
    key = register(module, fqn)
    names = region(key).names
    if set(params) != set(names):
        return f"parameters {sorted(params)} in the body, the module has {list(names)}"
    ints = [a for a in tensors if not _val(a).is_floating_point()]
    floats = [a for a in tensors if _val(a).is_floating_point()]
    if len(tensors) != 3 or len(ints) != 1 or len(floats) != 2:
        return f"inputs {[a.name for a in tensors]}: expected hidden states, expert ids, weights"
    (idx,) = ints
    t, k = (tuple(_val(idx).shape) + (None, None))[:2]
    weights = [a for a in floats if tuple(_val(a).shape) == (t, k)]
    hidden = [a for a in floats if _val(a).ndim == 2 and _val(a).shape[0] == t]
    hidden = [a for a in hidden if a not in weights or len(weights) > 1]
    if _val(idx).ndim != 2 or len(weights) != 1 or len(hidden) != 1 or hidden[0] is weights[0]:
        return "the inputs' shapes do not tell hidden states [T, H] from weights [T, k]"
    x, w = hidden[0], weights[0]
    ov = _val(out)
    if not isinstance(ov, torch.Tensor) or ov.shape != _val(x).shape or ov.dtype != _val(x).dtype:
        return "its output is not shaped as its hidden states"
    why = contract_violation(key, _val(x), _val(idx), _val(w), mesh_shape)
    if why:
        return why
    with gm.graph.inserting_before(out):
        new = gm.graph.call_function(MOE_EXPERTS, (x, idx, w, [params[nm] for nm in names], key))
    new.meta = {k_: v for k_, v in out.meta.items() if k_ != "fxshard"}
    rec = info(new)
    rec.module, rec.source, rec.code = fqn, info(out).source, info(out).code
    new.meta["val"] = ov
    out.replace_all_uses_with(new)
    for n in reversed(nodes):
        if not n.users:
            gm.graph.erase_node(n)
    return None
