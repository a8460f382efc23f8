"""Ranks agree, or fail together.

A sharded program is one program run by every rank: if the ranks run different programs (one
recompiled for another input shape), pass different global inputs, or hold different initial
weights, the collectives still "work" and return wrong values, or deadlock.  So:

* on the first call of every compiled program (and every recompile) the ranks exchange a small
  fingerprint (the per-rank graph, the placements, the input shapes and dtypes) and, on the first
  ``check_calls`` calls, a checksum of every global input; any difference is an error on every
  rank, naming the ranks and what differs, raised before any collective of the program runs;
* parameters and buffers are taken from rank 0 where the ranks' copies differ (DTensor's
  ``src_data_rank=0``; the ranks' tensors are overwritten in place, as DDP does at construction);
  ``src_data_rank=None`` keeps each rank's own copy;
* the exchange runs on a gloo group of its own with a bounded timeout, so a rank that never
  joins (it runs another program, or died) makes the others raise within that time;
* an error on one rank inside fxshard's runtime aborts the process groups, so that the other
  ranks, waiting in a collective, raise within seconds instead of at the process group's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._torch import (
    COLLECTIVE_OPS,
    abort_process_groups,
    limit_group_timeout,
    tensor_version,
)
from ..rules import SHAPE_RANDOM_OPS, VALUE_RANDOM_OPS

log = logging.getLogger("fxshard")

DEFAULT_TIMEOUT_S = 300.0  # the agreement check's wait for every rank (5 minutes)
DEFAULT_CHECK_CALLS = 2  # calls of each program whose inputs the ranks compare


class RanksDisagree(RuntimeError):
    """The ranks run different programs, or call one with different global values.

    ``together``: every rank raised it (a difference they all saw), so no rank waits in a
    collective; False where this rank gave up waiting for the others (they may be stuck)."""

    def __init__(self, message: str, *, together: bool = True):
        super().__init__(message)
        self.together = together


@dataclass(frozen=True)
class AgreementOptions:
    """``check_calls``: how many first calls of each program compare the ranks' inputs (0: off);
    ``src_data_rank``: where parameters come from when the ranks' copies differ (None: each
    rank's own); ``timeout_s``: how long the check waits for every rank;
    ``collective_timeout_s``: the process groups a program's collectives run on get at most this
    timeout (seconds; None: leave them as they are), so that a collective whose peer never
    comes raises instead of waiting out the group's own timeout (30 minutes for gloo)."""

    check_calls: int = DEFAULT_CHECK_CALLS
    src_data_rank: int | None = 0
    timeout_s: float = DEFAULT_TIMEOUT_S
    collective_timeout_s: float | None = DEFAULT_TIMEOUT_S


_GROUPS: dict = {}  # cache: (mesh ranks, timeout) -> the gloo group of the agreement checks


def _real_group() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "fake"


# (id of a DeviceMesh, timeout) -> (that mesh, its group): DeviceMesh.mesh rebuilds its rank
# tensor on every read (about 0.1 ms), and a decode step asks for the group several times
_BY_MESH: dict = {}


def _check_group(device_mesh: DeviceMesh, timeout_s: float):
    hit = _BY_MESH.get((id(device_mesh), timeout_s))
    if hit is not None and hit[0] is device_mesh:
        return hit[1]
    ranks = tuple(sorted(int(r) for r in device_mesh.mesh.flatten().tolist()))
    key = (ranks, float(timeout_s))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(
            ranks=list(ranks),
            backend="gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            use_local_synchronization=True,
        )
    _BY_MESH[(id(device_mesh), timeout_s)] = (device_mesh, _GROUPS[key])  # holds the mesh: no
    return _GROUPS[key]  # id of a live key is reused


_READS = [0]  # sharded values read in eager code on this rank (KeptTensor.full): every rank counts


def prepare_reads(device_mesh: DeviceMesh, timeout_s: float) -> None:
    """Make the group ``read_together`` runs on, now (every rank of the mesh must call this at
    the same point: where a program hands out a sharded value)."""
    if _real_group():
        _check_group(device_mesh, timeout_s)


