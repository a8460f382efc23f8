"""Regions: a module's traced body replaced by one op with a sharding rule of its own.

Today one kind: the experts of a mixture of experts whose weights the plan splits by experts
(``rules.experts``: expert parallelism by token dispatch).  The nodes of such a module become one
``fxshard::moe_experts`` node where they form a region of the expected form (three tensor inputs,
hidden states [T, H], expert ids [T, k], weights [T, k], plus the module's parameters, and one
output like the hidden states), and the module passes the contract check on a probe.  Where:

* a forward capture: in its ATen graph, whose nodes record their module (``NodeInfo.module``);
* a training capture of a dynamo graph: in the dynamo graph before AOT traces it (by
  ``nn_module_stack``), so that the joint graph holds the region op and its backward op;
* a training capture of a module (torch.export): ``region_forwards`` makes the experts' forward
  call the region op while it is traced.

Anything else keeps its traced body (logged): the grouped-matmul rules shard it as before.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch
import torch.fx as fx
import torch.nn as nn

from .._torch import no_fake_mode
from ..ir import BOUNDARY, PARAM, NodeInfo, NodeKind, info
from ..rules.experts import MOE_EXPERTS, contract_violation, region, register

log = logging.getLogger("fxshard.regions")


def _inside(rec: NodeInfo, fqn: str) -> bool:
    return rec.module == fqn or rec.module.startswith(fqn + ".")


def _aten_param(node: fx.Node) -> str | None:
    rec = info(node)
    return rec.fqn if node.op == "placeholder" and rec.kind == NodeKind(PARAM) else None


def expert_regions(
    gm: fx.GraphModule,
    experts: dict[str, nn.Module],
    mesh_shape,
    members=None,
    param_of=_aten_param,
    value_key: str = "val",
) -> list[str]:
    """Replace the traced body of every experts module of ``experts`` ({FQN: module}) by one
    ``moe_experts`` node where it has the region's form; returns the FQNs replaced.  By default
    ``gm`` is a captured ATen graph (nodes know their module, parameters their FQN); a dynamo
    graph (training captures: before AOT) passes ``members(fqn)`` (the module's nodes),
    ``param_of(node)`` (a parameter placeholder's FQN) and ``value_key="example_value"``."""
    if not experts:
        return []
    if members is None:

        def members(fqn):
            return [
                n
                for n in gm.graph.nodes
                if n.op == "call_function" and n.target is not BOUNDARY and _inside(info(n), fqn)
            ]

    done = []
    for fqn, module in experts.items():
        nodes = members(fqn)
        if not nodes:
            continue
        why = _replace(gm, fqn, module, nodes, mesh_shape, param_of, value_key)
        if why:
            log.info("fxshard: %s keeps its traced body (%s)", fqn, why)
        else:
            done.append(fqn)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _replace(gm, fqn, module, nodes, mesh_shape, param_of, value_key) -> str | None:
    def val(n):
        return n.meta.get(value_key)

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
        p = param_of(a)
        if p is not None and p.startswith(fqn + "."):
            params[p[len(fqn) + 1 :]] = a
        elif isinstance(val(a), torch.Tensor):
            tensors.append(a)
        else:
            return f"input {a.name} is not a tensor"
    key = register(module, fqn)
    names = region(key).names
    if set(params) != set(names):
        return f"parameters {sorted(params)} in the body, the module has {list(names)}"
    ints = [a for a in tensors if not val(a).is_floating_point()]
    floats = [a for a in tensors if val(a).is_floating_point()]
    if len(tensors) != 3 or len(ints) != 1 or len(floats) != 2:
        return f"inputs {[a.name for a in tensors]}: expected hidden states, expert ids, weights"
    (idx,) = ints
    t, k = (tuple(val(idx).shape) + (None, None))[:2]
    weights = [a for a in floats if tuple(val(a).shape) == (t, k)]
    hidden = [a for a in floats if val(a).ndim == 2 and val(a).shape[0] == t]
    hidden = [a for a in hidden if a not in weights or len(weights) > 1]
    if val(idx).ndim != 2 or len(weights) != 1 or len(hidden) != 1 or hidden[0] is weights[0]:
        return "the inputs' shapes do not tell hidden states [T, H] from weights [T, k]"
    x, w = hidden[0], weights[0]
    ov = val(out)
    if not isinstance(ov, torch.Tensor) or ov.shape != val(x).shape or ov.dtype != val(x).dtype:
        return "its output is not shaped as its hidden states"
    why = contract_violation(key, val(x), val(idx), val(w), mesh_shape)
    if why:
        return why
    with gm.graph.inserting_before(out):
        new = gm.graph.call_function(MOE_EXPERTS, (x, idx, w, [params[nm] for nm in names], key))
    new.meta = {k_: v for k_, v in out.meta.items() if k_ != "fxshard"}
    if value_key == "val":
        rec = info(new)
        rec.module, rec.source, rec.code = fqn, info(out).source, info(out).code
    out.replace_all_uses_with(new)
    for n in reversed(nodes):
        if not n.users:
            gm.graph.erase_node(n)
    return None


@contextlib.contextmanager
def region_forwards(experts: dict[str, nn.Module], mesh_shape):
    """While a module is traced for training (torch.export's joint graph), each experts module of
    ``experts`` calls the region op instead of its body, once its first call passes the contract
    probe (on the parameters' real values, taken before the trace); one that fails runs its own
    forward (logged)."""
    saved = []
    for fqn, module in (experts or {}).items():
        key = register(module, fqn)
        names = region(key).names
        real = [getattr(module, n).detach() for n in names]
        verdict: dict = {}

        signature = inspect.signature(type(module).forward)

        def forward(*args, _m=module, _key=key, _names=names, _real=real, _v=verdict,
                    _sig=signature, **kwargs):  # fmt: skip
            x, idx, w = _sig.bind(_m, *args, **kwargs).args[1:4]
            if "ok" not in _v:
                with no_fake_mode():
                    why = contract_violation(_key, x, idx, w, mesh_shape, params=_real)
                if why:
                    log.info("fxshard: %s keeps its traced body (%s)", region(_key).fqn, why)
                _v["ok"] = why is None
            if not _v["ok"]:
                return type(_m).forward(_m, x, idx, w)
            return MOE_EXPERTS(x, idx, w, [getattr(_m, n) for n in _names], _key)

        forward.fxshard_region = True  # (not "a forward of the instance's own")
        saved.append((module, module.__dict__.get("forward")))
        module.forward = forward
    try:
        yield
    finally:
        for module, before in saved:
            if before is None:
                del module.forward
            else:
                module.forward = before
