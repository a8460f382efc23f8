"""Objects a model returns that pytree does not know (transformers' ``DynamicCache``, a user's
cache or state object): flattened to the tensors they hold for a trace, and rebuilt around a
program's outputs.

A trace (torch.export, AOT) hands back tensors and pytree containers of them.  ``held(out)``
replaces every object in ``out`` that holds tensors in its attributes (at any depth: a cache's
``layers[i].keys``) by a ``HeldObject``, a pytree node of ours whose leaves are those tensors and
whose context is the object with its tensors taken out.  ``released`` rebuilds a new object of
the same class from it (attributes copied, tensors put back): every call returns its own object,
as eager does.  ``held`` also says which flat outputs are such tensors (a program may leave them
sharded: they are state, read only where the user reads them).
"""

from __future__ import annotations

import copy
import types

import torch
import torch.nn as nn

from .._torch import SequenceKey, register_pytree_node, tree_flatten, tree_unflatten


class _Slot:
    """Where tensor ``i`` of an object went."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


_OPAQUE = (type, nn.Module, types.FunctionType, types.MethodType, types.ModuleType)


class _Template:
    """An object with its tensors replaced by slots (shared references kept shared)."""

    def __init__(self, obj):
        self.tensors: list[torch.Tensor] = []
        self.root = self._strip(obj, {})
        self.count = len(self.tensors)

    def taken(self) -> list[torch.Tensor]:
        """The tensors taken out (the template keeps none: specs holding it get deep-copied)."""
        out, self.tensors = self.tensors, []
        return out

    def _strip(self, x, memo: dict):
        if isinstance(x, torch.Tensor):
            self.tensors.append(x)
            return _Slot(len(self.tensors) - 1)
        if id(x) in memo:
            return memo[id(x)]
        if isinstance(x, (list, tuple)):
            items = [self._strip(v, memo) for v in x]
            if all(a is b for a, b in zip(items, x)):
                return x
            return items if type(x) is list else _rebuilt_sequence(x, items)
        if isinstance(x, dict):
            items = {k: self._strip(v, memo) for k, v in x.items()}
            if all(items[k] is v for k, v in x.items()):
                return x
            new = copy.copy(x)
            new.update(items)
            return new
        if isinstance(x, _OPAQUE) or not hasattr(x, "__dict__"):
            return x
        new = copy.copy(x)
        memo[id(x)] = new
        changed = False
        for k, v in vars(x).items():
            s = self._strip(v, memo)
            if s is not v:
                vars(new)[k] = s
                changed = True
        if not changed:
            memo[id(x)] = x
            return x
        return new

    def rebuild(self, tensors) -> object:
        return _fill(self.root, list(tensors), {})

    # a trace may run the forward more than once (AOT): its output specs compare by structure
    def signature(self) -> tuple:
        return _signature(self.root, set())

    def __eq__(self, other) -> bool:
        return isinstance(other, _Template) and self.signature() == other.signature()

    def __hash__(self) -> int:
        return hash(self.signature())

    def __repr__(self) -> str:
        return f"{type(self.root).__name__} holding {self.count} tensors"


def _signature(x, seen: set):
    if isinstance(x, _Slot):
        return x.i
    if id(x) in seen or not _has_slots(x, set()):
        return type(x).__name__
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *(_signature(v, seen) for v in x))
    if isinstance(x, dict):
        return (type(x).__name__, *((k, _signature(v, seen)) for k, v in x.items()))
    return (type(x).__name__, *((k, _signature(v, seen)) for k, v in vars(x).items()))


def _rebuilt_sequence(like, items):
    try:
        return type(like)(items)
    except TypeError:  # a NamedTuple
        return type(like)(*items)


def _fill(x, tensors: list, memo: dict):
    if isinstance(x, _Slot):
        return tensors[x.i]
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, (list, tuple)):
        items = [_fill(v, tensors, memo) for v in x]
        return items if type(x) is list else _rebuilt_sequence(x, items)
    if isinstance(x, dict):
        new = copy.copy(x)
        new.update({k: _fill(v, tensors, memo) for k, v in x.items()})
        return new
    if isinstance(x, _OPAQUE) or not hasattr(x, "__dict__") or not _has_slots(x, set()):
        return x
    new = copy.copy(x)
    memo[id(x)] = new
    for k, v in vars(x).items():
        vars(new)[k] = _fill(v, tensors, memo)
    return new


def _has_slots(x, seen: set) -> bool:
    if isinstance(x, _Slot):
        return True
    if id(x) in seen:
        return False
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        return any(_has_slots(v, seen) for v in x)
    if isinstance(x, dict):
        return any(_has_slots(v, seen) for v in x.values())
    if isinstance(x, _OPAQUE) or not hasattr(x, "__dict__"):
        return False
    return any(_has_slots(v, seen) for v in vars(x).values())


class HeldObject:
    """An object holding tensors, as a pytree node: its tensors are the leaves.  It stays a
    HeldObject through flatten / unflatten (a trace may re-flatten what it unflattened);
    ``released`` turns it into the object."""

    def __init__(self, template: _Template, values: list):
        self.template, self.values = template, list(values)

    def release(self) -> object:
        return self.template.rebuild(self.values)


def _flatten(h: HeldObject):
    return list(h.values), h.template


def _flatten_with_keys(h: HeldObject):
    return [(SequenceKey(i), t) for i, t in enumerate(h.values)], h.template


def _unflatten(values, template: _Template):
    return HeldObject(template, values)


register_pytree_node(
    HeldObject,
    _flatten,
    _unflatten,
    serialized_type_name="fxshard.capture.objects.HeldObject",
    flatten_with_keys_fn=_flatten_with_keys,
)

_PLAIN = (
    torch.Tensor,
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
)


def held(out) -> tuple[object, list[bool]]:
    """``out`` with every object that holds tensors replaced by a ``HeldObject``, and per flat
    output (the leaves of the result, in order): whether it is a tensor such an object holds."""
    leaves, spec = tree_flatten(out)
    new, mask = [], []
    for x in leaves:
        if not isinstance(x, _PLAIN) and not isinstance(x, _OPAQUE):
            template = _Template(x)
            if template.count:
                new.append(HeldObject(template, template.taken()))
                mask += [True] * template.count
                continue
        new.append(x)
        mask.append(False)
    if not any(mask):
        return out, mask
    return tree_unflatten(new, spec), mask


def released(out):
    """``out`` (a program's outputs in the model's structure) with every HeldObject turned back
    into the object it stands for, holding the program's tensors."""
    leaves, spec = tree_flatten(out, is_leaf=lambda x: isinstance(x, HeldObject))
    if not any(isinstance(x, HeldObject) for x in leaves):
        return out
    return tree_unflatten([x.release() if isinstance(x, HeldObject) else x for x in leaves], spec)