def read_together(
    local: torch.Tensor, spec, device_mesh: DeviceMesh, timeout_s: float
) -> torch.Tensor | None:
    """The global value of a tensor whose shards the ranks of ``device_mesh`` hold (a KeptTensor
    read in eager code), or None without a real process group.

    Every rank must read it at the same point of the program.  The shards travel on the check
    group (never paired with a program's collectives), stamped with this rank's count of such
    reads and the value's spec: a read one rank makes on its own (a print on rank 0) fails within
    ``timeout_s`` with an error that says so, and reads the ranks make in different orders fail on
    every rank instead of mixing two values."""
    if not _real_group():
        return None
    from .simulate import assemble

    group = _check_group(device_mesh, timeout_s)
    _READS[0] += 1
    stamp = (_READS[0], tuple(spec.shape), str(spec))
    me = dist.get_rank()
    coord = tuple(int(c) for c in device_mesh.get_coordinate())
    got: list = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(got, ("read", me, (stamp, coord, local.detach().cpu())), group=group)
    except Exception as e:
        abort_process_groups()  # the others, waiting in a program's collective, fail too
        raise RanksDisagree(
            f"fxshard: rank {me} waited {timeout_s:.0f} s for the other ranks to read a sharded "
            f"value (its read number {stamp[0]}: a KeptTensor of shape {stamp[1]}, {stamp[2]}) "
            "and they did not come. Reading it gathers its shards, so every rank must read it "
            "at the same point; on one rank alone read `t.local` (this rank's shard) instead, "
            "or call `t.full()` on every rank first. fxshard aborted the process groups so that "
            f"no rank waits. ({type(e).__name__}: {str(e)[:200]})",
            together=False,
        ) from e
    _same_exchange("read", got, "reading a sharded value (a KeptTensor) in eager code")
    got = [(r, *rest) for _, r, rest in got]
    stamps = {r: st for r, st, _, _ in got}
    if len(set(stamps.values())) > 1:
        shown = ", ".join(f"rank {r}: read {st[0]} of {st[1]} {st[2]}" for r, st in stamps.items())
        raise RanksDisagree(
            f"fxshard: the ranks read different sharded values at once ({shown}): every rank "
            "must read a KeptTensor at the same point of the program (a read on one rank alone: "
            "`t.local`)"
        )
    vals = {r: t for r, _, _, t in got}
    coords = {r: c for r, _, c, _ in got}
    return assemble(vals, spec, coords, check_replicas=False).to(local.device)


def _same_exchange(kind: str, got: list, doing: str) -> None:
    """Every rank's message on the check group is one of ``kind``: else ranks that do different
    things met there (one rank reads a sharded value alone while another checks its next
    program): an error on both, saying what each was doing."""
    others = [(r, k) for k, r, _ in got if k != kind]
    if not others:
        return
    what = {"check": "checking its next program", "read": "reading a sharded value (KeptTensor)"}
    shown = ", ".join(f"rank {r} was {what.get(k, k)}" for r, k in others)
    raise RanksDisagree(
        f"fxshard: this rank was {doing}, but {shown}: the ranks left the one program they run "
        "together. Reading a KeptTensor gathers it, so every rank must read it at the same point; "
        "on one rank alone read `t.local` (this rank's shard)."
    )


def limit_timeouts(local: torch.fx.GraphModule, device_type: str, options: AgreementOptions):
    """Bound the timeout of every process group the per-rank graph's collectives use."""
    seconds = options.collective_timeout_s
    if seconds is None:
        return
    names = {
        n.args[-1]
        for n in local.graph.nodes
        if n.op == "call_function" and n.target in COLLECTIVE_OPS and isinstance(n.args[-1], str)
    }
    lowered = [g for g in sorted(names) if limit_group_timeout(g, device_type, seconds)]
    if lowered:
        log.info(
            "fxshard: process groups %s now time out after %.0f s "
            "(AgreementOptions.collective_timeout_s)",
            lowered,
            seconds,
        )


