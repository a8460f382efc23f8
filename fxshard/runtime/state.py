"""State that stays sharded between compiled calls (``options={"state": "sharded"}``).

A KV cache object (Hugging Face's ``StaticCache`` layers, a user's own cache class) holds tensors
as attributes that every call's graph updates in place.  Handed back global, each call ends with an
all-gather of the whole cache.  Kept sharded, each rank keeps only its shard between calls, in the
placement the program wrote it in, and the next call's program takes that shard as its input
(no collective): one generated token moves only what the plan needs.

The global tensor stays in its object (dynamo reads it: same shape, dtype and guards), but its
contents are stale while the shards hold the value.  So nothing may read it eagerly: the object's
class is swapped for a subclass (same name, same behaviour) whose attribute is a property that, in
eager code, first gathers the shards back into the global tensor and drops them (``reset()``,
beam-search reordering, a user's print read correct values); inside a compiled region
(``torch.compiler.is_compiling()``) it hands the tensor to the trace unchanged.  The swap costs
one more trace of each graph that saw the object (dynamo guards on its type), once per class: a
property installed on the class in place keeps its identity but leaves the graphs traced before
it reading the attribute from their compiled frames, where dynamo compiles the property's getter
on its own and a kept tensor comes back as a gathered copy.  A tensor is kept
sharded only where nothing else the garbage collector sees refers to it, and one written to behind
its object's back (its version counter moved) is an error on the next call.  The ranks run eager
code in step (SPMD), so a gather in a getter is a collective every rank issues at the same point.

What it cannot see: a reference to the tensor held in a running function's local variable (taken
out of the object before the call that made it stale).  Take such tensors from their object after
the call (the getter gathers them), not before; references held in lists, dicts or other objects
are seen, and keep the tensor global (logged).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._torch import tensor_version
from ..core.spec import ShardingSpec
from .boundary import wrap_output

log = logging.getLogger("fxshard")

STATES = ("global", "sharded")


@dataclass
class Kept:
    """One global tensor's value, held as this rank's shard."""

    local: torch.Tensor
    spec: ShardingSpec
    device_mesh: object
    version: int  # the global tensor's version counter when it went stale
    what: str  # its dynamo source, for messages


# global tensor (weakly) -> Kept
_KEPT = WeakIdKeyDictionary()
# (class, attribute names) -> the subclass whose attributes gather on eager access
_HOOKED: dict = {}


def kept(t: torch.Tensor) -> Kept | None:
    """The shard a global tensor's value is held in, or None (the tensor is its own value)."""
    k = _KEPT.get(t)
    if k is not None and tensor_version(t) != k.version:
        raise RuntimeError(
            f"fxshard: {k.what} is kept sharded between compiled calls (state='sharded'), but "
            "its global tensor was written to directly (through a reference taken out of its "
            "object before it went sharded): its contents are not the value. Take it from its "
            "object (obj.attr gathers it first), or compile with state='global'"
        )
    return k


def any_kept() -> bool:
    """Whether any tensor's value is held sharded now (a cheap check before looking one up)."""
    return len(_KEPT) > 0


def gather(t: torch.Tensor) -> None:
    """Make a kept tensor its own value again: its shards gathered into it (a collective on every
    rank), the shard dropped."""
    k = kept(t)
    if k is None:
        return
    del _KEPT[t]
    with torch.no_grad():
        full = wrap_output(k.local, k.device_mesh, k.spec).full_tensor()
        t.copy_(full)


def keep(
    t: torch.Tensor,
    local: torch.Tensor,
    spec: ShardingSpec,
    device_mesh,
    what: str,
    name: str,
    call_args: tuple,
) -> bool:
    """Hold ``t``'s new value as ``local`` (this rank's shard of ``spec``) instead of writing it
    into ``t``; False (nothing kept: write it back) where ``t`` is not an attribute of objects
    whose class can take the hook, or something else refers to it (``call_args``: the arguments
    of the call, which do)."""
    owners = _owners(t, name)
    if not owners:
        log.debug("fxshard: %s stays global (not an attribute of a plain object)", what)
        return False
    # every reference the garbage collector sees must be an owner's dict or one of the call's
    # argument tuples (this call's, the one dynamo unpacked): one held anywhere else (a list, a
    # dict, another object) could read the tensor stale.  (References from running functions'
    # local variables are not visible this way: see the module docstring.)
    allowed = {id(o.__dict__) for o in owners} | {id(o) for o in owners}
    other = [
        type(r).__name__
        for r in gc.get_referrers(t)
        if id(r) not in allowed and not (type(r) is tuple and _same_items(r, call_args))
    ]
    if other:
        log.info(
            "fxshard: %s stays global this call: it is also referred to by %s, which could read "
            "it stale",
            what,
            ", ".join(other),
        )
        return False
    for obj in owners:
        _hook(obj, name)
    _KEPT[t] = Kept(local, spec, device_mesh, tensor_version(t), what)
    return True


def _same_items(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _owners(t: torch.Tensor, name: str) -> list:
    """The objects whose instance ``__dict__[name]`` is ``t`` (plain Python objects only: not
    modules, whose tensors are parameters and buffers, nor classes)."""
    found = []
    for r in gc.get_referrers(t):
        if type(r) is dict:  # an instance dict: its object refers to it
            if r.get(name) is t:
                found += [o for o in gc.get_referrers(r) if getattr(o, "__dict__", None) is r]
        else:  # an object whose attributes live inline (no dict made yet)
            found.append(r)
    out = []
    for obj in found:
        d = getattr(obj, "__dict__", None)
        if (
            isinstance(d, dict)
            and d.get(name) is t
            and not isinstance(obj, (type, torch.nn.Module, torch.Tensor))
            and _hookable(type(obj), name)
            and all(obj is not o for o in out)
        ):
            out.append(obj)
    return out


def _hookable(cls: type, name: str) -> bool:
    """Whether a subclass of ``cls`` can take the gathering property for ``name``: attribute
    access is plain (no custom ``__getattribute__`` / ``__setattr__``) and no class in its MRO
    defines ``name`` as a data descriptor other than ours (reads would not be the instance
    dict's)."""
    if cls.__getattribute__ is not object.__getattribute__:
        return False
    if cls.__setattr__ is not object.__setattr__:
        return False
    for c in cls.__mro__:
        if name in c.__dict__:
            v = c.__dict__[name]
            return name in getattr(c, "_fxshard_kept", ()) or not hasattr(type(v), "__set__")
    return True


def _hook(obj, name: str) -> None:
    cls = type(obj)
    names = frozenset(getattr(cls, "_fxshard_kept", ())) | {name}
    if names == frozenset(getattr(cls, "_fxshard_kept", ())):
        return
    base = getattr(cls, "_fxshard_base", cls)
    sub = _HOOKED.get((base, names))
    if sub is None:
        ns = {n: _gathering(n) for n in names}
        ns.update(_fxshard_kept=names, _fxshard_base=base, __module__=base.__module__)
        ns["__qualname__"] = base.__qualname__
        sub = _HOOKED[(base, names)] = type(base.__name__, (base,), ns)
    obj.__class__ = sub


def _gathering(name: str) -> property:
    """A property for attribute ``name`` that hands compiled code the tensor as it is and gathers
    it first for eager code."""

    def get(self):
        t = self.__dict__[name]
        if not torch.compiler.is_compiling() and isinstance(t, torch.Tensor):
            gather(t)
        return t

    def put(self, value):
        self.__dict__[name] = value

    return property(get, put, doc=f"{name} (fxshard: gathered on eager access)")


__all__ = ["STATES", "Kept", "any_kept", "kept", "keep", "gather"]
