"""Repeated layers: sibling modules that compute alike, found once for every stage that uses them.

``layer_groups`` finds the candidates (children of one container with one class and parameter
shapes): ``plan="auto"`` shares one decision among those whose traced graphs are identical.
``alike_layers`` keeps, of those, the layers of equal state (``state_signature``), which
``reuse_layers`` traces once: layers whose state is equal are assumed to compute the same function
of their tensors.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .._torch import module_tensor_slots

_SKIP_ATTRS = {
    "_parameters",
    "_buffers",
    "_modules",
    "training",
    "_non_persistent_buffers_set",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_is_full_backward_hook",
}
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _value_key(v):
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device)):
        return v
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_value_key(x) for x in v))
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return ("dict", tuple(sorted((k, _value_key(x)) for k, x in v.items())))
    return ("object", id(v))  # anything else: alike only if it is the same object (a shared config)


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """What of a tensor a traced graph depends on: shape, strides, dtype, requires_grad."""
    return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


def state_signature(layer: nn.Module):
    """Equal signatures: the layers compute the same function of their tensors (see module doc).
    Hooks on the layer itself run outside the opaque op and are not part of it; hooks inside it
    must be the very same functions."""
    parts = []
    for name, m in layer.named_modules():
        params, buffers = module_tensor_slots(m)
        attrs = []
        for k, v in vars(m).items():
            if k in _SKIP_ATTRS:
                continue
            if k in _HOOKS:
                # fxshard's boundary markers by what they mark (their tags are rewritten)
                if name and v:
                    attrs.append(
                        (
                            k,
                            tuple(
                                getattr(h, "fxshard_boundary", None) or id(h) for h in v.values()
                            ),
                        )
                    )
                continue
            attrs.append((k, _value_key(v)))
        parts.append(
            (
                name,
                type(m),
                m.training,
                tuple(sorted(attrs, key=lambda a: a[0])),
                tuple((n, tensor_key(p)) for n, p in params.items()),
                tuple((n, tensor_key(b)) for n, b in buffers.items()),
            )
        )
    return tuple(parts)


def _candidates(model: nn.Module):
    """(container fqn, [(child fqn, child)]) for every module whose children may be layers: a
    ModuleList, Sequential or ModuleDict, or any module's digit-named children."""
    for fqn, mod in model.named_modules():
        container = isinstance(mod, (nn.ModuleList, nn.Sequential, nn.ModuleDict))
        kids = [
            (f"{fqn}.{name}" if fqn else name, child)
            for name, child in mod.named_children()
            if container or name.isdigit()
        ]
        if len(kids) > 1:
            yield fqn, kids


def _outermost(groups: list[list[tuple[str, nn.Module]]]) -> list[list[tuple[str, nn.Module]]]:
    """Groups not inside a member of another group; a module held by two containers (a slice)
    once."""
    inner = {f for g in groups for f, _ in g}
    out, seen = [], set()
    for g in groups:
        if any(f.startswith(o + ".") for f, _ in g for o in inner if o != f):
            continue
        g = [(f, m) for f, m in g if id(m) not in seen]
        seen.update(id(m) for _, m in g)
        if len(g) > 1:
            out.append(g)
    return out


def layer_groups(model: nn.Module | None) -> list[list[tuple[str, nn.Module]]]:
    """Groups (>= 2) of sibling layers with one class and parameter names, shapes and dtypes,
    outermost only."""
    if model is None:
        return []
    groups = []
    for _fqn, kids in _candidates(model):
        by_key: dict = {}
        for f, child in kids:
            key = (
                type(child),
                tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters()),
            )
            by_key.setdefault(key, []).append((f, child))
        groups += [g for g in by_key.values() if len(g) > 1]
    return _outermost(groups)


def alike_layers(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Groups (>= 2) of equal-state sibling layers that are called as themselves (not a container,
    no forward of their own), outermost only."""
    groups = []
    for _fqn, kids in _candidates(model):
        by_sig: dict = {}
        for f, child in kids:
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)) or "forward" in vars(child):
                continue  # not callable (its own children may be layers); or a forward of its own
            by_sig.setdefault(state_signature(child), []).append((f, child))
        groups += [g for g in by_sig.values() if len(g) > 1]
    return _outermost(groups)
