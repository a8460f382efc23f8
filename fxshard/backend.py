"""The ``torch.compile`` backend.

    torch.compile(model, backend="fxshard", options={"mesh": device_mesh, "plan": plan})

Each dynamo graph is sharded on its own: its parameters (found by their dynamo sources) take the
plan's placements, its user inputs are the global values every rank holds (each rank slices its
shard locally, no communication), and its outputs are handed back replicated, i.e. as the global
values, so whatever runs between graphs (a graph break) sees exactly what the single-device program
would.

DTensors cross the boundary without communication (``fxshard.runtime.boundary``): a DTensor
argument's placements and shard order are its input's placements and its local tensor is the
program's input shard; with ``outputs="dtensor"`` every output comes back as a DTensor of the
placement the program produced (pending reductions finished), and ``output_placements`` (one entry
per output, None: the program's own) asks for given placements, also as DTensors.  So a value
that crosses a graph break stays sharded, and a KV cache handed back and in stays heads-sharded.
Under autograd a DTensor input's gradient is a DTensor placed like it; DTensor outputs of a
training graph are replicated unless ``output_placements`` says otherwise.  Dynamo runs DTensor's
own rules on DTensor arguments while it traces a frame (to learn each value's metadata); while it
traces for this backend, plain tensors count as replicated (as under torch's
``implicit_replication()``: a plain parameter is the global value) and an op DTensor's rule
refuses on its inputs' placements, or has no rule for, runs on the global values
(``fxshard._torch.on_dynamo_compiles``); fxshard then plans the graph itself.  Uneven DTensor
arguments run as they are (DTensor's torch.chunk layout is fxshard's).

Graphs are captured and compiled once per input signature (shapes, dtypes, int arguments) at their
first call, with the call's concrete shapes: recompiles on new shapes work.  Where dynamo made dims
dynamic (a graph called with a second size of them: a KV cache that grows by a token per call),
one symbolic program serves every size of those dims (``fxshard.capture.symbolic``: traced with
SymInt sizes, placed on the first call's sizes with those dims never split, lowered and compiled
for any size), its shape guards checked on every call; where it cannot be built (a plan that
splits a dynamic dim, a training graph) each size gets its own program, logged.  Parameters are
sliced to local shards once and cached; a replaced parameter (new object, or new storage through
``p.data =``) or one updated in place (its version counter moves: optimizers, ``p.mul_()`` under
no_grad) is sliced again.  In-place updates through ``p.data`` bypass the version counter and are
not seen: shards that are views (dim-0 shards, replicated parameters) see them, copies do not;
update parameters in place instead, or call ``torch._dynamo.reset()``.

Options (``options={...}``): ``mesh`` (a ``DeviceMesh``; a ``MeshSpec`` or shape with
``simulate=True``), ``plan`` (ParallelStyle / tp_plan dict, ``{}`` for none, or ``"auto"``),
``auto_options``, ``tp_dim``, ``multi_dim_collectives`` (``fuse``: its old name),
``bucket_bytes``, ``cost_model``, ``inductor`` (False: run the per-rank graph eagerly, for
debugging), ``simulate`` (True: run every rank in this process with exact collectives; outputs
are the global values; no process group needed), ``agreement`` (``fxshard.AgreementOptions``:
how the ranks check, on each graph's first calls, that they run one program on the same inputs
and parameters; see ``fxshard.runtime.agree``), ``search`` (``"global"``, the default: the
placements the plan leaves free are chosen by one solve over the graph; ``"greedy"``: op by op),
``outputs`` (``"global"``, the default, or ``"dtensor"``), ``output_placements``, ``state``
(``"sharded"``, the default: tensors a graph stores into attributes of plain objects, a KV
cache's keys and values, whether the object existed before the call or the call creates it (the
default call's ``DynamicCache``), come back as ``KeptTensor``s where the program left them
sharded (a training call's keep their autograd history): this
rank's shard to the next program, the global tensor to eager code, which gathers it on use; and
KeptTensors a graph updates in place stay sharded; ``"global"``: gathered.
``fxshard.runtime.boundary``).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from . import api
from ._torch import (
    Replicate,
    attribute_outputs,
    calling_modules,
    dynamo_frame_locals,
    is_dtensor,
    on_dynamo_compiles,
    placeholder_source,
    shape_guards,
    tensor_version,
)
from .capture import dynamo_sources, source_fqn
from .capture.common import normalize_source, source_root
from .capture.dynamo import size_carrier
from .capture.symbolic import DynamicDims, NotSymbolic, splits_dynamic
from .core.config import DEFAULT_BUCKET_BYTES, DEFAULT_SEARCH, ShardConfig
from .core.mesh import MeshSpec
from .core.spec import ShardingSpec
from .ir import AS_EAGER, INPUT, OWN_PLACEMENT, STATE_KINDS, TANGENT, NodeKind, flat_outputs, info
from .placement.constraints import PlanConstraints, resolve_plan
from .runtime.agree import AgreementOptions, fail_together
from .runtime.boundary import (
    OUTPUTS,
    PLAIN_TENSORS,
    STATES,
    as_program_arg,
    check_mesh,
    differentiable_args,
    is_kept,
    is_sharded_arg,
    layout_of,
    local_arg,
    output_keeper,
    output_wrapper,
    spec_of,
    standin,
)
from .runtime.compiled import CompiledProgram, CompiledTraining, SimulatedTraining

log = logging.getLogger("fxshard")

OPTIONS = (
    "mesh",
    "plan",
    "tp_dim",
    "multi_dim_collectives",
    "fuse",
    "bucket_bytes",
    "cost_model",
    "inductor",
    "simulate",
    "auto_options",
    "agreement",
    "search",
    "outputs",
    "output_placements",
    "state",
)


@dataclass
class BackendOptions:
    """The backend's ``options={...}``, checked."""

    mesh: object  # DeviceMesh, or MeshSpec when simulating
    plan: dict
    tp_dim: int | str | None = None
    multi_dim_collectives: bool = True
    fuse: bool | None = None  # deprecated name of multi_dim_collectives
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    cost_model: object = None
    inductor: bool = True
    simulate: bool = False
    auto_options: object = None  # fxshard.AutoOptions, with plan="auto" (or a "*": "auto" entry)
    agreement: AgreementOptions | None = None  # how the ranks check they run one program
    search: str = DEFAULT_SEARCH  # how the placements the plan leaves free are chosen (or "greedy")
    outputs: str = "global"  # "dtensor": outputs come back as DTensors, not gathered
    output_placements: Sequence | None = None  # per output: these placements, as a DTensor
    state: str = "sharded"  # tensors a graph stores into objects' attributes (KV caches) stay
    # sharded between calls, as KeptTensors ("global": gathered)

    @classmethod
    def parse(cls, options: dict | None) -> BackendOptions:
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"fxshard backend: unknown option(s) {unknown}; known: {list(OPTIONS)}"
            )
        if "mesh" not in options or "plan" not in options:
            missing = [k for k in ("mesh", "plan") if k not in options]
            raise ValueError(
                f"fxshard backend: missing option(s) {missing}. Use torch.compile(model, "
                'backend="fxshard", '
                f'options={{"mesh": device_mesh, "plan": plan}}) with a DeviceMesh '
                "(init_device_mesh) and a "
                "plan mapping module FQNs to ParallelStyles, e.g. "
                f'{{"fc1": ColwiseParallel(), "fc2": '
                f'RowwiseParallel()}} ({{}} for none); add "simulate": True with a MeshSpec to run '
                "every rank "
                f"in one process"
            )
        opts = cls(**options)
        opts._check_types()
        if not isinstance(opts.plan, dict) and opts.plan != "auto":
            raise TypeError(
                'fxshard backend: plan must be a dict of module FQN -> ParallelStyle or "auto", '
                "got "
                f"{opts.plan!r}"
            )
        if isinstance(opts.mesh, (tuple, list)):
            opts.mesh = MeshSpec(tuple(opts.mesh))
        if isinstance(opts.mesh, MeshSpec) and not opts.simulate:
            raise ValueError(
                "fxshard backend: running needs a DeviceMesh (init_process_group + "
                "init_device_mesh); "
                'a MeshSpec only works with "simulate": True'
            )
        if opts.fuse is not None:
            opts.multi_dim_collectives = api._multi_dim(opts.multi_dim_collectives, opts.fuse)
        if opts.outputs not in OUTPUTS:
            raise ValueError(
                f"fxshard backend: outputs must be one of {list(OUTPUTS)}, got {opts.outputs!r}"
            )
        if opts.output_placements is not None:
            opts.output_placements = _output_placements_option(
                opts.output_placements, opts.mesh_spec.ndim
            )
        if (opts.outputs == "dtensor" or opts.output_placements is not None) and opts.simulate:
            raise ValueError(
                "fxshard backend: DTensor outputs (outputs='dtensor', output_placements) need a "
                "DeviceMesh and a process group; simulate=True hands back global values"
            )
        if opts.state not in STATES:
            raise ValueError(
                f"fxshard backend: state must be one of {list(STATES)}, got {opts.state!r}"
            )
        if opts.agreement is not None and not isinstance(opts.agreement, AgreementOptions):
            raise TypeError(
                "fxshard backend: agreement must be fxshard.AgreementOptions(check_calls=..., "
                f"src_data_rank=..., timeout_s=...), got {type(opts.agreement).__name__}"
            )
        return opts

    @property
    def mesh_spec(self) -> MeshSpec:
        """The mesh as a MeshSpec (made once per mesh object: a DeviceMesh's rank tensor is
        rebuilt on every read, and each call asks for it several times)."""
        hit = self.__dict__.get("_mesh_spec")
        if hit is None or hit[0] is not self.mesh:
            hit = self.__dict__["_mesh_spec"] = (self.mesh, MeshSpec.from_device_mesh(self.mesh))
        return hit[1]

    def _check_types(self) -> None:
        """Every option's type and range, said when the options are read (not at the first call,
        nor never)."""

        def bad(name, want, example=None):
            value = getattr(self, name)
            eg = f", e.g. {example}" if example else ""
            return TypeError(
                f"fxshard backend: option {name!r} takes {want}{eg}; got {value!r} "
                f"({type(value).__name__})"
            )

        mesh = self.mesh
        if not (
            hasattr(mesh, "get_group")
            or isinstance(mesh, MeshSpec)
            or (
                isinstance(mesh, (tuple, list))
                and mesh
                and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in mesh)
            )
        ):
            raise bad(
                "mesh",
                "a DeviceMesh (a MeshSpec or a shape tuple with simulate=True)",
                'init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))',
            )
        for name in ("multi_dim_collectives", "inductor", "simulate"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        if self.fuse is not None and not isinstance(self.fuse, bool):
            raise bad("fuse", "True or False")
        b = self.bucket_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b < 0:
            raise bad("bucket_bytes", "a number of bytes >= 0 (0: no bucketing)", "25 * 2**20")
        if self.tp_dim is not None and (
            isinstance(self.tp_dim, bool) or not isinstance(self.tp_dim, (int, str))
        ):
            raise bad("tp_dim", "a mesh dim's index or name", '"tp"')
        if not isinstance(self.search, str) or self.search not in ("global", "greedy"):
            raise bad("search", '"global" or "greedy"')
        if self.auto_options is not None:
            self.auto_options = api._auto_options(self.auto_options)  # a dict of its fields too
            if self.plan != "auto" and not (isinstance(self.plan, dict) and "*" in self.plan):
                raise ValueError(
                    "fxshard backend: auto_options applies to plan='auto' (or a plan with a "
                    "'*': 'auto' entry)"
                )


def _output_placements_option(given, ndim: int) -> list:
    """``output_placements``: a list with, per output, a placements tuple (one per mesh dim), a
    ``ShardingSpec`` or None (the program's own placement)."""
    from torch.distributed.tensor.placement_types import Placement

    example = f"[({', '.join(['Shard(0)'] * ndim)},)]" if ndim > 1 else "[(Shard(0),)]"
    if isinstance(given, (Placement, str)) or not isinstance(given, (list, tuple)):
        raise TypeError(
            f"fxshard backend: output_placements takes a list with one placements tuple per "
            f"output (one placement per mesh dim), e.g. {example}; got {given!r}"
        )
    out = []
    for k, p in enumerate(given):
        if p is None or isinstance(p, ShardingSpec):
            out.append(p)
            continue
        if isinstance(p, Placement) or not isinstance(p, (list, tuple)):
            raise TypeError(
                f"fxshard backend: output_placements[{k}] = {p!r}: each output takes a tuple of "
                f"placements, one per mesh dim, e.g. {example}"
            )
        if len(p) != ndim or not all(isinstance(q, Placement) for q in p):
            raise ValueError(
                f"fxshard backend: output_placements[{k}] = {tuple(p)!r}: give {ndim} "
                f"placement(s), one per mesh dim"
            )
        out.append(tuple(p))
    return out


class _PlanScope:
    """The plan resolved against the top module of a compile (per options dict).  Graphs traced
    after a graph break see submodules as frame locals (``L['layer']``): their FQNs get the
    submodule's prefix in the top module (``layers.1.``)."""

    def __init__(self):
        self.tops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def resolve(
        self, opts: BackendOptions, frame_modules: dict[str, nn.Module]
    ) -> tuple[PlanConstraints, dict]:
        mesh = opts.mesh_spec
        if not frame_modules:
            if opts.plan == "auto":
                return resolve_plan("auto", None, mesh, opts.tp_dim), {}
            if opts.plan and not calling_modules():
                raise ValueError(
                    "fxshard backend: a module plan needs torch.compile of an nn.Module (this "
                    "graph "
                    "has no module parameters); pass plan={} for plain functions"
                )
            # no parameter in this graph (the tail of a module's forward after a graph break): the
            # plan's entries place nothing here
            return resolve_plan(None, None, mesh, opts.tp_dim), {}
        for top, cons in self.tops.items():
            roots = _prefixes(top, frame_modules)
            if roots is not None:
                return cons, roots
        # a new top: the outermost module running (a graph break may have left the model's own frame
        # to eager Python), else the frame module that contains the others
        for top in [*calling_modules(), *frame_modules.values()]:
            roots = _prefixes(top, frame_modules)
            if roots is not None:
                cons = resolve_plan(opts.plan, top, mesh, opts.tp_dim)
                self.tops[top] = cons
                return cons, roots
        if not opts.plan:  # nothing to place: each frame module's FQNs under its own name
            return resolve_plan(None, None, mesh, opts.tp_dim), {k: f"{k}." for k in frame_modules}
        raise ValueError(
            f"fxshard backend: the graph uses modules {sorted(frame_modules)} that are not parts "
            "of one "
            f"module; compile the top-level module"
        )


def _prefixes(top: nn.Module, frame_modules: dict[str, nn.Module]) -> dict[str, str] | None:
    """{frame local: its FQN prefix in ``top``}, or None if some frame module is not inside
    ``top``."""
    where = {id(m): name for name, m in top.named_modules()}
    out = {}
    for local, mod in frame_modules.items():
        if id(mod) not in where:
            return None
        out[local] = where[id(mod)] + "." if where[id(mod)] else ""
    return out


# caches: the plan scope of each options dict (newest 64), and weak references to every ShardedGraph
# handed to dynamo (``compiled_programs`` lists their programs)
_SCOPES: dict[int, tuple[dict, _PlanScope]] = {}
_GRAPHS: list[weakref.ref] = []
_BUILT = [0]  # how many programs the backend has built (each gets the next number)


def compiled_programs(since: int = 0) -> list:
    """The ShardedPrograms the backend has built and still holds (oldest first), for
    ``explain()`` and tests; ``since``: only those built after ``programs_built()`` said ``since``
    (programs of graphs dynamo dropped meanwhile are gone, so list positions are no marker)."""
    live = [g() for g in _GRAPHS]
    progs = [(n, p) for g in live if g is not None for n, p in g.programs_numbered]
    return [p for n, p in sorted(progs, key=lambda x: x[0]) if n >= since]


def programs_built() -> int:
    """How many programs the backend has built so far (a marker for ``compiled_programs``)."""
    return _BUILT[0]


_ATTRIBUTE = re.compile(r"(?:\.([A-Za-z_]\w*)|\.__dict__\['([A-Za-z_]\w*)'\])$")


def _attribute(src: str, roots: dict) -> str | None:
    """The attribute name of a user input that is an attribute of an object
    (``L['past_key_values'].layers[0].keys``, or ``.__dict__['keys']``); None for anything else
    (a frame local, an item, a module's parameter or buffer)."""
    src = normalize_source(src)
    m = _ATTRIBUTE.search(src)
    if m is None or not src.startswith("L[") or source_fqn(src, roots)[0] != INPUT:
        return None
    if re.search(r"\._(modules|parameters|buffers)\[", src):
        return None
    return m.group(1) or m.group(2)


def _frame_modules(gm: fx.GraphModule) -> dict[str, nn.Module]:
    """The frame roots (locals, or items of them: ``args[0]`` of a wrapped forward) that are modules
    and own this graph's parameters / buffers, by root key."""
    roots = {}
    for p in gm.graph.nodes:
        if p.op == "placeholder":
            src = normalize_source(placeholder_source(p) or "")
            root = source_root(src) if src.startswith("L[") else None
            if root is not None and src[root[3] :].startswith(
                ("._modules[", "._parameters[", "._buffers[")
            ):
                roots[root[0]] = root[1:3]
    frame = dynamo_frame_locals()
    out = {}
    for key, (name, idx) in sorted(roots.items()):
        obj = frame.get(name)
        for i in idx:
            obj = obj[i] if isinstance(obj, (tuple, list)) and i < len(obj) else None
        if isinstance(obj, nn.Module):
            out[key] = obj
    return out


class ShardedGraph:
    """What the backend hands dynamo for one graph: captures, shards and compiles per input
    signature."""

    def __init__(
        self, gm: fx.GraphModule, opts: BackendOptions, constraints: PlanConstraints, roots: dict
    ):
        self.gm = gm
        self.opts = opts
        self.constraints = constraints
        self.roots = roots
        self.sources = dynamo_sources(gm)
        # arguments that are attributes of plain objects (a cache layer's keys), for messages
        self.attributes = {
            i: name
            for i, src in enumerate(self.sources)
            if src and (name := _attribute(src, roots)) is not None
        }
        # outputs dynamo stores into objects' attributes (a DynamicCache's torch.cat): with
        # state="sharded" they come back as KeptTensors where the program leaves them sharded
        stored = attribute_outputs(gm) if not opts.simulate else {}
        self.stored = stored if opts.state == "sharded" else {}
        self.stored_global = stored if opts.state == "global" else {}
        # Python numbers dynamo lifted to 0-d tensors are baked into the capture as constants: their
        # values are part of the signature a capture is reused for
        self.baked = {
            i
            for i, p in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")
            if any(u.op == "call_method" and u.target == "item" for u in p.users)
        }
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        self.returns_sequence = isinstance(out, (tuple, list))
        self.num_outputs = len(out) if self.returns_sequence else 1
        self.entries: dict = {}
        # dynamic shapes: one program for every size of the dims dynamo made symbolic
        self.dynamic = DynamicDims.of(gm)
        self.symbolic: dict = {}  # static part of a signature -> [(shape guards, runner)]
        self.per_size: set = set()  # static signatures that got no symbolic program (said once)
        # arg index -> (weakref to the global tensor, version, local shard)
        self._shards: dict[int, tuple] = {}
        self.programs_numbered: list = []  # (number, ShardedProgram) of every program built

    @property
    def programs(self) -> list:
        """Every ShardedProgram built for this graph (debugging: ``explain()``)."""
        return [p for _, p in self.programs_numbered]

    def _key(self, args):
        mesh = self.opts.mesh_spec if not self.opts.simulate else None
        return tuple(
            (
                (
                    tuple(a.shape),
                    a.dtype,
                    a.device,
                    a.item() if i in self.baked else None,
                    t if t in PLAIN_TENSORS else _arg_kind(a, mesh),
                )
                if isinstance(a, torch.Tensor)
                else (int(a) if isinstance(a, (int, torch.SymInt)) else (type(a), a))
            )
            for i, (a, t) in enumerate(zip(args, map(type, args)))
        )

    def _program_args(self, args):
        """DTensor (and sharded KeptTensor) arguments checked against the program's mesh."""
        for i, a in enumerate(args):
            if type(a) in PLAIN_TENSORS or not is_sharded_arg(a):
                continue
            if self.opts.simulate:
                raise ValueError(
                    "fxshard backend: DTensor arguments need a DeviceMesh and a process group; "
                    "simulate=True takes global tensors (pass x.full_tensor())"
                )
            what = f"argument {i} of the graph ({self.sources[i] or 'an input'})"
            check_mesh(a, self.opts.mesh, what)
            as_program_arg(a, self.opts.mesh_spec, what)
        return args

    def _kept(self, training: bool) -> dict:
        """The outputs handed back as KeptTensors where sharded: tensors stored into objects'
        attributes (a training call's too: the default call's cache is not gathered either; the
        KeptTensor keeps the autograd history, so a loss that reads it gets its gradient)."""
        return self.stored

    def _output_placements(self, training: bool) -> list:
        """Per output: the placements asked for, None where the program's own (reduced) placement
        is handed back (a DTensor, or a KeptTensor for state stored into an attribute),
        replicated where a global tensor is."""
        given = list(self.opts.output_placements or ())
        if len(given) > self.num_outputs:
            raise ValueError(
                f"fxshard backend: output_placements has {len(given)} entries, but the compiled "
                f"graph returns {self.num_outputs} output(s) (a graph break splits the model's "
                "outputs between graphs: give one entry per output of the graph, None for the "
                "program's own placement)"
            )
        replicated = (Replicate(),) * self.opts.mesh_spec.ndim
        out = []
        for k in range(self.num_outputs):
            g = given[k] if k < len(given) else None
            if g is None and self.opts.outputs == "global" and k not in self._kept(training):
                # the global value, or a DTensor where eager would return one (simulated ranks:
                # global values)
                g = replicated if self.opts.simulate else AS_EAGER
            elif g is None and training and k in self._kept(training):
                g = OWN_PLACEMENT  # a KeptTensor (with its autograd history)
            out.append(g)
        return out

    def _output_wrapper(self, prog, training: bool):
        """The outputs asked for as DTensors wrapped (this rank's shard, the program's spec); state
        stored into attributes as KeptTensors where sharded (``wrap(flat, side)``: a training
        call's gradients of its KeptTensors go to its backward through ``side``)."""
        given = self.opts.output_placements or ()
        specs = prog.forward_output_specs
        eager = prog.captured.dtensor_outputs if not self.opts.simulate else ()
        as_dtensor = [
            self.opts.outputs == "dtensor"
            or (k < len(given) and given[k] is not None)
            or (k < len(eager) and eager[k])
            for k in range(len(specs))
        ]
        wrap = output_wrapper(specs, self.opts.mesh, as_dtensor)
        keep = [
            k
            for k in self._kept(training)
            if k < len(specs) and not as_dtensor[k] and specs[k] is not None
            and any(not isinstance(p, Replicate) for p in specs[k].placements)
        ]  # fmt: skip
        if not keep:
            return lambda flat, side=None: wrap(flat)
        timeout = (self.opts.agreement or AgreementOptions()).timeout_s
        keep_outputs = output_keeper(specs, keep, self.opts.mesh, timeout)
        return lambda flat, side=None: keep_outputs(wrap(flat), side)

    def __call__(self, *args):
        args = self._program_args(differentiable_args(args))
        # under autograd (a parameter or input requires grad) the joint forward+backward is sharded
        training = torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args
        )
        entry = None
        if self.dynamic is not None and not training:
            # the symbolic program first: each decode step has new sizes, so a key of sizes
            # would miss every time (a per-size entry exists only for a signature that has no
            # symbolic program: ``per_size``)
            entry = self._symbolic_entry(args)
        if entry is None:
            key = (training, *self._key(args))
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = self._build(args, training)
        flat = entry(args)
        return tuple(flat) if self.returns_sequence else flat[0]

    def _symbolic_entry(self, args):
        """The runner of the symbolic program (one for every size of the dynamic dims) whose shape
        guards this call meets; built on the first call that meets none; None where this graph
        gets a program per size instead (a plan that splits a dynamic dim, ...)."""
        mesh = self.opts.mesh_spec if not self.opts.simulate else None
        layouts = tuple(
            t
            if t in PLAIN_TENSORS
            else layout_of(a, mesh)
            if is_sharded_arg(a)
            else _arg_kind(a, mesh)
            for a, t in zip(args, map(type, args))
        )
        # (Python numbers dynamo lifted to 0-d tensors are baked into a capture: their values too)
        baked = tuple(args[i].item() for i in sorted(self.baked) if i < len(args))
        skey = (self.dynamic.static_key(args), layouts, baked)
        for check, entry in self.symbolic.get(skey, ()):
            if check(args):
                return entry
        if skey in self.per_size:
            return None
        try:
            entry, check = self._build(args, False, dynamic=self.dynamic)
        except NotSymbolic as e:
            self.per_size.add(skey)
            log.info(
                "fxshard: a graph whose sizes change between calls (dynamic shapes) gets a "
                "program per size: %s",
                e,
            )
            return None
        except Exception as e:  # a release whose capture needs concrete sizes (torch 2.11's
            # functionalization runs C++ matmul, which asks numel()): the per-size path is right
            self.per_size.add(skey)
            log.warning(
                "fxshard: no symbolic program for a graph with dynamic shapes on torch %s (%s: "
                "%s); it gets a program per size",
                torch.__version__,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            log.debug("fxshard: the symbolic build's error", exc_info=True)
            return None
        self.symbolic.setdefault(skey, []).append((check, entry))
        return entry

    def _build(self, args, training=False, dynamic=None):
        opts = self.opts
        # DTensor and sharded KeptTensor arguments: their specs are their placeholders', their
        # global shapes are captured
        dt_specs = {
            i: spec_of(a, opts.mesh_spec, f"argument {i}")
            for i, a in enumerate(args)
            if is_sharded_arg(a)
        }
        # KeptTensors not sharded yet (fxshard.kept): placed freely, an update in place handed
        # back in the program's placement (no gather)
        kept_args = frozenset(i for i, a in enumerate(args) if is_kept(a) and i not in dt_specs)
        raw_args = args
        kept_state = frozenset(
            i for i in kept_args if not args[i].viewed and not training and not opts.simulate
        )  # (one that eager code holds views of stays whole: they must keep seeing it)
        args = tuple(
            standin(a) if i in dt_specs else a.local if is_kept(a) else a
            for i, a in enumerate(args)
        )
        # the batch is the leading dim of the first user input; other inputs (rope tables handed to
        # a layer's frame after a graph break, masks) stay replicated on the data-parallel dims
        first = next(
            (
                a
                for a, src in zip(args, self.sources)
                if isinstance(a, torch.Tensor)
                and (source_fqn(src, self.roots)[0] if src else INPUT) == INPUT
            ),
            None,
        )
        config = ShardConfig.make(
            opts.mesh,
            cost_model=opts.cost_model,
            multi_dim_collectives=opts.multi_dim_collectives,
            bucket_bytes=opts.bucket_bytes,
            search=opts.search,
            batch_size=first.shape[0] if first is not None and first.ndim else None,
            replicate_grads=training,
        )  # gradients go back to the global tensors
        if opts.simulate:
            config = dataclasses.replace(config, device_mesh=None)
        prog = api.shard_dynamo_graph(
            self.gm,
            args,
            config,
            self.constraints,
            roots=self.roots,
            sources=self.sources,
            training=training,
            output_placements=self._output_placements(training),
            arg_specs=dt_specs,
            # DTensor arguments (KeptTensors are plain tensors to eager code)
            dtensor_args=frozenset(i for i in dt_specs if is_dtensor(raw_args[i])),
            kept_state=kept_state,
            auto_options=opts.auto_options,
            dynamic=dynamic,
        )
        if dynamic is not None:
            why = splits_dynamic(prog.global_graph)
            if why:
                raise NotSymbolic(f"the plan splits a dim whose size changes: {why}")
            prog.lowered_graph  # noqa: B018 (restoring the symbolic graph may fail: say so now)
        self.programs_numbered.append((_BUILT[0], prog))
        _BUILT[0] += 1
        if training:
            return self._training_entry(prog, dt_specs)
        arg_index = [info(p).arg_index for p in prog.placeholders]
        # buffers the forward updates in place: their new (global) values are extra outputs
        updated = {
            r.what: next(info(p).arg_index for p in prog.placeholders if info(p).fqn == r.what)
            for r in prog.output_roles()
            if r.kind == "mutate"
        }

        # user inputs it updates in place (a static KV cache): input index -> argument
        input_args = {
            info(p).input_index: info(p).arg_index
            for p in prog.placeholders
            if info(p).kind == INPUT
        }

        def write_back(a, flat, targets=None):
            return prog.apply_updates(
                flat,
                {f: a[i] for f, i in updated.items()},
                {k: (targets or {}).get(i, a[i]) for k, i in input_args.items()},
            )

        def values(a):  # every placeholder's global value: an argument, or a traced constant
            return [
                (a[i].local if is_kept(a[i]) else a[i])
                if i is not None
                else prog.captured.state[info(p).fqn]
                for i, p in zip(arg_index, prog.placeholders)
            ]

        if opts.simulate:
            run = lambda a: write_back(a, prog.simulate_placeholders(values(a)))  # noqa: E731
            return (_carrying(run, dynamic), self._shape_guards(prog)) if dynamic else run
        compiled = CompiledProgram(
            prog, opts.mesh, inductor=opts.inductor, own_state=False, agreement=opts.agreement
        )
        kinds = [info(p).kind for p in prog.placeholders]
        fqns = [info(p).fqn for p in prog.placeholders]
        state = prog.captured.state
        check = self._agreement(prog, compiled.agreement)
        wrap = self._output_wrapper(prog, training=False)
        updated_inputs = {r.what for r in prog.output_roles() if r.kind == "mutate_input"}
        # KeptTensors the program updates in place: into their shard (sharded ones), or into a new
        # shard they then hold in the program's placement (fxshard.kept's, replicated until now)
        held = {
            rec.arg_index: spec
            for p, spec in zip(prog.placeholders, compiled.specs)
            if (rec := info(p)).kind == INPUT and rec.input_index in updated_inputs
            and (rec.arg_index in dt_specs or rec.arg_index in kept_args)
        }  # fmt: skip
        self._hint_state(prog, held)

        def run(a):
            with fail_together(f"the sharded program of {prog.name}"):
                check(a)
                local, targets = [], {}
                for i, kind, spec, fqn in zip(arg_index, kinds, compiled.specs, fqns):
                    if i is None:  # a tensor constant of the trace: the program's own value
                        local.append(self._cached_shard(fqn, state[fqn], spec, compiled))
                        continue
                    t = a[i]
                    if kind in STATE_KINDS:
                        local.append(self._cached_shard(i, t, spec, compiled))
                    elif i in dt_specs:
                        local.append(local_arg(t, spec, compiled.coord_ints, f"argument {i}"))
                    elif i in kept_args:  # not sharded: its tensor is the value
                        local.append(compiled.local_of(t.local, spec))
                    else:
                        local.append(compiled.local_of(t, spec))
                for i, spec in held.items():
                    if i not in kept_state and is_kept(a[i]):
                        targets[i] = a[i].local
                    elif i in kept_state:
                        targets[i] = torch.empty(
                            spec.at_sizes(a[i].shape).local_shape(compiled.coord_ints),
                            dtype=spec.dtype,
                            device=a[i].device,
                        )
                outs = write_back(a, compiled.run_local(local), targets)
                for i, spec in held.items():
                    if i in kept_state:
                        a[i].hold(targets[i], spec.at_sizes(a[i].shape), opts.mesh)
                return wrap(outs)

        return (_carrying(run, dynamic), self._shape_guards(prog)) if dynamic else run

    @staticmethod
    def _shape_guards(prog):
        """check(args): whether a call's sizes meet what the symbolic program was traced and
        compiled for (its ShapeEnv's guards, read after Inductor added its own)."""
        sym = prog.captured.symbolic
        return shape_guards(sym.mode, sym.inputs)

    def _hint_state(self, prog, held) -> None:
        """Say (once per program) which object attributes it gathers for the caller every call
        where they could stay sharded: plain tensors it updates in place sharded (written back
        global: ``fxshard.kept`` makes them stay sharded), and with state="global" the tensors it
        stores into attributes sharded."""
        by_input = {info(p).input_index: info(p).arg_index for p in prog.placeholders}
        out = next(n for n in reversed(prog.global_graph.graph.nodes) if n.op == "output")
        updated, stored = [], []
        for k, (role, node) in enumerate(zip(prog.output_roles(), flat_outputs(out))):
            i = by_input.get(role.what) if role.kind == "mutate_input" else None
            gathered = (
                isinstance(node, fx.Node)
                and info(node).kind == NodeKind.REDISTRIBUTE
                and isinstance(info(node.args[0]).spec, ShardingSpec)
                and any(not isinstance(p, Replicate) for p in info(node.args[0]).spec.placements)
            )
            if not gathered:
                continue
            if i in self.attributes and i not in held:
                updated.append(self.sources[i])
            elif role.kind == "output" and k in self.stored_global:
                stored.append(self.stored_global[k])
        if updated:
            log.info(
                "fxshard: %s updates %s in place sharded and writes the value back global every "
                "call (a tensor allocated outside the compiled code keeps its identity); allocate "
                "it inside the compiled code, or wrap it: obj.attr = fxshard.kept(tensor), to keep "
                "it sharded between calls",
                prog.name,
                ", ".join(updated[:3]) + (", ..." if len(updated) > 3 else ""),
            )
        if stored:
            log.info(
                "fxshard: %s stores %s sharded and gathers them every call (state='global'); "
                "state='sharded' keeps them sharded between calls",
                prog.name,
                ", ".join(stored[:3]) + (", ..." if len(stored) > 3 else ""),
            )

    def _agreement(self, prog, agreement):
        """check(args): the ranks' check of this call (its first calls only): the graph's user
        inputs and (first call) the parameters / buffers it runs on, by their dynamo sources."""
        inputs, state = [], []
        for p in prog.placeholders:
            rec = info(p)
            if rec.kind in STATE_KINDS and rec.arg_index is not None:
                state.append((rec.fqn, rec.arg_index))
            elif rec.kind == INPUT:
                inputs.append((f"input {p.name}", rec.arg_index))

        def check(a):
            # DTensor arguments differ across ranks by design (their spec is in the signature)
            if agreement.active:
                agreement.check(
                    {
                        n: a[i].local if is_kept(a[i]) else a[i]
                        for n, i in inputs
                        if not is_sharded_arg(a[i])
                    },
                    {f: a[i] for f, i in state},
                )

        return check

    def _training_entry(self, prog, dt_specs):
        """An autograd-aware runner: the arguments that require grad get global gradients (DTensor
        arguments: DTensor gradients placed like them)."""
        primals = [p for p in prog.placeholders if info(p).kind != TANGENT]
        index = [info(p).arg_index for p in primals]
        state = prog.captured.state
        fqns = [info(p).fqn for p in primals]

        def values(a):  # the arguments, and the traced constants (no argument: their own value)
            return [a[i] if i is not None else state[f] for i, f in zip(index, fqns)]

        if self.opts.simulate:

            def run(a):
                return list(SimulatedTraining.apply(prog, *values(a)))

            return run
        kinds = [info(p).kind for p in primals]

        def localize(global_args):
            out = []
            for i, kind, spec, t, f in zip(index, kinds, compiled.primal_specs, global_args, fqns):
                if i is None:
                    out.append(self._cached_shard(f, t, spec, compiled))
                elif kind in STATE_KINDS:
                    out.append(self._cached_shard(i, t, spec, compiled))
                elif i in dt_specs:  # a DTensor's local tensor, taken outside the Function
                    out.append(t)
                else:
                    out.append(compiled.local_of(t, spec))
            return out

        compiled = CompiledTraining(
            prog,
            self.opts.mesh,
            inductor=self.opts.inductor,
            localize=localize,
            agreement=self.opts.agreement,
        )
        check = self._agreement(prog, compiled.agreement)

        specs = compiled.primal_specs
        wrap = self._output_wrapper(prog, training=True)

        def run(a):
            with fail_together(f"the sharded program of {prog.name}"):
                check(a)
                # a DTensor's to_local() is differentiable: its gradient comes back as a DTensor
                side: dict = {}  # the gradients of the KeptTensors handed back (global)
                outs = compiled.apply(
                    [
                        local_arg(v, s, compiled.coord_ints, f"argument {i}")
                        if i in dt_specs
                        else v
                        for i, s, v in zip(index, specs, values(a))
                    ],
                    side=side,
                )
                return wrap(list(outs) if isinstance(outs, tuple) else [outs], side)

        return run

    def _cached_shard(self, i, t, spec, compiled):
        hit = self._shards.get(i)
        if (
            hit is not None
            and hit[0]() is t
            and hit[1] == (tensor_version(t), t.data_ptr())
            and (hit[3] is spec or hit[3] == spec)  # a program that places it otherwise (on
        ):  # another mesh dim, with the same local shape) gets its own shard
            return hit[2]
        local = compiled.local_of(t, spec)
        self._shards[i] = (weakref.ref(t), (tensor_version(t), t.data_ptr()), local, spec)
        return local


def _carrying(run, dynamic):
    """A symbolic program's runner taking the dynamo graph's arguments: its dynamic ints that are
    no tensor's size go in as tensors of that length (``capture.dynamo.size_carrier``)."""
    if not dynamic.free:
        return run
    free = tuple(dynamic.free)

    def carried(a):
        a = list(a)
        for i in free:
            a[i] = size_carrier(int(a[i]))
        return run(tuple(a))

    return carried


def _arg_kind(a, mesh) -> object:
    """What of a tensor argument besides its shape decides its program: a DTensor's (or sharded
    KeptTensor's) spec; whether a KeptTensor not sharded may go sharded (none of its views is
    held); the tensor's type."""
    if is_sharded_arg(a):
        return spec_of(a, mesh)
    if is_kept(a):
        return ("kept", a.viewed)
    return type(a)


def fxshard_backend(
    gm: fx.GraphModule, example_inputs: Sequence, options: dict | None = None, **kwargs
) -> ShardedGraph:
    """``torch.compile(..., backend="fxshard", options={"mesh": ..., "plan": ...})``."""
    if kwargs:
        raise ValueError(
            f"fxshard backend: unexpected arguments {sorted(kwargs)}; pass settings in "
            f"options={{...}}"
        )
    opts = BackendOptions.parse(options)
    key = id(options)
    if key not in _SCOPES or _SCOPES[key][0] is not options:
        # keep the newest compiles' scopes, not every options dict ever seen
        while len(_SCOPES) >= 64:
            _SCOPES.pop(next(iter(_SCOPES)))
        _SCOPES[key] = (options, _PlanScope())
    constraints, roots = _SCOPES[key][1].resolve(opts, _frame_modules(gm))
    graph = ShardedGraph(gm, opts, constraints, roots)
    _GRAPHS[:] = [g for g in _GRAPHS if g() is not None] + [weakref.ref(graph)]
    log.info("fxshard backend: graph with %d nodes (frame modules %s)", len(gm.graph.nodes), roots)
    return graph


__all__ = [
    "fxshard_backend",
    "compiled_programs",
    "programs_built",
    "BackendOptions",
    "ShardedGraph",
]


def _explain_tracing_error(exc: BaseException) -> str | None:
    """What to do about an error dynamo raised while it traced a frame for this backend, where it
    came from DTensor's own rules (dynamo runs them on DTensor arguments to learn each value's
    metadata, before the backend sees a graph)."""
    seen, texts = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    text = "\n".join(texts)
    if "DTensor" not in text and "Sharding propagation failed" not in text:
        return None
    return (
        "fxshard: this error comes from DTensor's own rules, which dynamo runs on DTensor "
        "arguments while it traces the frame, before the fxshard backend sees the graph. While "
        "it traces for fxshard, plain tensors count as replicated (the global values) and an op "
        "DTensor refuses on its inputs' placements runs on the global values; what is left is "
        "DTensor's. Pass the global tensor (x.full_tensor()), or call "
        "fxshard.parallelize(model, mesh, plan), which traces without DTensor's rules and takes "
        "DTensor arguments as they are."
    )


on_dynamo_compiles(fxshard_backend, _explain_tracing_error)
