"""Sharded values at program boundaries: DTensors, and KeptTensors (state kept sharded).

A DTensor argument's placements and shard order become its placeholder's ``ShardingSpec`` and its
local tensor is handed to the per-rank program as it is (no communication); an output asked for as
a DTensor wraps this rank's local result with the program's spec (no gather).  Even shards of any
placement and shard order line up with DTensor's layout (both cut blocks in mesh-dim order,
outermost first), and uneven ones too: both follow torch.chunk (the last ranks hold less, or
nothing).

**KeptTensor: state that stays sharded between calls.**
A KV cache object (Hugging Face's ``DynamicCache`` / ``StaticCache`` layers, a user's own cache
class) holds tensors in attributes that every call's graph replaces (``self.keys =
torch.cat([self.keys, k])``) or updates in place (``self.keys.index_copy_(...)``).  Handed back
global, every call would end with an all-gather of the whole cache, and the next call would slice
it again.  So the backend hands a tensor that a graph stores into an object's attribute back as a
``KeptTensor`` when the program made it sharded: a tensor of the global shape, dtype and device
whose value is held as this rank's shard (no gather), and the next program that takes it takes the
shard as it is (no collective; like a DTensor argument), updating it in place where its graph does.

To every other reader it is the global tensor: an eager op on it (HF's ``reset()``, beam search's
reordering, a print of its values, ``.tolist()``) first gathers the shards (a collective every rank
runs at the same point of the same eager code, as SPMD code does), and an in-place eager op
writes this rank's shard of the result back.  Its shape, dtype and device are the global ones, so
code that only looks at sizes (``get_seq_length``) gathers nothing.  References to it stay valid
(the object is the tensor), unlike a global tensor left stale.

A tensor allocated eagerly and updated in place by a graph cannot become a KeptTensor (its
identity is the caller's and torch cannot swap a tensor dynamo holds a reference to): it is
written back global.  ``fxshard.kept(t)`` makes one that can: a KeptTensor that starts replicated
(holding ``t`` itself) and that the first program updating it in place leaves in the program's own
placement.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from torch.distributed.device_mesh import DeviceMesh

from .._torch import (
    Partial,
    Replicate,
    WrapperTensor,
    contiguous_strides,
    dtensor_layout,
    dtensor_local,
    fake_mode,
    is_dtensor,
    is_fake,
    is_functional,
    make_dtensor,
    tree_map,
)
from ..core.mesh import MeshSpec
from ..core.spec import ShardingSpec
from .agree import DEFAULT_TIMEOUT_S, prepare_reads, read_together

OUTPUTS = ("global", "dtensor")
STATES = ("sharded", "global")


PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # most arguments, every call


def is_sharded_arg(x: object) -> bool:
    """A value a program takes as its local shard: a DTensor, or a sharded KeptTensor."""
    if type(x) in PLAIN_TENSORS:  # no subclass checks
        return False
    return is_dtensor(x) or (isinstance(x, KeptTensor) and x.sharded)


def spec_of(dt, mesh: MeshSpec, what: str = "a DTensor argument") -> ShardingSpec:
    """The ShardingSpec of a DTensor (or a sharded KeptTensor) on ``mesh`` (the program's
    mesh)."""
    if tuple(dt.device_mesh.shape) != tuple(mesh.shape):
        raise ValueError(
            f"{what} lives on a mesh of shape {tuple(dt.device_mesh.shape)}, the program is "
            f"sharded on {mesh.shape}; redistribute it onto the program's DeviceMesh first"
        )
    if isinstance(dt, KeptTensor):
        return dt.spec
    placements, order = dtensor_layout(dt)
    return ShardingSpec.make(mesh, placements, tuple(dt.shape), dt.dtype, order, what=what)


def layout_of(dt, mesh: MeshSpec, what: str = "a DTensor argument") -> tuple:
    """What of a DTensor's (or sharded KeptTensor's) spec a symbolic program is specific to:
    placements, shard levels, dtype (not its shape); checked to be on ``mesh``. A KeptTensor's
    comes from its layout: no spec is made (a decode step takes a cache tensor per layer and kv,
    every call)."""
    if isinstance(dt, KeptTensor) and dt._layout.mesh is not None:
        lay = dt._layout
        if tuple(lay.mesh.shape) == tuple(mesh.shape):
            return (lay.placements, lay.levels, dt.dtype)
    spec = spec_of(dt, mesh, what)
    return (spec.placements, spec.levels, spec.dtype)


def check_mesh(dt, device_mesh: DeviceMesh | None, what: str) -> None:
    if device_mesh is not None and dt.device_mesh != device_mesh:
        raise ValueError(
            f"{what} is a DTensor on {dt.device_mesh}, the program runs on {device_mesh}: "
            "one program takes DTensors of its own DeviceMesh only (redistribute them onto it, or "
            "pass full_tensor())"
        )


def as_program_arg(x, mesh: MeshSpec, what: str):
    """A call argument as the program takes it: a DTensor (checked to be on the program's mesh),
    which the per-rank program runs on as it is, uneven shards included, or a plain (global)
    tensor."""
    if is_sharded_arg(x):
        layout_of(x, mesh, what)  # (a KeptTensor's from its layout: no spec made)
    return x


def local_arg(dt, spec: ShardingSpec, coord, what: str) -> torch.Tensor:
    """This rank's local tensor of a DTensor (or KeptTensor) argument, checked against the
    program's spec."""
    local = dt.local if isinstance(dt, KeptTensor) else dtensor_local(dt)
    # a symbolic program's spec is for other sizes of the dims it does not split: those are the
    # argument's own (every call of a decode step: no spec is made here)
    shape = dt.shape
    if len(shape) != len(spec.shape) or any(
        lv and n != m for n, m, lv in zip(shape, spec.shape, spec.levels)
    ):
        spec.at_sizes(shape)  # raises: says which sizes differ
    want = tuple(m if lv else n for n, m, lv in zip(shape, _local_shape(spec, coord), spec.levels))
    if tuple(local.shape) != want:
        spec = spec.at_sizes(shape)
        raise ValueError(
            f"{what}: its local shard has shape {tuple(local.shape)}, the program's spec {spec} "
            f"of {spec.shape} has {want} on mesh coordinate {tuple(coord)}"
        )
    return local.contiguous()


@lru_cache(maxsize=4096)
def _local_shape(spec: ShardingSpec, coord: tuple) -> tuple:
    return spec.local_shape(coord)


def wrap_output(local: torch.Tensor, device_mesh: DeviceMesh, spec: ShardingSpec):
    """This rank's shard of an output as a DTensor of the program's spec (at this call's sizes of
    the dims the spec does not split: dynamic shapes)."""
    spec = spec.at_sizes(spec.global_shape(local.shape))
    order = {d: ms for d, ms in spec.shard_order}
    if any(sf != 1 for lv in spec.levels for _, sf in lv):
        # genuinely strided levels: the placements carry them, in mesh-dim order only
        if any(list(ms) != sorted(ms) for ms in order.values()):
            raise NotImplementedError(
                f"an output sharded {spec} (strided shards and another dim's non-default shard "
                "order) has no DTensor spelling; ask for other output_placements"
            )
        order = None
    return make_dtensor(local, device_mesh, spec.placements, order, spec.shape)


def output_wrapper(specs, device_mesh: DeviceMesh, as_dtensor):
    """flat outputs -> the same, output ``k`` wrapped as a DTensor of ``specs[k]`` where
    ``as_dtensor[k]`` (worked out once per program, applied every call)."""
    want = [k < len(as_dtensor) and as_dtensor[k] for k in range(len(specs))]
    if not any(want):
        return lambda flat: flat

    def wrap(flat: list) -> list:
        return [
            wrap_output(v, device_mesh, specs[k])
            if k < len(want) and want[k] and isinstance(v, torch.Tensor)
            else v
            for k, v in enumerate(flat)
        ]

    return wrap


def standin(dt) -> torch.Tensor:
    """A fake tensor of a DTensor's global shape, dtype and device, for capture: no memory (the
    global value of a sharded KV cache may not fit on one rank); capture re-fakes it in its own
    mode."""
    with fake_mode():
        t = torch.empty(tuple(dt.shape), dtype=dt.dtype, device=dt.device)
    return t.requires_grad_(dt.requires_grad)


@dataclass(frozen=True)
class Layout:
    """What a KeptTensor's value is, but its global shape (which changes as a cache grows,
    without making it another kind of tensor for dynamo's guards)."""

    mesh: MeshSpec | None  # None: replicated, no mesh yet (``fxshard.kept``)
    placements: tuple
    levels: tuple
    device_mesh: object = None
    read_timeout_s: float = DEFAULT_TIMEOUT_S  # how long an eager read waits for the other ranks

    @classmethod
    def of(cls, spec: ShardingSpec, device_mesh, timeout_s: float) -> Layout:
        """The layout of a value placed ``spec`` on ``device_mesh``."""
        return cls(spec.mesh, spec.placements, spec.levels, device_mesh, timeout_s)

    @cached_property
    def sharded(self) -> bool:
        """Whether some mesh dim splits or holds partial values (asked of every KeptTensor
        argument, several times a call: worked out once per layout)."""
        return self.mesh is not None and any(not isinstance(p, Replicate) for p in self.placements)

    def spec(self, shape, dtype) -> ShardingSpec:
        if self.mesh is None:
            mesh = MeshSpec((1,))
            return ShardingSpec.make(mesh, (Replicate(),), tuple(shape), dtype)
        return ShardingSpec(self.mesh, self.placements, tuple(shape), dtype, self.levels)


_LOCAL_FILLS = (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar)


class KeptTensor(WrapperTensor):
    """A global tensor whose value this rank holds as its shard (see the module docstring).

    ``local`` is this rank's shard, ``spec`` its placement at the current global shape,
    ``device_mesh`` the mesh it is sharded over."""

    _local: torch.Tensor
    _layout: Layout

    @staticmethod
    def __new__(cls, local: torch.Tensor, layout: Layout, shape, stride=None):
        stride = contiguous_strides(shape) if stride is None else stride
        r = WrapperTensor.wrapper(cls, shape, stride, local.dtype, local.device)
        r._local = local
        r._layout = layout
        r._viewed = False
        r._spec = None  # ``spec``, made on first use (a decode step asks for it several times)
        return r

    @classmethod
    def of(
        cls, local: torch.Tensor, spec: ShardingSpec, device_mesh, timeout_s=DEFAULT_TIMEOUT_S
    ) -> KeptTensor:
        """This rank's shard ``local`` of a value placed ``spec`` on ``device_mesh`` (every rank
        makes it at the same point: a program's call); an eager read waits ``timeout_s`` for the
        other ranks."""
        prepare_reads(device_mesh, timeout_s)
        out = cls(local, Layout.of(spec, device_mesh, timeout_s), spec.shape)
        if spec.dtype == local.dtype:
            out._spec = spec
        return out

    @property
    def local(self) -> torch.Tensor:
        return self._local

    @property
    def spec(self) -> ShardingSpec:
        if self._spec is None:  # (its shape never changes; ``hold`` / ``unshard`` reset it)
            self._spec = self._layout.spec(self.shape, self.dtype)
        return self._spec

    @property
    def device_mesh(self):
        return self._layout.device_mesh

    @property
    def sharded(self) -> bool:
        """Whether some mesh dim splits or holds partial values (else the shard is the value)."""
        return self._layout.sharded

    def hold(self, local: torch.Tensor, spec: ShardingSpec, device_mesh) -> None:
        """Hold a new shard of this tensor's value (a program updated it in place), placed
        ``spec``."""
        if tuple(spec.shape) != tuple(self.shape):
            raise ValueError(f"a shard of {spec.shape} for a tensor of {tuple(self.shape)}")
        timeout_s = self._layout.read_timeout_s
        prepare_reads(device_mesh, timeout_s)
        self._local = local
        self._layout = Layout.of(spec, device_mesh, timeout_s)
        self._spec = spec

    @property
    def viewed(self) -> bool:
        """Whether eager code took a view of it: it then stays whole (replicated) for good, so
        the view keeps seeing (and writing) its value."""
        return self._viewed

    def unshard(self) -> None:
        """Gather the value for good: this rank holds the whole tensor (a collective: every rank
        calls it, as for any eager op on it)."""
        if self.sharded:
            full = self.full().contiguous()
            self._local = full
            self._layout = Layout(None, (), ())
            self._spec = None

    def tolist(self):
        return self.full().tolist()

    def numpy(self, *, force: bool = False):
        return self.full().numpy(force=force)

    def __reduce_ex__(self, protocol):
        # torch.save / pickle: the global tensor (gathered: every rank saves, or calls full())
        return self.full().__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        out = KeptTensor(copy.deepcopy(self._local, memo), self._layout, self.shape, self.stride())
        out._viewed = self._viewed
        memo[id(self)] = out
        return out

    def full(self) -> torch.Tensor:
        """The global value, gathered from the shards (a collective: every rank calls it)."""
        if is_fake(self._local):  # tracing (dynamo's fake tensors): a global stand-in
            return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype,
                                       device=self.device)  # fmt: skip
        if not self.sharded:
            return self._local
        # on a group of its own, checked and bounded: a read one rank makes alone must not pair
        # with the others' next program collectives, nor wait forever
        got = read_together(self._local, self.spec, self.device_mesh, self._layout.read_timeout_s)
        if got is not None:
            return got
        return wrap_output(self._local, self.device_mesh, self.spec).full_tensor()

    def __repr__(self) -> str:  # no gather: a print on one rank must not wait for the others
        return (
            f"KeptTensor(shape={tuple(self.shape)}, dtype={self.dtype}, placements="
            f"{self._layout.placements if self.sharded else '(replicated)'}, local="
            f"{self._local!r})"
        )

    def __tensor_flatten__(self):
        return ["_local"], self._layout

    @staticmethod
    def __tensor_unflatten__(inner, layout, outer_size, outer_stride):
        return KeptTensor(inner["_local"], layout, outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default) and not kwargs:
            (self,) = args
            return KeptTensor(self._local.detach(), self._layout, self.shape, self.stride())
        first = args[0] if args else None
        if isinstance(first, KeptTensor) and torch.Tag.inplace_view in func.tags:
            raise NotImplementedError(
                f"{func} changes a KeptTensor's shape in place (a cache tensor fxshard keeps "
                "sharded between calls); use the out-of-place op (x = x.transpose(0, 1))"
            )
        if isinstance(first, KeptTensor) and func.is_view and not is_fake(first._local):
            # a view of the global tensor: taken of the whole value (gathered for good, once), a
            # KeptTensor over a view of it, so writes through it land in the tensor
            first.unshard()
            first._viewed = True
            v = func(first._local, *args[1:], **kwargs)
            if not isinstance(v, torch.Tensor):  # (views returning several: unbind, split)
                return type(v)(_whole(x) for x in v)
            return _whole(v)
        if func in _LOCAL_FILLS and isinstance(args[0], KeptTensor) and not kwargs:
            # a fill with one number is its own shard's fill (a cache's reset), unless the value is
            # a partial sum (its ranks' shares add up to it)
            self = args[0]
            if not any(isinstance(p, Partial) for p in self._layout.placements):
                func(self._local, *args[1:])
                return self
        kept = []
        full_of = {}

        def unwrap(t):
            if isinstance(t, KeptTensor):
                if id(t) not in full_of:
                    kept.append(t)
                    full_of[id(t)] = t.full()
                return full_of[id(t)]
            return t

        a, k = tree_map(unwrap, (tuple(args), dict(kwargs)))
        out = func(*a, **k)
        # an in-place / out= op wrote into the gathered value: this rank's shard of it goes back
        written = _written_args(func, args, kwargs)
        for t in kept:
            if id(t) in written and is_functional(t._local):
                raise NotImplementedError(
                    f"{func} writes into a KeptTensor (a cache tensor fxshard keeps sharded "
                    "between calls) inside torch.compile with another backend, which cannot "
                    "write it back; compile that code with backend='fxshard', or call .full() "
                    "on the tensor first"
                )
            if id(t) in written and not is_fake(t._local):
                full = full_of[id(t)]
                if t.sharded:
                    coord = t.device_mesh.get_coordinate()
                    t._local.copy_(t.spec.local_of(full, coord))
                elif full is not t._local:
                    t._local.copy_(full)
        if written:  # what the op returns of a written argument is the argument
            back = {id(full_of[id(t)]): t for t in kept if id(t) in written}
            out = tree_map(lambda o: back.get(id(o), o), out)
        return out