def checksum(t: torch.Tensor) -> str:
    """A digest of a tensor's shape, dtype and values (exact for values, any device)."""
    h = hashlib.sha1(f"{tuple(t.shape)}{t.dtype}".encode())
    h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def fingerprint(local: torch.fx.GraphModule, specs: Sequence) -> str:
    """A digest of a per-rank program: its ops and their arguments in order (values by position,
    not by name: a trace names nodes after what it traced before, which a symbolic trace's shape
    computations make depend on the process's history) and the placements of its inputs and
    outputs."""
    h = hashlib.sha1()
    index = {}
    for k, n in enumerate(local.graph.nodes):
        index[n] = k
        args = torch.fx.node.map_aggregate(
            (n.args, n.kwargs),
            lambda a: (
                f"%{index[a]}"
                if isinstance(a, torch.fx.Node)
                else a.type
                if isinstance(a, torch.device)  # cuda:0 on one rank is cuda:1 on the next
                else a
            ),
        )
        h.update(f"{n.op} {_target_name(n.target)} {args!r}\n".encode())
    h.update(repr([str(s) for s in specs]).encode())
    return h.hexdigest()[:16]


def _target_name(target) -> str:
    """A node's target by name (a Python function's repr carries its address, which differs by
    process)."""
    if isinstance(target, str) or not callable(target) or hasattr(target, "_schema"):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)}"


