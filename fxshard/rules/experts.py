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

Under simulated ranks (``LocalTensorMode``) the dispatch op runs every rank's part in one process
with the exchange done in memory, the same steps and arithmetic.  Forward captures only: a training
capture keeps the traced body (expert-sharded grouped matmuls, the Partial sum).
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
    local_tensor_mode_class,
    local_tensor_values,
    make_local_tensor,
    process_group,
    simulated_groups,
)


@dataclasses.dataclass
class Region:
    """A registered experts module: its parameters in the op's order, and its expert count."""

    ref: weakref.ref  # the module (not kept alive by the registry)
    fqn: str
    names: tuple[str, ...]
    num_experts: int
    count_attrs: tuple[str, ...]  # int attributes that hold the expert count
    views: dict = dataclasses.field(default_factory=dict)

    @property
    def module(self) -> nn.Module | None:
        return self.ref()

    def view(self, count: int) -> nn.Module:
        """The module as a rank holding ``count`` experts sees it (its parameters are passed in)."""
        module = self.module
        if module is None:
            raise RuntimeError(f"fxshard: the experts module {self.fqn} is gone")
        if count == self.num_experts:
            return module
        if count not in self.views:
            v = copy.copy(module)
            v.__dict__ = dict(module.__dict__)
            v._parameters = dict(module._parameters)
            for a in self.count_attrs:
                object.__setattr__(v, a, count)
            self.views[count] = v
        return self.views[count]


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
    attrs = tuple(
        a for a, v in vars(module).items() if type(v) is int and v == e and not a.startswith("_")
    )
    _REGIONS[key] = Region(weakref.ref(module), fqn, names, e, attrs)
    return key


def region(key: str) -> Region:
    return _REGIONS[key]


def _call(key: str, params, x, idx, w, count: int | None = None) -> torch.Tensor:
    reg = _REGIONS[key]
    mod = reg.view(reg.num_experts if count is None else count)
    return torch.func.functional_call(mod, dict(zip(reg.names, params)), (x, idx, w))