def _whole(view: torch.Tensor) -> KeptTensor:
    """A view of a whole KeptTensor's value, as a KeptTensor (whole too)."""
    out = KeptTensor(view, Layout(None, (), ()), view.shape, view.stride())
    out._viewed = True
    return out


def _written_args(func, args, kwargs) -> set:
    """ids of the arguments an op writes into (``a.add_(b)``: ``a``; ``out=`` arguments)."""
    written = set()
    schema = getattr(func, "_schema", None)
    if schema is None:
        return written
    values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
    for arg, v in zip(schema.arguments, values):
        if arg.alias_info is not None and arg.alias_info.is_write and isinstance(v, torch.Tensor):
            written.add(id(v))
    return written


def kept(t: torch.Tensor) -> KeptTensor:
    """``t`` as a KeptTensor: replicated (it holds ``t`` itself), and left in the placement of the
    first fxshard program that updates it in place (a cache allocated eagerly, then updated by
    compiled code, stays sharded between calls from then on)."""
    if isinstance(t, KeptTensor):
        return t
    return KeptTensor(t.detach(), Layout(None, (), ()), t.shape, t.stride())


class _Keep(torch.autograd.Function):
    """A training program's sharded state output as a KeptTensor that keeps its autograd history.
    A gradient eager code sends into it (a loss that reads the returned cache) is the global
    tensor's, of another shape than this rank's shard: it goes to the program's backward through
    ``side`` (output index -> global gradient), which places it as the program takes it."""

    @staticmethod
    def forward(ctx, local, spec, device_mesh, timeout_s, side, k):
        ctx.side, ctx.k = side, k
        return KeptTensor.of(local.detach(), spec, device_mesh, timeout_s)

    @staticmethod
    def backward(ctx, grad):
        ctx.side[ctx.k] = grad.full() if isinstance(grad, KeptTensor) else grad
        return None, None, None, None, None, None