def uses_random(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph draws random numbers (its ranks' generators must then agree)."""
    ops = SHAPE_RANDOM_OPS | VALUE_RANDOM_OPS
    return any(n.op == "call_function" and n.target in ops for n in gm.graph.nodes)


def _rng_checksum(device: torch.device) -> str:
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(torch.get_device_module(device.type).get_rng_state())
    return "/".join(checksum(s) for s in states)


class Agreement:
    """The ranks' check of one compiled program (one per program and rank).

    ``check(inputs, state)`` runs on each of the first ``check_calls`` calls, before the program:
    one exchange (on the check group, bounded by ``timeout_s``) of the program's fingerprint, a
    checksum of every global input, of the random generator state when the program draws random
    numbers, and (first call only) of every parameter / buffer.  A difference in the first three
    raises ``RanksDisagree`` on every rank; parameters / buffers that differ are made rank
    ``src_data_rank``'s (in place) and named in a warning."""

    def __init__(
        self,
        device_mesh: DeviceMesh,
        program_fingerprint: str,
        options: AgreementOptions | None = None,
        *,
        random: bool = False,
        what: str = "a sharded program",
    ):
        self.device_mesh = device_mesh
        self.fingerprint = program_fingerprint
        self.options = options or AgreementOptions()
        self.random = random
        self.what = what
        self.calls = 0
        self.state_checked = False
        self.device = torch.device(device_mesh.device_type)
        # a fake process group (one process playing a rank of a larger world) has no peers to ask
        self.enabled = bool(self.options.check_calls) and _real_group()
        if self.enabled:
            # made now, while every rank builds the program: a group is made by all its ranks
            _check_group(device_mesh, self.options.timeout_s)

    @property
    def active(self) -> bool:
        return self.enabled and self.calls < self.options.check_calls

    def check(
        self, inputs: Mapping[str, object], state: Mapping[str, torch.Tensor] | None = None
    ) -> list[str]:
        """Compare this call across the ranks (see the class); returns the state names copied."""
        if not self.active:
            return []
        self.calls += 1
        fields = {"program": self.fingerprint}
        for name, v in inputs.items():
            fields[name] = checksum(v) if isinstance(v, torch.Tensor) else repr(v)
        if self.random:
            fields["random generator state"] = _rng_checksum(self.device)
        sums = {}
        if state is not None and not self.state_checked:
            self.state_checked = True
            sums = {f: checksum(t) for f, t in state.items() if not _agreed(t)}
        got = self._exchange((fields, sums))
        _raise_on_difference(self.what, [(r, mine) for r, (mine, _) in got])
        copied = self._take_state(state or {}, [(r, theirs) for r, (_, theirs) in got])
        if len(_AGREED) > 4096:
            for k in [k for k, (ref, _) in _AGREED.items() if ref() is None]:
                del _AGREED[k]
        for f in sums:
            _AGREED[id(state[f])] = (weakref.ref(state[f]), _stamp(state[f]))
        return copied

    def _exchange(self, mine):
        group = _check_group(self.device_mesh, self.options.timeout_s)
        me = dist.get_rank()
        got: list = [None] * dist.get_world_size(group)
        try:
            dist.all_gather_object(got, ("check", me, mine), group=group)
        except Exception as e:
            raise RanksDisagree(
                f"fxshard: rank {me} waited {self.options.timeout_s:.0f} s for every rank of the "
                f"mesh to check {self.what} before running it, and some did not come: they run "
                "another program (a recompile on one rank only: inputs of other shapes?), or "
                f"failed. ({type(e).__name__}: {str(e)[:200]})",
                together=False,
            ) from e
        _same_exchange("check", got, f"checking {self.what} before running it")
        return sorted((r, m) for _, r, m in got)

    def _take_state(self, state: Mapping[str, torch.Tensor], got: list) -> list[str]:
        names = sorted({f for _, sums in got for f in sums})
        if not names:
            return []
        missing = [(r, f) for r, sums in got for f in names if f not in sums]
        if missing:
            raise RanksDisagree(
                f"fxshard: the ranks run {self.what} with different parameters / buffers: rank "
                f"{missing[0][0]} has no {missing[0][1]!r}"
            )
        differ = [f for f in names if len({sums[f] for _, sums in got}) > 1]
        if not differ:
            return []
        src = self.options.src_data_rank
        if src is None:
            log.warning(
                "fxshard: %d parameters / buffers differ across ranks (e.g. %s) and "
                "src_data_rank=None keeps each rank's own: replicated ones then give each rank "
                "another result",
                len(differ),
                differ[:3],
            )
            return []
        group = _check_group(self.device_mesh, self.options.timeout_s)
        src_rank = int(self.device_mesh.mesh.flatten()[src])
        with torch.no_grad():
            for f in differ:
                t = state[f]
                buf = t.detach().to("cpu", copy=True).contiguous()
                dist.broadcast(buf, src=src_rank, group=group)
                t.copy_(buf)
        log.warning(
            "fxshard: %d parameters / buffers differ across ranks (e.g. %s); every rank now holds "
            "rank %d's values (src_data_rank=%d; seed the model alike on every rank, or pass "
            "src_data_rank=None to keep each rank's own)",
            len(differ),
            differ[:3],
            src_rank,
            src,
        )
        return differ


# tensors the ranks found equal, unchanged since: {id: (weakref, (version, data pointer))}
_AGREED: dict[int, tuple] = {}


def _stamp(t: torch.Tensor) -> tuple:
    return (tensor_version(t), t.data_ptr())


def _agreed(t: torch.Tensor) -> bool:
    hit = _AGREED.get(id(t))
    return hit is not None and hit[0]() is t and hit[1] == _stamp(t)


def _raise_on_difference(what: str, got: list) -> None:
    keys = []
    for _, fields in got:
        keys += [k for k in fields if k not in keys]
    diffs = []
    for key in keys:
        values = {r: fields.get(key, "(none)") for r, fields in got}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"rank {r}: {v}" for r, v in list(values.items())[:8])
            diffs.append(f"{key} ({shown})")
    if not diffs:
        return
    hint = (
        "Every rank must run the same program on the same global inputs: pass every rank the "
        "same (global) batch"
    )
    if any(d.startswith("random generator state") for d in diffs):
        hint += ", and seed every rank alike (torch.manual_seed(s) with one s) so that random ops "
        hint += "draw one global tensor"
    if any(d.startswith("program") for d in diffs):
        hint += "; a rank that compiled for other shapes or options runs another program"
    raise RanksDisagree(f"fxshard: the ranks disagree on {what}: {'; '.join(diffs)}. {hint}.")


@contextlib.contextmanager
def fail_together(what: str) -> Iterator[None]:
    """Inside: an error aborts the process groups first (the other ranks then raise within
    seconds instead of waiting in a collective), and says so."""
    try:
        yield
    except BaseException as e:
        if isinstance(e, RanksDisagree) and e.together:
            raise  # every rank raises it: none waits
        if dist.is_available() and dist.is_initialized():
            log.error(
                "fxshard: %s failed on rank %d (%s); aborting the process groups so that the "
                "other ranks fail too",
                what,
                dist.get_rank(),
                type(e).__name__,
            )
            abort_process_groups()
            note = getattr(e, "add_note", None)  # Python 3.11+
            if note is not None:
                note(
                    f"fxshard aborted the process groups after this error in {what}, so that the "
                    f"other ranks do not wait for this one: re-initialise them to go on"
                )
        raise