def _rows(key: str, params, rows, ids, dtype, count: int) -> torch.Tensor:
    """Each row routed to one (local) expert with weight one: [R, H]."""
    if rows.shape[0] == 0:
        return rows.new_zeros(rows.shape)
    ones = torch.ones(rows.shape[0], 1, dtype=dtype, device=rows.device)
    return _call(key, params, rows, ids[:, None], ones, count)


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
    f = int(first)
    flat = idx.reshape(-1)
    order = torch.nonzero((flat >= f) & (flat < f + count)).reshape(-1)
    k = idx.shape[1]
    y = _rows(key, params, x[order // k], flat[order] - f, w.dtype, count)
    return _combine(x, idx, w, order, y)


@moe_experts_local.register_fake
def _moe_experts_local_fake(x, idx, w, params, key, first):
    return torch.empty_like(x)


# ---- tokens split, experts split on one mesh dim: token dispatch ---------------------------------


def _route(idx: torch.Tensor, starts: list[int]):
    """(pairs sorted by expert, per-expert counts [E], per-rank counts [n]) of a rank's pairs."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=starts[-1])
    per_rank = torch.stack([per_expert[a:b].sum() for a, b in itertools.pairwise(starts)])
    return order, per_expert, per_rank


def _received_ids(recv_hist: torch.Tensor, n: int, count: int) -> torch.Tensor:
    """Local expert ids of the received rows (each source's rows come sorted by expert)."""
    ids = torch.arange(count, device=recv_hist.device).repeat(n)
    return torch.repeat_interleave(ids, recv_hist.reshape(-1))


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
    pg = process_group(group_name)
    r, n = dist.get_rank(pg), dist.get_world_size(pg)
    count = starts[r + 1] - starts[r]
    k, h = idx.shape[1], x.shape[1]
    order, per_expert, per_rank = _route(idx, starts)
    blocks = [b - a for a, b in itertools.pairwise(starts)]
    recv_hist = per_expert.new_empty(n * count)
    dist.all_to_all_single(recv_hist, per_expert, [count] * n, blocks, group=pg)
    send = per_rank.tolist()
    recv = recv_hist.reshape(n, count).sum(1).tolist()
    rows = x.new_empty(sum(recv), h)
    dist.all_to_all_single(rows, x[order // k].contiguous(), recv, send, group=pg)
    y = _rows(key, params, rows, _received_ids(recv_hist, n, count), w.dtype, count)
    back = y.new_empty(sum(send), h)
    dist.all_to_all_single(back, y.contiguous(), send, recv, group=pg)
    return _combine(x, idx, w, order, back)


@moe_experts_dispatch.register_fake
def _moe_experts_dispatch_fake(x, idx, w, params, key, starts, group_name):
    return torch.empty_like(x)


def _simulated_dispatch(mode, func, types, args, kwargs):
    """``moe_experts_dispatch`` on every simulated rank at once, the exchange done in memory."""
    x, idx, w, params, key, starts, group_name = args
    world = len(mode.ranks)
    xs, ids, ws = (local_tensor_values(t, world) for t in (x, idx, w))
    ps = [local_tensor_values(p, world) for p in params]
    out = {}
    with mode.disable():
        for group in simulated_groups(group_name):
            n = len(group)
            route = {g: _route(ids[g], starts) for g in group}
            k = idx.shape[1]
            sent = {}  # (source, dest) -> rows
            for g in group:
                order, _, per_rank = route[g]
                rows = xs[g][order // k]
                sent.update(zip(((g, d) for d in group), rows.split(per_rank.tolist())))
            back = {}
            for i, d in enumerate(group):
                count = starts[i + 1] - starts[i]
                hist = torch.stack([route[s][1][starts[i] : starts[i + 1]] for s in group])
                rows = torch.cat([sent[s, d] for s in group])
                y = _rows(key, [p[d] for p in ps], rows, _received_ids(hist, n, count),
                          ws[d].dtype, count)  # fmt: skip
                back.update(zip(((s, d) for s in group), y.split(hist.sum(1).tolist())))
            for g in group:
                y = torch.cat([back[g, d] for d in group])
                out[g] = _combine(xs[g], ids[g], ws[g], route[g][0], y)
    return make_local_tensor(out)


torch.library.register_torch_dispatch(
    "fxshard::moe_experts_dispatch", local_tensor_mode_class(), _simulated_dispatch
)

MOE_EXPERTS = torch.ops.fxshard.moe_experts.default
MOE_EXPERTS_LOCAL = torch.ops.fxshard.moe_experts_local.default
MOE_EXPERTS_DISPATCH = torch.ops.fxshard.moe_experts_dispatch.default


# ---- the rule ------------------------------------------------------------------------------------


def experts_candidates(args, device_mesh) -> list:
    """Per mesh dim (see the module's doc): all replicated; tokens split by rows; experts split
    (Partial); both split (dispatch, rows out).  Experts split on one mesh dim at most."""
    n_params = len(args[3])
    r, s0, p = Replicate(), Shard(0), Partial("sum")
    base = [((r,) * 3, (r,) * n_params, r), ((s0,) * 3, (r,) * n_params, s0),
            ((r,) * 3, (s0,) * n_params, p), ((s0,) * 3, (s0,) * n_params, s0)]  # fmt: skip
    out = []
    for combo in itertools.product(base, repeat=device_mesh.ndim):
        if sum(c[1][0] == s0 for c in combo) > 1:
            continue
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(3)) + tuple(
            tuple(c[1][i] for c in combo) for i in range(n_params)
        )
        out.append((ins, (tuple(c[2] for c in combo),)))
    return out


def dispatch_pairs_bytes(x: torch.Tensor, idx: torch.Tensor) -> float:
    """Bytes of a rank's routed rows (each of its tokens' k choices), what each of the dispatch's
    two row exchanges sends (less what stays on the rank)."""
    return float(idx.shape[0] * idx.shape[1] * x.shape[1] * x.element_size())


__all__ = [
    "MOE_EXPERTS",
    "MOE_EXPERTS_DISPATCH",
    "MOE_EXPERTS_LOCAL",
    "dispatch_pairs_bytes",
    "expert_blocks",
    "experts_candidates",
    "experts_module",
    "region",
    "register",
]


def expert_blocks(e: int, n: int) -> list[int]:
    """Block starts of ``e`` experts over ``n`` ranks (torch.chunk's layout), and ``e``."""
    size = -(-e // n)
    return [min(i * size, e) for i in range(n)] + [e]


def contract_violation(key: str, x, idx, w, mesh_shape, rows: int = 16) -> str | None:
    """Why module ``key`` breaks the per-pair contract the region's candidates rest on (None: it
    holds on a probe): the module on ``rows`` random tokens equals the sum of its pairs computed
    one by one, by each block of experts a mesh dim would give a rank, top-1 and weight one."""
    reg = _REGIONS[key]
    params = [getattr(reg.module, n).detach() for n in reg.names]
    dev = params[0].device
    if dev.type == "meta" or any(p.is_meta for p in params):
        return "its parameters are on the meta device (no probe)"
    g = torch.Generator(device="cpu").manual_seed(0)
    e, k = reg.num_experts, idx.shape[1]
    px = torch.randn(rows, x.shape[1], generator=g).to(dev, x.dtype)
    pidx = torch.randint(0, e, (rows, k), generator=g).to(dev, idx.dtype)
    pw = torch.rand(rows, k, generator=g).to(dev, w.dtype)
    try:
        with torch.no_grad():
            want = _call(key, params, px, pidx, pw).to(px.dtype)
            for n in sorted({int(s) for s in mesh_shape if s > 1}):
                starts = expert_blocks(e, n)
                got = torch.zeros_like(want)
                for a, b in itertools.pairwise(starts):
                    if b > a:
                        block = [p[a:b] for p in params]
                        got += moe_experts_local(px, pidx, pw, block, key, torch.tensor(a))
                tol = 1e-4 if px.dtype == torch.float32 else 2e-2
                if not torch.allclose(got, want, rtol=tol, atol=tol):
                    err = (got - want).abs().max().item()
                    return (
                        f"its pairs computed by blocks of {n} experts' ranks do not add up to "
                        f"its output (max error {err:.3g})"
                    )
    except Exception as exc:  # noqa: BLE001  (a module that cannot run on a probe keeps its body)
        return f"probe failed: {type(exc).__name__}: {exc}"
    return None