class _Gathered(torch.autograd.Function):
    """A KeptTensor with autograd history (a training call's state) as its global value, its
    gradient handed back as the global tensor's."""

    @staticmethod
    def forward(ctx, kept):
        return kept.full().clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def differentiable_args(args) -> tuple:
    """Call arguments with every KeptTensor that has autograd history (the cache a training call
    returned, handed back in under autograd) replaced by its global value, differentiably: a
    gather per tensor, so that the gradient reaches the call that made it."""
    if not torch.is_grad_enabled() or not any(
        isinstance(a, KeptTensor) and a.requires_grad for a in args
    ):
        return args
    return tuple(
        _Gathered.apply(a) if isinstance(a, KeptTensor) and a.requires_grad else a for a in args
    )


def output_keeper(specs, keep, device_mesh, timeout_s):
    """``keep_outputs(flat, side)``: a program's outputs ``keep`` (indices) as KeptTensors of
    their ``specs`` (the sizes of the dims a spec does not split are the output's own), the rest
    as they are. Worked out once per program: a decode step hands back a cache tensor per layer
    and kv, every call."""
    layouts = {k: Layout.of(specs[k], device_mesh, timeout_s) for k in keep}

    def keep_outputs(flat: list, side: dict | None = None) -> list:
        prepared = False
        for k in keep:
            local = flat[k]
            spec = specs[k]
            shape = spec.global_shape(local.shape)
            if local.requires_grad and torch.is_grad_enabled():
                flat[k] = keep_output(local, spec.at_sizes(shape), device_mesh, timeout_s, side, k)
                continue
            if not prepared:
                prepare_reads(device_mesh, timeout_s)
                prepared = True
            flat[k] = KeptTensor(local, layouts[k], shape)
        return flat

    return keep_outputs


def keep_output(local, spec, device_mesh, timeout_s, side=None, k=None) -> KeptTensor:
    """This rank's shard ``local`` of a program's output ``k`` placed ``spec`` as a KeptTensor;
    where it has autograd history (a training program's), the KeptTensor keeps it, and the
    gradient that reaches it lands in ``side[k]`` (global) for the program's backward."""
    if local.requires_grad and torch.is_grad_enabled():
        if side is None:
            raise ValueError("keep_output: a differentiable output needs a side dict")
        return _Keep.apply(local, spec, device_mesh, timeout_s, side, k)
    return KeptTensor.of(local, spec, device_mesh, timeout_s)


def is_kept(x: object) -> bool:
    return isinstance(x, KeptTensor)
