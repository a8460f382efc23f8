"""What fxshard records about graph nodes: ``node.meta["fxshard"]`` (a typed ``NodeInfo``).

Every stage reads what earlier stages wrote here and writes its own fields; nothing else in
``node.meta`` is fxshard's.  Also here: the kinds of node, the roles of a joint graph's outputs, the
``fxshard::boundary`` marker op (a planned module's inputs and outputs, and complete gradients) and
the identity op a redistribution is (``redistribute``), and small helpers over FX arguments that
every stage needs (tensor inputs in the order sharding rules count them).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
import torch.fx as fx


class NodeKind(str, Enum):
    """What a node is.  A ``str`` enum: ``rec.kind == "param"`` reads as it always did."""

    PARAM = "param"
    BUFFER = "buffer"
    CONSTANT = "constant"  # a tensor constant lifted by export
    INPUT = "input"  # a user input
    TANGENT = "tangent"  # joint graphs: the incoming gradient of a forward output
    OP = "op"
    BOUNDARY = "boundary"  # an ``fxshard::boundary`` marker
    REDISTRIBUTE = "redistribute"  # a placement change (inserted by the redistribute stage)
    OUTPUT = "output"

    def __str__(self) -> str:
        return self.value


PARAM, BUFFER, CONSTANT, INPUT, TANGENT = (
    NodeKind.PARAM,
    NodeKind.BUFFER,
    NodeKind.CONSTANT,
    NodeKind.INPUT,
    NodeKind.TANGENT,
)
STATE_KINDS = (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.CONSTANT)
# an input_placements entry: a plain input the program may place freely and, if it updates it in
# place, hands back placed like it (a KeptTensor that is not sharded yet: ``runtime.boundary``)
KEPT_STATE = "kept state"
# an output_placements entry (the backend's default): the global value, or, where eager torch would
# return a DTensor (``eager_dtensor_outputs``), the program's own placement as a DTensor
AS_EAGER = "as eager"
# an output_placements entry: the program's own placement (reduced), under autograd too, where an
# output without one is handed back global (the state a training call stores into objects, which
# the backend hands back as KeptTensors); its incoming gradient comes in replicated
OWN_PLACEMENT = "own placement"
GRAD_TAG = "grad:"  # boundary tag of a complete gradient: "grad:<forward node name>"


class Role(NamedTuple):
    """What one flat output of a program is: ``("output", i)``, ``("grad_param", fqn)`` or
    ``("grad_input", i)`` (a tuple: it compares equal to the plain tuple)."""

    kind: str
    what: object


@dataclass
class NodeInfo:
    """``node.meta["fxshard"]``: everything the stages record about one node."""

    kind: NodeKind = NodeKind.OP
    fqn: str | None = None  # parameters, buffers, constants
    aliases: tuple[str, ...] = ()  # the other names of a tied parameter / buffer
    input_index: int | None = None  # user inputs: position among the program's inputs
    output_index: int | None = None  # tangents: the forward output this is the gradient of
    arg_index: int | None = None  # dynamo graphs: position among the graph's arguments
    module: str = ""  # FQN of the innermost module the node belongs to ("" = top level)
    source: str = ""  # "file.py:123"
    code: str = ""  # that line of source
    tag: str = ""  # boundary markers: "<module fqn>:in:<i>" / ":out:<i>" / "grad:<forward node>"
    roles: tuple[Role, ...] = ()  # the output node of a joint graph: what each flat output is
    spec: object = None  # output ShardingSpec (tuple of them for multi-output ops)
    input_specs: tuple = ()  # required ShardingSpec per tensor input (None: non-tensor arg)
    provenance: str = ""  # who decided the placement
    plan: object = None  # RedistributePlan (redistribute nodes)
    hub: object = None  # plan="auto": the one placement a value read by several consumers moves to
    flops: float | None = None  # modelled flops of the op (memoised by the cost model)
    carries: tuple = ()  # a per-rank graph's collective: the planned collectives it runs


@dataclass(frozen=True)
class Collective:
    """One collective: a step of a redistribution's plan, or (``ShardedProgram.collectives``) what
    the per-rank graph runs, with the planned steps it ``carries`` (several once bucketed)."""

    kind: str  # all_gather / reduce_scatter / all_reduce / all_to_all
    mesh_dims: tuple[int, ...]
    bytes: int  # per rank, the collective's local input
    cost: float  # modelled µs
    node: str  # the redistribute node (planned), or the per-rank graph's collective node
    provenance: str  # why it is there: the consumer and its module / plan entry
    transition: str  # e.g. "S(1)R -> S(1)P" on the mesh dims moved
    # "backward" for collectives that depend on an incoming gradient (training)
    phase: str = "forward"
    carries: tuple = ()  # per-rank collectives: the planned ones they run
    # per rank, bytes of padding the collective carries beyond ``bytes`` (uneven shards are padded
    # to the group's largest chunk, so that every rank sends the same sizes)
    padding: int = 0


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes that depend on an incoming gradient (a tangent placeholder); empty for forward
    graphs."""
    seen: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and info(n).kind == NodeKind.TANGENT) or any(
            a in seen for a in n.all_input_nodes
        ):
            seen.add(n)
    return seen


