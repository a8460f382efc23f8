"""MoE experts as one region: expert parallelism by token dispatch (all-to-all).

A Hugging Face experts module (``MixtralExperts``, ``Qwen3MoeExperts``, ... : every class that
``transformers.integrations.moe.use_experts_implementation`` decorates) computes, for tokens ``x``
[T, H] routed to experts ``idx`` [T, k] with weights ``w`` [T, k]::

    out[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])

Each (token, choice) pair is independent of the others, so the module can run on any subset of
pairs, on any rank, and the results add up.  Where a plan shards the experts' fused weights by
experts (transformers' ``grouped_gemm`` style: dim 0), a forward capture replaces the traced body of
the module by one op, ``fxshard::moe_experts(x, idx, w, params, key)`` (``capture.regions``), whose
global meaning is the module's own forward.  Its rule has, per mesh dim:

* tokens and experts replicated: the module as it is;
* tokens split by rows (``Shard(0)``), experts replicated: each rank its rows, no collective;
* tokens replicated, experts split: each rank the pairs routed to its experts
  (``moe_experts_local``), a Partial sum (transformers' own EP: one all-reduce);
* tokens split by rows *and* experts split on the same mesh dim: **token dispatch**
  (``moe_experts_dispatch``, torchtitan's EP): a rank sorts its pairs by expert, sends each
  expert's rows to the rank that holds it (all-to-all of per-expert counts, then of the rows), runs
  its experts on what it receives, sends the results back (all-to-all) and combines them with the
  routing weights.  The output is the rank's rows: ``Shard(0)``.

Routing is data dependent: how many rows go where is known only when the program runs.  The static
per-rank program keeps that inside one op (static shapes around it: the rank's tokens in, its rows
out); the op exchanges exact counts first, so no capacity is fixed, no token dropped and no padding
sent.  On a rank the module's own forward runs on the rows it received, with its block of the
experts (a shallow view of the module whose expert-count attributes say the block's size), top-1
and weight one: whatever the class computes per expert (biases, clamped activations, other
``experts_implementation``s) is what runs.  Whether a module satisfies the per-pair contract is
checked on a probe when the region is formed (``check``); one that does not keeps its traced body.

Training: ``moe_experts`` differentiates into ``moe_experts_backward`` (lowered like the forward:
whole, this rank's pairs, or dispatch).  The dispatch backward routes again, sends each pair's row
with its output gradient and routing weight to the expert's rank, runs the experts' vjp there (the
experts' forward recomputed on the received rows: no data-dependent buffer lives between forward
and backward) and sends the rows' and the weights' gradients back.

Under simulated ranks (``LocalTensorMode``) the dispatch ops run every rank's part in one process
with the exchange done in memory, the same steps and arithmetic (``_Exchange``).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch import (
    Partial,
    Replicate,
    Shard,
    autograd_vjp,
    global_module_hooks,
    is_fake,
    local_tensor_mode_class,
    local_tensor_values,
    make_local_tensor,
    process_group,
    simulated_groups,
    tree_flatten,
    tree_unflatten,
)


@dataclasses.dataclass
class Region:
    """A registered experts module: its parameters in the op's order, and its expert count."""

    ref: weakref.ref  # the module (not kept alive by the registry)
    fqn: str
    names: tuple[str, ...]
    num_experts: int
    count_attrs: tuple[str, ...]  # int attributes that hold the expert count

    @property
    def module(self) -> nn.Module | None:
        return self.ref()

    def view(self, count: int) -> nn.Module:
        """The module as a rank holding ``count`` experts sees it, now: a private shallow copy
        (its attributes as they are at this call; no hooks, no parameters: ``_call`` passes them)
        whose expert-count attributes say ``count``."""
        module = self.module
        if module is None:
            raise RuntimeError(f"fxshard: the experts module {self.fqn} is gone")
        v = copy.copy(module)
        v.__dict__ = {k: val for k, val in module.__dict__.items() if k != "forward"}
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            if hooks in v.__dict__:
                v.__dict__[hooks] = type(v.__dict__[hooks])()
        v.__dict__["_parameters"] = {}
        for a in self.count_attrs:
            object.__setattr__(v, a, count)
        return v


_REGIONS: dict[str, Region] = {}


