"""Strategies the rule checker found wrong: never offered, whatever rule proposes them.

A rule's candidate is a tuple of placements per input and per output, one placement per mesh dim.
Most rules are written per mesh dim and expanded over the mesh, so a wrong strategy is usually one
*column*: the placements of every input and output on one mesh dim (``in: S(0),P out: P``).  An
excluded column removes every candidate that has it on any mesh dim, on meshes of any shape; a
candidate found wrong on a mesh of several dims whose columns all pass is excluded whole, for
that mesh rank.

The table starts from ``excluded.json`` (written by ``python scripts/rule_check.py --write``
from torch's OpInfo samples, committed) and grows with ``fxshard.check_rule(op)``.  Excluding is
conservative: a column wrong for one argument pattern is dropped for all (a cost, never a wrong
result).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from torch._ops import OpOverload

from ..core.spec import placement_str

log = logging.getLogger("fxshard")

_FILE = os.path.join(os.path.dirname(__file__), "excluded.json")

# op name -> {key: why}; a key is "col " + one column, or "<ndim>d " + a whole candidate
_TABLE: dict[str, dict[str, str]] = {}
_CHECKED: dict[str, set[str]] = {}  # the keys check_rule added (not from excluded.json)


def _load() -> None:
    if os.path.exists(_FILE):
        with open(_FILE) as f:
            for op, keys in json.load(f).get("excluded", {}).items():
                _TABLE.setdefault(op, {}).update(keys)


def _side(plcs: Sequence, m: int | None) -> str:
    out = []
    for plc in plcs:
        if plc is None:
            out.append("-")
        elif m is None:
            out.append("[" + ",".join(placement_str(p) for p in plc) + "]")
        else:
            out.append(placement_str(plc[m]))
    return ",".join(out)


def column(candidate: tuple, m: int) -> str:
    """Mesh dim ``m`` of a candidate, as text (``in: S(0),R out: S(0)``)."""
    ins, outs = candidate
    return f"in: {_side(ins, m)} out: {_side(outs, m)}"


def whole(candidate: tuple) -> str:
    ins, outs = candidate
    return f"in: {_side(ins, None)} out: {_side(outs, None)}"


def _ndim(candidate: tuple) -> int:
    for side in candidate:
        for plc in side:
            if plc is not None:
                return len(plc)
    return 0


def exclude(op: OpOverload | str, candidate: tuple, why: str, *, columns: bool = True) -> str:
    """Never offer ``candidate`` of ``op`` again: each of its columns if ``columns`` (its mesh is
    one dim), else the whole candidate; returns the key recorded."""
    ndim = _ndim(candidate)
    if columns and ndim == 1:
        key = "col " + column(candidate, 0)
    else:
        key = f"{ndim}d " + whole(candidate)
    if key not in _TABLE.setdefault(str(op), {}):
        _CHECKED.setdefault(str(op), set()).add(key)
    _TABLE[str(op)][key] = why
    return key


def is_excluded(op: OpOverload | str, candidate: tuple) -> str | None:
    """Why ``candidate`` of ``op`` is excluded, or None."""
    keys = _TABLE.get(str(op))
    if not keys:
        return None
    ndim = _ndim(candidate)
    for m in range(ndim):
        why = keys.get("col " + column(candidate, m))
        if why is not None:
            return why
    return keys.get(f"{ndim}d " + whole(candidate))


def drop_excluded(op: OpOverload, cands: list | str | None) -> list | str | None:
    """``cands`` without the excluded ones (None if none is left: the op then runs replicated)."""
    if not isinstance(cands, list) or str(op) not in _TABLE:
        return cands
    kept = [c for c in cands if is_excluded(op, c) is None]
    if len(kept) < len(cands):
        log.debug("fxshard: %d strategies of %s excluded (rule check)", len(cands) - len(kept), op)
    return kept or None


def excluded(op: OpOverload | str | None = None) -> dict:
    """The table (of one op): {op: {key: why}}."""
    if op is None:
        return {k: dict(v) for k, v in _TABLE.items()}
    return {str(op): dict(_TABLE.get(str(op), {}))}


def forget_checked(op: OpOverload | str) -> None:
    """Drop the exclusions ``check_rule`` recorded for ``op`` (its rule was registered anew)."""
    for key in _CHECKED.pop(str(op), ()):
        _TABLE.get(str(op), {}).pop(key, None)


def reset() -> None:
    """An empty table (the rule-check script rebuilds excluded.json from nothing)."""
    _TABLE.clear()
    _CHECKED.clear()


def write(path: str, table: dict, summary: dict, merge: bool = False) -> None:
    """The table and the summary of the run that wrote it, one per torch release (``merge``: the
    other releases' summaries are kept)."""
    summaries = {}
    if merge and os.path.exists(path):
        with open(path) as f:
            summaries = json.load(f).get("summaries", {})
    summaries[summary["torch"]] = summary
    with open(path, "w") as f:
        json.dump({"summaries": summaries, "excluded": table}, f, indent=1, sort_keys=True)
        f.write("\n")


_load()