def info(node: fx.Node) -> NodeInfo:
    """The node's record (created empty on first use)."""
    rec = node.meta.get("fxshard")
    if rec is None:
        rec = node.meta["fxshard"] = NodeInfo()
    return rec


# ---- marker and redistribute ops -----------------------------------------------------------------


@torch.library.custom_op("fxshard::boundary", mutates_args=())
def boundary(x: torch.Tensor, tag: str) -> torch.Tensor:
    """Marks a value crossing a planned module's boundary; the identity on values."""
    return x.clone()


@boundary.register_fake
def _boundary_fake(x: torch.Tensor, tag: str) -> torch.Tensor:
    return torch.empty_like(x)


@boundary.register_autograd
def _boundary_backward(ctx, grad):
    # a boundary constrains the forward value only; its gradient flows through unconstrained
    return grad, None


BOUNDARY = torch.ops.fxshard.boundary.default


def redistribute(x: torch.Tensor) -> torch.Tensor:
    """The identity on global values; lowering turns it into its plan's collectives."""
    return x


# ---- arguments -----------------------------------------------------------------------------------


def flat_args(x: object, out: list | None = None) -> list:
    """Leaves of nested lists / tuples / dicts in ``tree_flatten`` order (FX arguments hold only
    those containers; pytree's general machinery is the slow part of a pass over a large graph)."""
    out = [] if out is None else out
    if isinstance(x, (list, tuple)):
        for y in x:
            flat_args(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            flat_args(y, out)
    else:
        out.append(x)
    return out


def arg_key(x: object, leaf: Callable) -> object:
    """A hashable key of nested arguments: containers by type and length, leaves through
    ``leaf``."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(arg_key(y, leaf) for y in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, arg_key(y, leaf)) for k, y in x.items()))
    return leaf(x)


def tensor_args(node: fx.Node) -> list[fx.Node]:
    """The node's tensor inputs in tree_flatten order of (args, kwargs) (what the rules count)."""
    leaves = flat_args(node.args)
    flat_args(node.kwargs, leaves)
    return [
        a for a in leaves if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
    ]


def used_outputs(node: fx.Node) -> set[int]:
    """Indices of the node's outputs something reads (getitem users of a multi-output op)."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return {u.args[1] for u in node.users if u.target is operator.getitem}
    return {0} if node.users else set()


def flat_outputs(output: fx.Node) -> list:
    """The output node's values, flat (one value is a list of one)."""
    outs = output.args[0]
    return list(outs) if isinstance(outs, (tuple, list)) else [outs]


def output_roles(output: fx.Node) -> list[Role]:
    """The role of every flat output: the joint graph's, else ("output", i) each."""
    rec = info(output)
    return list(rec.roles) or [Role("output", i) for i in range(len(flat_outputs(output)))]


class NotSymbolic(ValueError):
    """A graph gets no program for every size of its dynamic dims (the backend builds one per size
    instead): a placement splits one, or a shape cannot be traced symbolically."""


def whole_dims(val: object) -> tuple[int, ...]:
    """The dims of a value whose size changes between calls (dynamic shapes: the hinted values of
    ``capture.symbolic``): a program for every size never splits them."""
    return getattr(val, "_fxshard_dynamic", ())


def where(rec: NodeInfo) -> str:
    """`` at file.py:12 (the code)`` for an error message (empty without a source line)."""
    at = f" at {rec.source}" if rec.source else ""
    code = f" ({rec.code})" if rec.code else ""
    return at + code


def is_custom_op(op: object) -> bool:
    """An operator outside aten / prims / fxshard (a user's, or a library's)."""
    name = getattr(op, "name", None)
    if not callable(name):
        return False
    return name().split("::")[0] not in ("aten", "prims", "fxshard")


def eager_dtensor_outputs(gm: fx.GraphModule, dtensor_args: set, eager_types: dict) -> tuple:
    """Per forward output of a captured graph: would eager torch return a DTensor?  A value is one
    where it derives from a DTensor argument (``dtensor_args``: argument indices, or input indices
    where the graph has none) or from a plan boundary whose style hands on DTensors; a boundary
    whose style calls ``to_local()`` (``eager_types[tag] == "local"``) makes it plain again.
    Entries: False (a plain tensor), True (a DTensor), or the boundary's tag where the output is
    that boundary's value (a DTensor placed as the boundary says)."""
    dtensor: set = set()
    for n in gm.graph.nodes:
        rec = info(n)
        if n.op == "placeholder":
            index = rec.arg_index if rec.arg_index is not None else rec.input_index
            if rec.kind == NodeKind.INPUT and index in dtensor_args:
                dtensor.add(n)
        elif rec.kind == NodeKind.BOUNDARY and rec.tag in eager_types:
            if eager_types[rec.tag] == "dtensor":
                dtensor.add(n)
        elif n.op == "call_function" and any(a in dtensor for a in n.all_input_nodes):
            dtensor.add(n)
        elif n.op == "output":
            return tuple(
                (info(v).tag if info(v).kind == NodeKind.BOUNDARY else True)
                if isinstance(v, fx.Node) and v in dtensor
                else False
                for v, r in zip(flat_outputs(n), output_roles(n))
                if r.kind == "output"
            )
    return ()