def experts_module(module: nn.Module) -> tuple[str, ...] | None:
    """The expert-sharded parameters of a module that follows the experts contract (forward
    ``(hidden_states, top_k_index, top_k_weights)``, parameters whose dim 0 is the expert count),
    else None."""
    if not isinstance(module, nn.Module):
        return None
    try:
        params = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    if len(params) != 3 or not isinstance(getattr(module, "num_experts", None), int):
        return None
    e = module.num_experts
    names = tuple(n for n, _ in module.named_parameters(recurse=False))
    if not names or any(getattr(module, n).shape[:1] != (e,) for n in names):
        return None
    # children (an activation module) may hold nothing a rank's view would have to split
    if any(True for _ in module.buffers()) or len(list(module.parameters())) != len(names):
        return None
    return names


def _foreign_hooks(module: nn.Module) -> str | None:
    """Why the module's call is more than its class's forward (hooks other than fxshard's
    boundary markers, an instance ``forward``), which a region would leave out; None if not."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    hooks += global_module_hooks()
    if any(not hasattr(h, "fxshard_boundary") for h in hooks):
        return "it has forward hooks (a region runs its class's forward only)"
    fwd = module.__dict__.get("forward")
    if fwd is not None and not getattr(fwd, "fxshard_region", False):
        return "its instance has a forward of its own"
    return None


def register(module: nn.Module, fqn: str) -> str:
    """The key the region ops name ``module`` by: its FQN (``#i`` after it where another live
    module object took that FQN first), the same on every rank (programs are compared by
    fingerprint)."""
    i = 0
    while True:
        key = fqn if i == 0 else f"{fqn}#{i}"
        reg = _REGIONS.get(key)
        if reg is None or reg.module is None:
            break
        if reg.module is module:
            return key
        i += 1
    names = experts_module(module)
    if names is None:
        raise ValueError(f"{fqn}: not an experts module")
    e = module.num_experts
    # the expert count as the module holds it (num_experts, n_routed_experts, ...): a rank's view
    # says its block's size there (another int that happens to equal it is left alone)
    attrs = tuple(
        a for a, v in vars(module).items() if type(v) is int and v == e and "expert" in a.lower()
    )
    _REGIONS[key] = Region(weakref.ref(module), fqn, names, e, attrs)
    return key


def region(key: str) -> Region:
    return _REGIONS[key]


def _call(key: str, params, x, idx, w, count: int | None = None) -> torch.Tensor:
    """The module's own forward (its class's: no hooks) with ``params`` as its parameters."""
    reg = _REGIONS[key]
    v = reg.view(reg.num_experts if count is None else count)
    v.__dict__["_parameters"] = dict(zip(reg.names, params))
    return type(v).forward(v, x, idx, w)


def _rows(key: str, params, rows, ids, dtype, count: int) -> torch.Tensor:
    """Each row routed to one (local) expert with weight one: [R, H]."""
    if rows.shape[0] == 0:
        return rows.new_zeros(rows.shape)
    ones = torch.ones(rows.shape[0], 1, dtype=dtype, device=rows.device)
    return _call(key, params, rows, ids[:, None], ones, count)


def _block_pairs(idx: torch.Tensor, first: int, count: int) -> tuple:
    """(the flattened pairs routed to experts ``first .. first + count - 1``, their local ids)."""
    flat = idx.reshape(-1)
    order = torch.nonzero((flat >= first) & (flat < first + count)).reshape(-1)
    return order, flat[order] - first


def _scattered_grads(x, idx, w, order, d_rows, d_wp) -> tuple:
    """The tokens' and routing weights' gradients from per-pair ones (pairs in ``order``)."""
    dx = torch.zeros_like(x).index_add_(0, order // idx.shape[1], d_rows.to(x.dtype))
    dw = torch.zeros_like(w).reshape(-1)
    dw[order] = d_wp.to(w.dtype)
    return dx, dw.reshape(w.shape)


def _combine(x, idx, w, order, y) -> torch.Tensor:
    """out[t] = sum over t's pairs of w * y, y's rows in ``order`` (of the flattened pairs)."""
    k = idx.shape[1]
    out = torch.zeros_like(x)
    if order.numel():
        weights = w.reshape(-1)[order].unsqueeze(-1)
        out.index_add_(0, order // k, (y * weights).to(out.dtype))
    return out


# ---- the region op: the module's own forward ----------------------------------------------------


@torch.library.custom_op("fxshard::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, params: list[torch.Tensor], key: str
) -> torch.Tensor:
    """The experts module ``key`` on ``x`` routed by ``idx`` with weights ``w`` (its forward)."""
    return _call(key, params, x, idx, w).to(x.dtype).clone()


@moe_experts.register_fake
def _moe_experts_fake(x, idx, w, params, key):
    return torch.empty_like(x)


@torch.library.custom_op("fxshard::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    params: list[torch.Tensor],
    key: str,
) -> list[torch.Tensor]:
    """``moe_experts``' gradients for output gradient ``g``: [x's, w's, every parameter's]."""

    def f(x, w, *ps):
        return _call(key, ps, x, idx, w).to(x.dtype)

    _, grads = autograd_vjp(f, [x, w, *params], g.contiguous())
    return [t.contiguous() for t in grads]


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(g, x, idx, w, params, key):
    return _grads_like(x, w, params)


def _grads_like(x, w, params) -> list[torch.Tensor]:
    return [torch.empty_like(x), torch.empty_like(w), *[torch.empty_like(p) for p in params]]


def _setup(ctx, inputs, output):
    x, idx, w, params, key = inputs
    ctx.save_for_backward(x, idx, w, *params)
    ctx.key = key


def _backward(ctx, g):
    x, idx, w, *params = ctx.saved_tensors
    dx, dw, *dparams = moe_experts_backward(g, x, idx, w, params, ctx.key)
    return dx, None, dw, dparams, None


moe_experts.register_autograd(_backward, setup_context=_setup)


# ---- tokens replicated, experts split: this rank's pairs, a Partial sum --------------------------


@torch.library.custom_op("fxshard::moe_experts_local", mutates_args=())
def moe_experts_local(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    params: list[torch.Tensor],
    key: str,
    first: torch.Tensor,
) -> torch.Tensor:
    """The pairs routed to experts ``first .. first + count - 1`` (``params``: their block); zero
    for every other: the ranks' results add up to the module's."""
    count = params[0].shape[0]
    order, ids = _block_pairs(idx, int(first), count)
    y = _rows(key, params, x[order // idx.shape[1]], ids, w.dtype, count)
    return _combine(x, idx, w, order, y)


@moe_experts_local.register_fake
def _moe_experts_local_fake(x, idx, w, params, key, first):
    return torch.empty_like(x)


@torch.library.custom_op("fxshard::moe_experts_local_backward", mutates_args=())
def moe_experts_local_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    params: list[torch.Tensor],
    key: str,
    first: torch.Tensor,
) -> list[torch.Tensor]:
    """``moe_experts_local``'s gradients: x's and w's from this rank's pairs (zero elsewhere:
    they add up over the ranks), this rank's experts' whole."""
    count = params[0].shape[0]
    order, ids = _block_pairs(idx, int(first), count)
    tok = order // idx.shape[1]
    d_rows, d_wp, d_params = _pair_grads(
        key, params, x[tok], ids, g[tok], w.reshape(-1)[order], count
    )
    return [*_scattered_grads(x, idx, w, order, d_rows, d_wp), *d_params]


@moe_experts_local_backward.register_fake
def _moe_experts_local_backward_fake(g, x, idx, w, params, key, first):
    return _grads_like(x, w, params)


# ---- tokens split, experts split on one mesh dim: token dispatch ---------------------------------


def _route(idx: torch.Tensor, starts: list[int]):
    """(pairs sorted by expert, per-expert counts [E], per-rank counts [n]) of a rank's pairs; a
    pair routed to no expert (an id outside 0 .. E-1, transformers' EP sentinel) is dropped, as
    the module drops it (its output rows are zero)."""
    e = starts[-1]
    flat = idx.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    order = torch.argsort(torch.where(valid, flat, e), stable=True)[: int(valid.sum())]
    per_expert = torch.bincount(flat[valid], minlength=e)
    per_rank = torch.stack([per_expert[a:b].sum() for a, b in itertools.pairwise(starts)])
    return order, per_expert, per_rank


def _received_ids(recv_hist: torch.Tensor, n: int, count: int) -> torch.Tensor:
    """Local expert ids of the received rows (each source's rows come sorted by expert)."""
    ids = torch.arange(count, device=recv_hist.device).repeat(n)
    return torch.repeat_interleave(ids, recv_hist.reshape(-1))


class _Exchange:
    """All-to-alls among the ``n`` ranks of a group, for the group ranks this process runs: one
    on a real process group (``pg``), every one under simulation (the exchange in memory).
    ``chunks[src][dst]`` in, ``received[dst][src]`` out; ``sizes[dst][src]``: the rows each
    receiver expects (a real all-to-all allocates them)."""

    def __init__(self, n: int, pg=None):
        self.n, self.pg = n, pg

    def __call__(self, chunks: dict, sizes: dict) -> dict:
        if self.pg is None:
            return {d: [chunks[s][d] for s in range(self.n)] for d in range(self.n)}
        ((r, send),) = chunks.items()
        recv = sizes[r]
        out = send[0].new_empty(sum(recv), *send[0].shape[1:])
        sent = [c.shape[0] for c in send]
        dist.all_to_all_single(out, torch.cat(send).contiguous(), recv, sent, group=self.pg)
        return {r: list(out.split(recv))}


def _count(starts, r: int) -> int:
    return starts[r + 1] - starts[r]


def _dispatched(ranks: dict, ex: _Exchange, starts: list[int], rows_of) -> tuple:
    """Route every rank's pairs and send their rows to their experts' ranks (``rows_of(r,
    order)``: rank r's tensors of one row per pair, pairs in expert order): (routes, per-expert
    counts received, rows received per source, received tensors per rank)."""
    n = ex.n
    route = {r: _route(ranks[r][0], starts) for r in ranks}
    blocks = [_count(starts, d) for d in range(n)]
    hist = ex({r: list(route[r][1].split(blocks)) for r in ranks},
              {r: [_count(starts, r)] * n for r in ranks})  # fmt: skip
    recv = {r: [int(h.sum()) for h in hist[r]] for r in ranks}
    send = {r: rows_of(r, route[r][0]) for r in ranks}
    got = []
    for j in range(len(next(iter(send.values())))):
        part = ex({r: list(send[r][j].split(route[r][2].tolist())) for r in ranks}, recv)
        got.append({r: torch.cat(part[r]) for r in ranks})
    return route, hist, recv, got


def _sent_back(ex: _Exchange, route: dict, recv: dict, values: dict) -> dict:
    """Per-row results of the received rows back to where the rows came from, in each source's
    expert order."""
    sizes = {r: route[r][2].tolist() for r in route}
    back = ex({r: list(values[r].split(recv[r])) for r in values}, sizes)
    return {r: torch.cat(back[r]) for r in back}


def _dispatch(ranks: dict, ex: _Exchange, key: str, starts: list[int]) -> dict:
    """Token dispatch forward for the ranks of ``ranks`` ({group rank: (idx, x, w, params)})."""
    n = ex.n

    def rows_of(r, order):
        idx, x = ranks[r][:2]
        return [x[order // idx.shape[1]]]

    route, hist, recv, (rows,) = _dispatched(ranks, ex, starts, rows_of)
    y = {}
    for r, (_idx, _x, w, params) in ranks.items():
        ids = _received_ids(torch.stack(hist[r]), n, _count(starts, r))
        y[r] = _rows(key, params, rows[r], ids, w.dtype, _count(starts, r))
    back = _sent_back(ex, route, recv, y)
    return {r: _combine(x, idx, w, route[r][0], back[r]) for r, (idx, x, w, _) in ranks.items()}


def _pair_grads(key, params, rows, ids, g, wp, count):
    """The gradients of received pairs' contributions ``wp * expert(rows)`` whose output gradient
    is ``g``: (rows' gradient, weights' gradient, parameters' gradients)."""
    if rows.shape[0] == 0:
        zeros = [torch.zeros_like(p) for p in params]
        return rows.new_zeros(rows.shape), wp.new_zeros(wp.shape), zeros

    def f(rows, *ps):
        return _rows(key, ps, rows, ids, wp.dtype, count)

    y, (d_rows, *d_params) = autograd_vjp(f, [rows, *params], (g * wp.unsqueeze(-1)).to(rows.dtype))
    d_wp = (g.to(y.dtype) * y).sum(-1).to(wp.dtype)
    return d_rows, d_wp, d_params


def _dispatch_backward(ranks: dict, ex: _Exchange, key: str, starts: list[int]) -> dict:
    """Token dispatch backward ({group rank: (idx, x, w, params, g)}): the rows and their output
    gradients sent again, the experts' gradients computed where the experts are, the rows' and
    routing weights' gradients sent back."""
    n = ex.n

    def rows_of(r, order):
        idx, x, w, _, g = ranks[r]
        tok = order // idx.shape[1]
        return [torch.cat([x[tok], g[tok].to(x.dtype)], 1), w.reshape(-1)[order]]

    route, hist, recv, (rows, wps) = _dispatched(ranks, ex, starts, rows_of)
    d_rows, d_wps, out = {}, {}, {}
    for r, (_, x, _, params, _) in ranks.items():
        h, count = x.shape[1], _count(starts, r)
        ids = _received_ids(torch.stack(hist[r]), n, count)
        xr, gr = rows[r][:, :h], rows[r][:, h:]
        d_rows[r], d_wps[r], out[r] = _pair_grads(key, params, xr, ids, gr, wps[r], count)
    back_x = _sent_back(ex, route, recv, d_rows)
    back_w = _sent_back(ex, route, recv, d_wps)
    result = {}
    for r, (idx, x, w, _, _) in ranks.items():
        order = route[r][0]
        result[r] = [*_scattered_grads(x, idx, w, order, back_x[r], back_w[r]), *out[r]]
    return result


def _real(group_name: str) -> tuple[int, _Exchange]:
    pg = process_group(group_name)
    return dist.get_rank(pg), _Exchange(dist.get_world_size(pg), pg)


@torch.library.custom_op("fxshard::moe_experts_dispatch", mutates_args=())
def moe_experts_dispatch(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    params: list[torch.Tensor],
    key: str,
    starts: list[int],
    group_name: str,
) -> torch.Tensor:
    """This rank's tokens through experts held by the ranks of ``group_name`` (rank ``r`` holds
    experts ``starts[r] .. starts[r + 1] - 1``; ``params``: this rank's block): counts, rows and
    results exchanged by all-to-all."""
    r, ex = _real(group_name)
    return _dispatch({r: (idx, x, w, params)}, ex, key, starts)[r]


@moe_experts_dispatch.register_fake
def _moe_experts_dispatch_fake(x, idx, w, params, key, starts, group_name):
    return torch.empty_like(x)


@torch.library.custom_op("fxshard::moe_experts_dispatch_backward", mutates_args=())
def moe_experts_dispatch_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    params: list[torch.Tensor],
    key: str,
    starts: list[int],
    group_name: str,
) -> list[torch.Tensor]:
    """``moe_experts_dispatch``'s gradients: [rows', routing weights', this rank's experts']."""
    r, ex = _real(group_name)
    return _dispatch_backward({r: (idx, x, w, params, g)}, ex, key, starts)[r]


@moe_experts_dispatch_backward.register_fake
def _moe_experts_dispatch_backward_fake(g, x, idx, w, params, key, starts, group_name):
    return _grads_like(x, w, params)


def _simulated(fn, n_tensors: int):
    """A dispatch op on every simulated rank at once, the exchange in memory: ``fn(ranks, ex,
    key, starts)`` over each group of the mesh dim."""

    def run(mode, func, types, args, kwargs):
        tensors, (params, key, starts, group_name) = args[:n_tensors], args[n_tensors:]
        world = len(mode.ranks)
        vals = [local_tensor_values(t, world) for t in tensors]
        ps = [local_tensor_values(p, world) for p in params]
        out = {}
        with mode.disable():
            for group in simulated_groups(group_name):
                ranks = {}
                for i, g in enumerate(group):
                    v = [t[g] for t in vals]
                    if n_tensors == 4:  # backward: (g, x, idx, w)
                        ranks[i] = (v[2], v[1], v[3], [p[g] for p in ps], v[0])
                    else:  # (x, idx, w)
                        ranks[i] = (v[1], v[0], v[2], [p[g] for p in ps])
                res = fn(ranks, _Exchange(len(group)), key, starts)
                out.update((g, res[i]) for i, g in enumerate(group))
        first = out[next(iter(out))]
        if isinstance(first, list):
            return [make_local_tensor({g: out[g][j] for g in out}) for j in range(len(first))]
        return make_local_tensor(out)

    return run


def _simulated_per_rank(mode, func, types, args, kwargs):
    """A region op that needs no other rank's values, once per simulated rank with the mode off
    (its body's transforms, e.g. the backward's vjp, see plain tensors)."""
    world = len(mode.ranks)
    flat, spec = tree_flatten((args, kwargs or {}))
    per = [local_tensor_values(a, world) if isinstance(a, torch.Tensor) else None for a in flat]
    out = {}
    with mode.disable():
        for r in sorted(mode.ranks):
            a, kw = tree_unflatten([v[r] if v is not None else f for v, f in zip(per, flat)], spec)
            out[r] = func(*a, **kw)
    first = out[next(iter(out))]
    if isinstance(first, (list, tuple)):
        return [make_local_tensor({r: out[r][j] for r in out}) for j in range(len(first))]
    return make_local_tensor(out)


for _name in ("moe_experts", "moe_experts_backward", "moe_experts_local",
              "moe_experts_local_backward"):  # fmt: skip
    torch.library.register_torch_dispatch(
        f"fxshard::{_name}", local_tensor_mode_class(), _simulated_per_rank
    )
torch.library.register_torch_dispatch(
    "fxshard::moe_experts_dispatch", local_tensor_mode_class(), _simulated(_dispatch, 3)
)
torch.library.register_torch_dispatch(
    "fxshard::moe_experts_dispatch_backward",
    local_tensor_mode_class(),
    _simulated(_dispatch_backward, 4),
)

MOE_EXPERTS = torch.ops.fxshard.moe_experts.default
MOE_EXPERTS_LOCAL = torch.ops.fxshard.moe_experts_local.default
MOE_EXPERTS_DISPATCH = torch.ops.fxshard.moe_experts_dispatch.default
MOE_EXPERTS_BACKWARD = torch.ops.fxshard.moe_experts_backward.default
MOE_EXPERTS_LOCAL_BACKWARD = torch.ops.fxshard.moe_experts_local_backward.default
MOE_EXPERTS_DISPATCH_BACKWARD = torch.ops.fxshard.moe_experts_dispatch_backward.default
# each region op, its variants: (replicated or rows, this rank's experts, token dispatch)
VARIANTS = {
    MOE_EXPERTS: (MOE_EXPERTS, MOE_EXPERTS_LOCAL, MOE_EXPERTS_DISPATCH),
    MOE_EXPERTS_BACKWARD: (
        MOE_EXPERTS_BACKWARD,
        MOE_EXPERTS_LOCAL_BACKWARD,
        MOE_EXPERTS_DISPATCH_BACKWARD,
    ),
}


# ---- the rule ------------------------------------------------------------------------------------


def experts_candidates(op, args, device_mesh) -> list:
    """Per mesh dim (see the module's doc): all replicated; tokens split by rows; experts split
    (Partial); both split (dispatch, rows out).  Experts split on one mesh dim at most.  The
    backward op (inputs: the output's gradient and the forward's) gives the tokens' and weights'
    gradients as the forward's output, the experts' as the experts (rows split: Partial)."""
    backward = op is MOE_EXPERTS_BACKWARD
    n_tok = 4 if backward else 3
    n_params = len(args[n_tok])
    r, s0, p = Replicate(), Shard(0), Partial("sum")
    base = [(r, r, r, r), (s0, r, s0, p), (r, s0, p, s0), (s0, s0, s0, s0)]
    out = []
    for combo in itertools.product(base, repeat=device_mesh.ndim):
        if sum(c[1] == s0 for c in combo) > 1:
            continue
        tok, par = tuple(c[0] for c in combo), tuple(c[1] for c in combo)
        tok_out, par_out = tuple(c[2] for c in combo), tuple(c[3] for c in combo)
        ins = (tok,) * n_tok + (par,) * n_params
        outs = (tok_out, tok_out) + (par_out,) * n_params if backward else (tok_out,)
        out.append((ins, outs))
    return out


def dispatch_steps(backward: bool, x, idx, w, num_experts: int) -> list[tuple[str, int]]:
    """The all-to-alls of token dispatch, (what, a rank's input bytes) each, for a rank's tokens
    ``x`` [T, H], expert ids ``idx`` [T, k] and weights ``w`` (values or fakes): the per-expert
    counts, then every routed row (how many leave the rank is data dependent)."""
    pairs = int(idx.shape[0] * idx.shape[1])
    rows = pairs * int(x.shape[1]) * x.element_size()
    weights = pairs * w.element_size()
    counts = ("counts per expert", num_experts * 8)
    if not backward:
        return [counts, ("rows to experts", rows), ("results back", rows)]
    return [counts, ("rows and gradients to experts", 2 * rows), ("weights to experts", weights),
            ("rows' gradients back", rows), ("weights' gradients back", weights)]  # fmt: skip


def expert_blocks(e: int, n: int) -> list[int]:
    """Block starts of ``e`` experts over ``n`` ranks (torch.chunk's layout), and ``e``."""
    size = -(-e // n)
    return [min(i * size, e) for i in range(n)] + [e]


_PROBE_BYTES = 256 << 20  # random parameters for a probe of a module whose values are not here


def contract_violation(key: str, x, idx, w, mesh_shape, rows: int = 16, params=None) -> str | None:
    """Why module ``key`` breaks the contract the region's candidates rest on (None: it holds on
    a probe of ``rows`` random tokens): its call is its class's forward (no hooks); its output is
    shaped and typed as its tokens; it is the same computed on two halves of the tokens (rows are
    independent); it is the sum of its pairs computed block by block, as each mesh dim would split
    the experts, top 1 and weight 1; and so are its gradients (tokens', routing weights' and
    experts': the backward ops compute them pair by pair)."""
    reg = _REGIONS[key]
    why = _foreign_hooks(reg.module)
    if why:
        return why
    if params is None:
        params = [getattr(reg.module, n).detach() for n in reg.names]
    g = torch.Generator(device="cpu").manual_seed(0)
    if any(p.is_meta or is_fake(p) for p in params):
        # no values here (a meta-built model): the contract is of the module's code, not of its
        # values, so random ones of the same shapes serve, where they are small enough
        size = sum(p.numel() * p.element_size() for p in params)
        if size > _PROBE_BYTES:
            return f"its parameters have no values here and {size >> 20} MiB are too many to probe"
        params = [torch.randn(p.shape, generator=g).to(p.dtype) * 0.2 for p in params]
    dev = params[0].device
    e, k = reg.num_experts, idx.shape[1]
    px = torch.randn(rows, x.shape[1], generator=g).to(dev, x.dtype)
    pidx = torch.randint(0, e, (rows, k), generator=g).to(dev, idx.dtype)
    pw = torch.rand(rows, k, generator=g).to(dev, w.dtype)
    try:
        return _probe(key, params, px, pidx, pw, mesh_shape, g)
    except Exception as exc:  # noqa: BLE001  (a module that cannot run on a probe keeps its body)
        return f"probe failed: {type(exc).__name__}: {exc}"


def _probe(key, params, px, pidx, pw, mesh_shape, g) -> str | None:
    reg = _REGIONS[key]
    tol = dict(rtol=1e-4, atol=1e-4) if px.dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)

    def differ(a, b, what):
        if not torch.allclose(a, b, **tol):
            return f"{what} (max error {(a - b).abs().max().item():.3g})"
        return None

    with torch.no_grad():
        want = _call(key, params, px, pidx, pw)
        if want.shape != px.shape or want.dtype != px.dtype:
            return f"its output is {want.dtype} {tuple(want.shape)} for {px.dtype} tokens"
        h = px.shape[0] // 2
        halves = torch.cat([_call(key, params, px[:h], pidx[:h], pw[:h]),
                            _call(key, params, px[h:], pidx[h:], pw[h:])])  # fmt: skip
    why = differ(halves, want, "its tokens are not independent of each other")
    g_out = torch.randn(want.shape, generator=g).to(want.device, want.dtype)
    grads = moe_experts_backward(g_out, px, pidx, pw, params, key)
    for n in sorted({int(s) for s in mesh_shape if s > 1}):
        got = torch.zeros_like(want)
        got_grads = [torch.zeros_like(grads[0]), torch.zeros_like(grads[1])]
        blocks = [[] for _ in params]
        for a, b in itertools.pairwise(expert_blocks(reg.num_experts, n)):
            if b == a:
                continue
            block, first = [p[a:b] for p in params], torch.tensor(a)
            got += moe_experts_local(px, pidx, pw, block, key, first)
            dx, dw, *dps = moe_experts_local_backward(g_out, px, pidx, pw, block, key, first)
            got_grads[0] += dx
            got_grads[1] += dw
            for i, dp in enumerate(dps):
                blocks[i].append(dp)
        got_grads += [torch.cat(b) for b in blocks]
        why = why or differ(got, want, f"its pairs by blocks of {n} ranks' experts differ")
        for what, a, b in zip(["tokens'", "routing weights'", *reg.names], got_grads, grads):
            why = why or differ(a, b, f"its {what} gradient by blocks of {n} ranks differs")
    return why
