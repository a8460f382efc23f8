"""Functions run on every rank of the multi-process (gloo) tests; module-level so spawn can import
them."""

from __future__ import annotations

import torch
import torch.nn as nn

import fxshard
from fxshard import zoo

MODELS = {
    "mlp": (lambda: zoo.MLP(), zoo.mlp_plan),
    "llama": (lambda: zoo.Llama(zoo.LlamaConfig()), zoo.megatron_tp_plan),
    "llama_sp": (lambda: zoo.Llama(zoo.LlamaConfig()), zoo.sequence_parallel_plan),
    "graph_break": (lambda: zoo.GraphBreakLlama(zoo.LlamaConfig()), zoo.megatron_tp_plan),
}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def compile_zoo(rank, world, cases):
    """For each (model, mesh shape, mesh names, path): the max relative error against single device
    (inference: under autograd the backend shards the joint graph, see backend_train)."""
    with torch.no_grad():
        return _compile_zoo(cases)


def _compile_zoo(cases):
    from torch.distributed.device_mesh import init_device_mesh

    out = []
    for name, shape, names, path in cases:
        make, plan = MODELS[name]
        model = zoo.init_weights(make(), seed=0)
        x = zoo.example_input(model, generator=torch.Generator().manual_seed(1))
        ref = model(*x).detach()
        dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if path == "program":
            prog = fxshard.shard(model, dm, plan(), example_inputs=x)
            fn = prog.compile()
            got = fn(*x)
            # this rank's shard of the result
            want = fn.output_specs[0].local_of(ref, fn.coord_ints)
        else:
            torch._dynamo.reset()
            f = torch.compile(
                model,
                backend="fxshard",
                options={"mesh": dm, "plan": plan(), "inductor": path != "backend_eager"},
            )
            got, want = f(*x), ref
            got2 = f(*x)  # cached parameter shards, same answer
            assert torch.equal(got, got2)
            if path == "backend_updates":
                out.append((name, shape, path, _rel(got.detach(), want)))
                # an optimizer-style in-place update, then a replaced parameter
                with torch.no_grad():
                    model.fc1.weight.mul_(0.5)
                out.append(
                    (name, shape, "in-place update", _rel(f(*x).detach(), model(*x).detach()))
                )
                g = torch.Generator().manual_seed(2)  # the same new weight on every rank
                model.fc2.weight = nn.Parameter(torch.randn(model.fc2.weight.shape, generator=g))
                got, want = f(*x), model(*x).detach()
        out.append((name, shape, path, _rel(got.detach(), want)))
    return out


def parallelize_meta(rank, world, tp):
    """A meta-built Llama, parallelized and loaded shard by shard: bytes held, peak memory,
    results."""
    import tracemalloc

    from torch.distributed.device_mesh import init_device_mesh

    cfg = zoo.LlamaConfig()
    ref_model = zoo.init_weights(zoo.Llama(cfg), seed=0)
    full_sd = {
        **ref_model.state_dict(),
        "rope_cos": ref_model.rope_cos,
        "rope_sin": ref_model.rope_sin,
    }
    x = zoo.example_input(ref_model, generator=torch.Generator().manual_seed(1))
    ref = ref_model(*x).detach()
    dm = init_device_mesh(
        "cpu", (world,) if tp else (2, world // 2), mesh_dim_names=("tp",) if tp else ("dp", "tp")
    )
    with torch.device("meta"):
        model = zoo.Llama(cfg)
    tracemalloc.start()
    pm = fxshard.parallelize(model, dm, zoo.megatron_tp_plan())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = pm.local_bytes()
    with pytest_raises(RuntimeError, "load_full_state_dict"):
        pm(*x)
    pm.load_full_state_dict(full_sd)
    out = pm(*x)
    want = pm.output_specs[0].local_of(ref, pm.coord)
    back = pm.full_state_dict()
    same = all(torch.equal(back[k], v) for k, v in ref_model.state_dict().items())
    total = sum(t.numel() * t.element_size() for t in full_sd.values())
    return dict(
        rel=_rel(out.detach(), want),
        held=held,
        peak=peak,
        total=total,
        roundtrip=same,
        n_params=sum(p.to_local().numel() for p in pm.parameters()),
    )


class pytest_raises:  # pytest is not imported in the workers
    def __init__(self, exc, text):
        self.exc, self.text = exc, text

    def __enter__(self):
        return self

    def __exit__(self, typ, val, tb):
        if typ is None or not issubclass(typ, self.exc) or self.text not in str(val):
            raise AssertionError(
                f"expected {self.exc.__name__} mentioning {self.text!r}, got {typ}: {val}"
            )
        return True


def train_parallel(rank, world, shape, names, plan_name, inductor, steps=3, optimizer="adamw"):
    """AdamW on local shards (fxshard.parallelize) vs single-device AdamW: max relative weight error
    after ``steps`` steps, and the losses of both."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    make, plan = MODELS[plan_name]
    ref = zoo.init_weights(make(), seed=0)
    model = copy.deepcopy(ref)
    x = zoo.example_input(ref, generator=torch.Generator().manual_seed(1))
    dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
    pm = fxshard.parallelize(model, dm, plan(), inductor=inductor)
    make_opt = (
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        if optimizer == "adamw"
        else (lambda ps: torch.optim.SGD(ps, lr=0.5))
    )
    opt_ref, opt = make_opt(ref.parameters()), make_opt(pm.parameters())
    losses = []
    for _ in range(steps):
        for m, o in ((ref, opt_ref), (pm, opt)):
            o.zero_grad()
            loss = m(*x).float().pow(2).mean()
            loss.backward()
            o.step()
            losses.append(float(loss.detach()))
    got = pm.full_state_dict()
    errs = {k: _rel(got[k], v.detach()) for k, v in ref.state_dict().items()}
    return dict(rel=max(errs.values()), worst=max(errs, key=errs.get), losses=losses)


def backend_train(rank, world, shape, names, inductor, steps=2):
    """torch.compile(backend="fxshard") under loss.backward() with SGD on the ordinary (global)
    module vs single device: max relative error of the weights after ``steps`` steps."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    ref = zoo.init_weights(zoo.Llama(zoo.LlamaConfig()), seed=0)
    model = copy.deepcopy(ref)
    x = zoo.example_input(ref, generator=torch.Generator().manual_seed(1))
    dm = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch._dynamo.reset()
    f = torch.compile(
        model,
        backend="fxshard",
        options={"mesh": dm, "plan": zoo.megatron_tp_plan(), "inductor": inductor},
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for _ in range(steps):
        for fn, opt in zip((ref, f), opts):
            opt.zero_grad()
            fn(*x).float().pow(2).mean().backward()
            opt.step()
    return max(_rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters()))


# ---- ranks that disagree (tests/test_agree.py) ---------------------------------------------------
class DropMLP(nn.Module):
    """fc1 -> relu -> dropout -> fc2: a program that draws random numbers."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class CountingDropMLP(DropMLP):
    """DropMLP that also counts what it saw in a buffer (updated in place in forward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        self.seen.add_(x.sum(0))
        return super().forward(x)


def _outcome(fn):
    """("ok", value) or (exception type name, message)."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test looks at what each rank saw
        return (type(e).__name__, str(e))


def _drop_mlp(seed):
    torch.manual_seed(seed)
    return DropMLP()


def _agreement_setup(world):
    """The tp mesh, the MLP plan, agreement options and the input of the agreement workers."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    return dm, zoo.mlp_plan(), fxshard.AgreementOptions(timeout_s=30), x


def ranks_disagree(rank, world):
    """Differences between the ranks the runtime must notice: every rank's outcome per case."""
    dm, plan, opts, x = _agreement_setup(world)
    out = {}
    with torch.no_grad():
        # another batch on rank 1: every rank raises before the program's collectives
        ref = _drop_mlp(0).eval()
        fn = fxshard.shard(ref, dm, plan, example_inputs=(x,)).compile(agreement=opts)
        mine = x + rank
        out["inputs"] = _outcome(lambda: fn(mine))
        # another seed per rank: rank 0's weights are sharded, and the model now holds them
        model = _drop_mlp(rank).eval()
        fn = fxshard.shard(model, dm, plan, example_inputs=(x,)).compile(agreement=opts)
        got = fn(x)
        out["weights"] = (_rel(got, ref(x)), _rel(model.fc1.weight, ref.fc1.weight))
        # dropout with generators seeded apart: an error; seeded alike: eager's masks
        model = _drop_mlp(0).train()
        fn = fxshard.shard(model, dm, plan, example_inputs=(x,)).compile(agreement=opts)
        torch.manual_seed(100 + rank)
        out["random"] = _outcome(lambda: fn(x))
        torch.manual_seed(7)
        got = fn(x)
        torch.manual_seed(7)
        out["random_alike"] = _rel(got, model(x))
        # the backend: weights taken from rank 0, then one rank recompiles for another shape
        torch._dynamo.reset()
        model = _drop_mlp(rank).eval()
        f = torch.compile(
            model, backend="fxshard", options={"mesh": dm, "plan": plan, "agreement": opts}
        )
        out["backend_weights"] = _rel(f(x), ref(x))
        shape = (4, 16) if rank == 0 else (6, 16)
        out["backend_recompile"] = _outcome(lambda: f(torch.ones(shape)))
        # the backend on real ranks (Inductor): dropout as eager draws it for the same seed, and
        # a buffer updated in forward written back
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = CountingDropMLP().train()
        f = torch.compile(model, backend="fxshard", options={"mesh": dm, "plan": plan})
        torch.manual_seed(11)
        got = f(x)
        torch.manual_seed(11)
        want = model(x)
        out["backend_random"] = _rel(got, want)
        out["backend_update"] = _rel(model.seen, x.sum(0) * 2)  # once compiled, once eager
    return out


def uneven_ranks_disagree(rank, world):
    """The agreement check on an uneven program (33 hidden features over 2 ranks: 17 and 16; each
    rank runs its own per-rank graph): another input on rank 1 raises on every rank; other weights
    per rank run on rank 0's."""
    dm, plan, opts, x = _agreement_setup(world)
    out = {}
    with torch.no_grad():
        torch.manual_seed(0)
        ref = DropMLP(hidden=33).eval()
        prog = fxshard.shard(ref, dm, plan, example_inputs=(x,))
        out["uneven"] = prog.uneven
        fn = prog.compile(agreement=opts)
        out["inputs"] = _outcome(lambda: fn(x + rank))
        torch.manual_seed(rank)
        model = DropMLP(hidden=33).eval()
        fn = fxshard.shard(model, dm, plan, example_inputs=(x,)).compile(agreement=opts)
        out["weights"] = _rel(fn(x), ref(x))
    return out


def rank_fails_alone(rank, world, case):
    """One rank fails (or never comes) while the other runs the program's collectives: both must
    raise, well within the process group's timeout.  (outcome, seconds) per rank."""
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = zoo.mlp_plan()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    calls = 2 if case == "absent" else 0
    opts = fxshard.AgreementOptions(check_calls=calls, timeout_s=5, collective_timeout_s=5)
    with torch.no_grad():
        fn = fxshard.shard(_drop_mlp(0).eval(), dm, plan, example_inputs=(x,)).compile(
            agreement=opts
        )
        start = time.monotonic()
        if rank == 1 and case == "bad_input":
            outcome = _outcome(lambda: fn(torch.ones(5, 16)))  # fails the signature check
        elif rank == 1 and case == "absent":
            outcome = _outcome(lambda: dist.all_reduce(torch.ones(3)))  # another collective
        elif rank == 1 and case == "hung":
            time.sleep(20)  # alive, never comes, never fails
            outcome = ("hung", "")
        else:
            outcome = _outcome(lambda: fn(x))
    return outcome[0], outcome[1][:300], time.monotonic() - start


def one_rank_dies(rank, world):
    """Rank 1 exits at once, as a crash in native code would (no report); rank 0 raises."""
    import os

    if rank == 1:
        os._exit(3)
    raise ValueError("rank 0's own error")


# ---- DTensor at program boundaries (tests/test_dtensor.py) ---------------------------------------
def _kinds(progs) -> list[list[str]]:
    return [[c.kind for c in p.collectives()] for p in progs]


def _compiled_since(n0):
    from fxshard.backend import compiled_programs

    return compiled_programs(n0)


def dtensor_backend(rank, world):
    """torch.compile(backend="fxshard") on DTensor arguments and with DTensor outputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import RowwiseParallel

    from fxshard.backend import programs_built

    torch.manual_seed(0)
    dm = init_device_mesh("cpu", (world,))
    out = {}
    x = torch.randn(8, 6)
    # elementwise on a Shard(0) DTensor: no collective, a Shard(0) DTensor back
    n0 = programs_built()
    f = torch.compile(
        lambda t: torch.relu(t) * 2 + 1,
        backend="fxshard",
        options={"mesh": dm, "plan": {}, "outputs": "dtensor"},
    )
    y = f(distribute_tensor(x, dm, [Shard(0)]))
    out["elementwise"] = dict(
        type=type(y).__name__,
        placements=y.placements,
        local_shape=tuple(y.to_local().shape),
        collectives=_kinds(_compiled_since(n0)),
        err=float((y.full_tensor() - (torch.relu(x) * 2 + 1)).abs().max()),
    )
    # an uneven DTensor (7 rows on the ranks): its uneven shards run as they are, no collective
    x7 = torch.randn(7, 6)
    n0 = programs_built()
    y = f(distribute_tensor(x7, dm, [Shard(0)]))
    out["uneven"] = dict(
        type=type(y).__name__,
        local_rows=tuple(y.to_local().shape),
        collectives=_kinds(_compiled_since(n0)),
        err=float((y.full_tensor() - (torch.relu(x7) * 2 + 1)).abs().max()),
    )
    # a DTensor sharded on its last dim into a rowwise layer: its shard is the layer's input shard
    torch._dynamo.reset()
    mlp = zoo.init_weights(zoo.MLP(dim=6, hidden=8), seed=1)
    h = torch.relu(mlp.fc1(x)).detach()
    n0 = programs_built()
    g = torch.compile(
        nn.Sequential(mlp.fc2),
        backend="fxshard",
        options={"mesh": dm, "plan": {"0": RowwiseParallel()}},
    )
    # the eager model mixes plain parameters with a DTensor: DTensor's implicit replication lets
    # dynamo trace it (fxshard then plans the graph on global values)
    with torch.no_grad(), implicit_replication():
        y = g(distribute_tensor(h, dm, [Shard(1)]))
    out["rowwise_input"] = dict(
        type=type(y).__name__,
        collectives=_kinds(_compiled_since(n0)),
        err=float((y - mlp.fc2(h)).detach().abs().max()),
    )
    # colwise | graph break | rowwise: the break hands a sharded DTensor to the next graph
    ref = zoo.init_weights(BreakMLP(), seed=2)
    want = ref(x).detach()
    results = {}
    for mode in ("global", "dtensor", "one graph", "dtensor arg"):
        torch._dynamo.reset()
        model = ref if mode != "one graph" else _no_break(ref)
        opts = {"mesh": dm, "plan": zoo.mlp_plan()}
        if mode in ("dtensor", "one graph"):
            opts["outputs"] = "dtensor"
        if mode == "dtensor arg":
            opts["plan"] = {}  # DTensor code: the placements are the argument's
        n0 = programs_built()
        cm = torch.compile(model, backend="fxshard", options=opts)
        if mode == "dtensor arg":
            # a batch-split DTensor in, as eager DTensor code calls it (no implicit_replication,
            # no option): the value crossing the break is a DTensor in the program's placement
            xd = distribute_tensor(x, dm, [Shard(0)])
            with torch.no_grad():
                y, y2 = cm(xd), cm(xd)
        else:
            with implicit_replication(), torch.no_grad():
                y = cm(x)
                y2 = cm(x)  # the second call reuses both programs
        y = y.full_tensor() if isinstance(y, DTensor) else y
        results[mode] = dict(
            collectives=_kinds(_compiled_since(n0)),
            err=float((y - want).abs().max()),
            again=_rel(y2.full_tensor() if isinstance(y2, DTensor) else y2, want),
        )
    out["graph_break"] = results
    # training: a DTensor input that requires grad gets a DTensor gradient placed like it
    torch._dynamo.reset()
    lin = zoo.init_weights(zoo.MLP(dim=6, hidden=8), seed=3)
    xr = x.clone().requires_grad_(True)
    lin(xr).pow(2).sum().backward()
    dx = distribute_tensor(x, dm, [Shard(0)]).requires_grad_(True)
    cl = torch.compile(
        zoo.init_weights(zoo.MLP(dim=6, hidden=8), seed=3),
        backend="fxshard",
        options={"mesh": dm, "plan": zoo.mlp_plan(), "outputs": "dtensor"},
    )
    with implicit_replication():
        loss = cl(dx)
        loss.pow(2).sum().backward()
    out["train"] = dict(
        grad_type=type(dx.grad).__name__,
        grad_placements=dx.grad.placements,
        err=float((dx.grad.full_tensor() - xr.grad).abs().max()),
    )
    _ = Replicate
    return out


class BreakMLP(nn.Module):
    """Colwise fc1, then a graph break, then rowwise fc2."""

    def __init__(self, dim: int = 6, hidden: int = 8, brk: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.brk = brk

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.brk:
            zoo._eager_step()
        return self.fc2(h)


def _no_break(m: BreakMLP) -> BreakMLP:
    import copy

    m = copy.deepcopy(m)
    m.brk = False
    return m


def decode_cache(rank, world, path):
    """Greedy decoding of zoo.CachedLlama through fxshard.parallelize(outputs="dtensor"), its KV
    cache handed back and in as DTensors between calls: logits per step vs single device, the
    cache's placements, and the decode program's collectives (kind, bytes)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    cfg = zoo.LlamaConfig(n_layers=2, max_seq_len=16)
    ref = zoo.init_weights(zoo.CachedLlama(cfg), seed=0)
    with torch.no_grad():
        for p in ref.parameters():  # larger weights: the greedy tokens vary from step to step
            p.mul_(3)
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    steps = 5
    logged = []

    def logging_step(step):
        def run(*a):
            outs = step(*a)
            lg = outs[0]
            logged.append(lg.full_tensor() if isinstance(lg, DTensor) else lg)
            return outs

        return run

    with torch.no_grad():
        want_tokens, _ = zoo.greedy_decode(logging_step(ref), ref, prompt, steps)
    want_logits, logged[:] = list(logged), []
    dm = init_device_mesh("cpu", (world,))
    out = {}
    pm = fxshard.parallelize(copy.deepcopy(ref), dm, zoo.megatron_tp_plan(), outputs="dtensor")
    with torch.no_grad():
        tokens, cache = zoo.greedy_decode(logging_step(pm), ref, prompt, steps)
    progs = [p for p, _ in pm._programs.values()]
    out["parallelize"] = dict(
        same_tokens=bool(torch.equal(tokens, want_tokens)),
        err=max(float((a - b).abs().max()) for a, b in zip(logged, want_logits)),
        cache=[(type(c).__name__, c.placements) for c in cache[:2]],
        programs=len(progs),
        decode=[(c.kind, c.bytes) for c in progs[-1].collectives()],
    )
    out["varied"] = len(set(want_tokens.flatten().tolist()))
    return out


def dtensor_state(rank, world, path):
    """fxshard.parallelize's DTensor parameters: state_dict, DCP save / load (same plan, another
    plan, torch's parallelize_module), an AdamW step with clip_grad_norm_ vs single device."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    cfg = zoo.LlamaConfig()
    ref = zoo.init_weights(zoo.Llama(cfg), seed=0)
    x = zoo.example_input(ref, generator=torch.Generator().manual_seed(1))
    want = ref(*x).detach()
    dm = init_device_mesh("cpu", (world,))
    out = {}
    pm = fxshard.parallelize(copy.deepcopy(ref), dm, zoo.megatron_tp_plan())
    sd = pm.state_dict()
    out["state_dict"] = dict(
        keys_match=sorted(sd) == sorted(ref.state_dict()),
        all_dtensors=all(isinstance(v, DTensor) for v in sd.values()),
        wq=sd["layers.0.attention.wq.weight"].placements,
        wo=sd["layers.0.attention.wo.weight"].placements,
    )
    with torch.no_grad():
        out["forward_err"] = _rel(pm(*x), want)
    dcp.save(pm.state_dict(), checkpoint_id=f"{path}/fxshard")
    # the same plan, another seed: loading brings the checkpoint's values back
    tp = zoo.megatron_tp_plan()
    other = fxshard.parallelize(zoo.init_weights(zoo.Llama(cfg), seed=7), dm, tp)
    sd = other.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/fxshard")
    other.load_state_dict(sd)
    with torch.no_grad():
        out["reload_err"] = _rel(other(*x), want)
    # resharded on load: a sequence-parallel plan (other placements) reads the TP checkpoint
    sp = fxshard.parallelize(
        zoo.init_weights(zoo.Llama(cfg), seed=8),
        dm,
        zoo.sequence_parallel_plan(),
        outputs="dtensor",  # its logits are vocab-sharded
    )
    sd = sp.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/fxshard")
    sp.load_state_dict(sd)
    with torch.no_grad():
        got = sp(*x)
    out["resharded_err"] = _rel(got.full_tensor() if isinstance(got, DTensor) else got, want)
    # torch's parallelize_module with the same plan: its checkpoint loads into fxshard and back
    tm = parallelize_module(zoo.init_weights(zoo.Llama(cfg), seed=0), dm, zoo.megatron_tp_plan())
    dcp.save(tm.state_dict(), checkpoint_id=f"{path}/torch")
    mine = fxshard.parallelize(zoo.init_weights(zoo.Llama(cfg), seed=9), dm, tp)
    sd = mine.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/torch")
    mine.load_state_dict(sd)
    theirs = parallelize_module(zoo.init_weights(zoo.Llama(cfg), seed=5), dm, tp)
    sd = theirs.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/fxshard")
    theirs.load_state_dict(sd)
    with torch.no_grad():
        out["from_torch_err"] = _rel(mine(*x), want)
        out["into_torch_err"] = _rel(theirs(*x), want)
    # AdamW (foreach) with clip_grad_norm_ on the DTensor parameters vs single device
    model = copy.deepcopy(ref)
    pm = fxshard.parallelize(copy.deepcopy(ref), dm, zoo.megatron_tp_plan())
    opt_ref = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, foreach=True)
    norms = []
    for m, o in ((model, opt_ref), (pm, opt)):
        for _ in range(2):
            o.zero_grad()
            m(*x).float().pow(2).mean().backward()
            n = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1)
            norms.append(float(n.full_tensor() if isinstance(n, DTensor) else n))
            o.step()
    got = pm.full_state_dict()
    errs = {k: _rel(got[k], v.detach()) for k, v in model.state_dict().items()}
    out["adamw"] = dict(
        rel=max(errs.values()),
        worst=max(errs, key=errs.get),
        norms=norms,
        grad_type=type(next(pm.parameters()).grad).__name__,
    )
    return out


# ---- uneven shards (tests/test_uneven.py) --------------------------------------------------------
def uneven_model(rank, world, path, steps=2):
    """zoo.uneven_config's Llama (vocabulary 1001, 6 heads, ffn 250) on ``world`` gloo ranks with
    the vocab-parallel plan, Inductor-compiled: this rank's output shard of a compiled forward
    program; SGD steps through torch.compile(backend="fxshard") under loss.backward(); and
    fxshard.parallelize's DTensor parameters against torch's own uneven layout, DCP checkpoints
    into and out of a torch parallelize_module model of the same plan."""
    import copy

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    ref = zoo.init_weights(zoo.Llama(zoo.uneven_config()), seed=0)
    tokens = torch.randint(0, 1001, (2, 8), generator=torch.Generator().manual_seed(1))
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    with torch.no_grad():
        want = ref(tokens)
        prog = fxshard.shard(ref, dm, zoo.vocab_parallel_plan(), example_inputs=(tokens,))
        fn = prog.compile()
        got = fn(tokens)
        spec = fn.output_specs[0]
        out["program"] = dict(
            uneven=prog.uneven,
            local=tuple(got.shape),
            err=_rel(got, spec.local_of(want, fn.coord_ints)),
        )
    model = copy.deepcopy(ref)
    torch._dynamo.reset()
    f = torch.compile(
        model, backend="fxshard", options={"mesh": dm, "plan": zoo.vocab_parallel_plan()}
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    losses = []
    for _ in range(steps):
        for call, opt in zip((ref, f), opts):
            opt.zero_grad()
            loss = call(tokens).float().pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    out["train"] = dict(
        losses=losses,
        rel=max(_rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())),
    )
    pm = fxshard.parallelize(copy.deepcopy(ref), dm, zoo.vocab_parallel_plan(), outputs="dtensor")
    emb = pm.state_dict()["tok_embeddings.weight"]
    torchs = distribute_tensor(ref.tok_embeddings.weight.detach(), dm, [Shard(0)])
    with torch.no_grad():
        y = pm(tokens)  # the logits' vocab shards as a DTensor (uneven: 251 x 3 + 248)
        out["parallelize"] = dict(
            local_rows=emb.to_local().shape[0],
            same_as_torch=bool(torch.equal(emb.to_local(), torchs.to_local())),
            logits=(tuple(y.to_local().shape), tuple(y.shape)),
            err=_rel(y.full_tensor(), ref(tokens)),
        )
    # DCP: torch's uneven shards load into fxshard and fxshard's into torch's
    plan = zoo.vocab_parallel_plan()
    theirs = parallelize_module(copy.deepcopy(ref), dm, plan)
    dcp.save(theirs.state_dict(), checkpoint_id=f"{path}/torch")
    dcp.save(pm.state_dict(), checkpoint_id=f"{path}/fxshard")
    mine = fxshard.parallelize(
        zoo.init_weights(zoo.Llama(zoo.uneven_config()), seed=7), dm, plan, outputs="dtensor"
    )
    sd = mine.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/torch")
    mine.load_state_dict(sd)
    back = parallelize_module(zoo.init_weights(zoo.Llama(zoo.uneven_config()), seed=8), dm, plan)
    sd = back.state_dict()
    dcp.load(sd, checkpoint_id=f"{path}/fxshard")
    back.load_state_dict(sd)
    full = {k: v.full_tensor() for k, v in back.state_dict().items() if hasattr(v, "full_tensor")}
    with torch.no_grad():
        out["dcp"] = dict(
            from_torch_err=_rel(mine(tokens).full_tensor(), ref(tokens)),
            into_torch_err=max(_rel(full[k], v) for k, v in ref.state_dict().items() if k in full),
            keys=len(full),
        )
    return out


class CacheLayer:
    """A user's own KV cache layer: tensors as attributes, updated in place; allocated eagerly
    (``k`` and ``v`` given), or by the first forward that finds none (``None``)."""

    def __init__(self, k=None, v=None):
        self.k, self.v = k, v


class CachedBlock(nn.Module):
    """One attention block over a static cache object (``layer.k`` / ``layer.v``)."""

    def __init__(self, dim=64, heads=4, length=8):
        super().__init__()
        self.heads, self.hd, self.length = heads, dim // heads, length
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, pos, layer):
        b, t, _ = x.shape

        def split(y):
            return y.view(b, t, self.heads, self.hd).transpose(1, 2)

        if layer.k is None:  # allocated inside the compiled code: kept sharded from the start
            layer.k = x.new_zeros(b, self.heads, self.length, self.hd)
            layer.v = x.new_zeros(b, self.heads, self.length, self.hd)
        layer.k.index_copy_(2, pos, split(self.k(x)))
        layer.v.index_copy_(2, pos, split(self.v(x)))
        att = torch.softmax(split(self.q(x)) @ layer.k.transpose(-1, -2) / self.hd**0.5, -1)
        return self.o((att @ layer.v).transpose(1, 2).reshape(b, t, -1))


def _cache_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel()}  # fmt: skip


def own_cache_state(rank, world):
    """A decode loop over a user's cache object (the default state="sharded"), its tensors made
    three ways: by the compiled code itself, eagerly through fxshard.kept, eagerly as plain
    tensors.  Per way: outputs vs single device, the steady decode program's collectives, what
    the cache holds between calls; then an eager read and an eager in-place write of a kept
    cache, and the log line for the plain one."""
    import copy
    import dataclasses
    import io
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    import fxshard
    from fxshard.backend import compiled_programs, programs_built

    torch.manual_seed(0)
    ref = CachedBlock()
    dm = init_device_mesh("cpu", (world,))
    xs = torch.randn(6, 2, 1, 64, generator=torch.Generator().manual_seed(1))

    def zeros():
        return torch.zeros(2, 4, 8, 16)

    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda rec: said.append(rec.getMessage())
    logger = logging.getLogger("fxshard")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    out = {}
    try:
        for way in ("inside", "kept", "plain"):
            torch._dynamo.reset()
            model = torch.compile(copy.deepcopy(ref), backend="fxshard",
                                  options={"mesh": dm, "plan": _cache_plan()})  # fmt: skip
            if way == "inside":
                mine = CacheLayer()
            elif way == "kept":
                mine = CacheLayer(fxshard.kept(zeros()), fxshard.kept(zeros()))
            else:
                mine = CacheLayer(zeros(), zeros())
            theirs = CacheLayer(zeros(), zeros())
            n0 = programs_built()
            err, held = 0.0, []
            with torch.no_grad():
                for i in range(4):
                    pos = torch.tensor([i])
                    err = max(err, _rel(model(xs[i], pos, mine), ref(xs[i], pos, theirs)))
                    k = mine.k
                    kept = isinstance(k, fxshard.KeptTensor)
                    held.append((type(k).__name__, str(k.spec) if kept else None,
                                 tuple(k.local.shape) if kept else None))  # fmt: skip
                progs = compiled_programs(n0)
                r = dict(err=err, held=held, programs=len(progs),
                         decode=[(c.kind, c.bytes) for c in progs[-1].collectives()])  # fmt: skip
                # an eager read is the global cache (gathered); an eager in-place write goes into
                # the shards; the next call goes on from both
                r["eager_k"] = _rel(mine.k * 1, theirs.k)
                mine.v.mul_(0.5)
                theirs.v.mul_(0.5)
                pos = torch.tensor([4])
                r["after"] = _rel(model(xs[4], pos, mine), ref(xs[4], pos, theirs))
                r["kept_after"] = type(mine.v).__name__
                if way == "inside":  # eager code on a kept cache, as a user's might run it
                    mine.k[:, 0] = 0.5  # a write through a view lands in the tensor
                    theirs.k[:, 0] = 0.5
                    pos = torch.tensor([5])
                    r["view_write"] = _rel(model(xs[5], pos, mine), ref(xs[5], pos, theirs))
                    r["viewed"] = (type(mine.k).__name__, mine.k.viewed, mine.v.sharded)
                    r["tolist"] = _rel(torch.tensor(mine.v.tolist()), theirs.v)
                    r["deepcopy"] = _rel(copy.deepcopy(mine.v) * 1, theirs.v)
                    buf = io.BytesIO()
                    torch.save(mine.v, buf)  # (every rank: it gathers)
                    buf.seek(0)
                    loaded = torch.load(buf)
                    r["saved"] = (type(loaded).__name__, _rel(loaded, theirs.v))
                    try:
                        mine.v.transpose_(0, 1)
                        r["transpose_"] = "no error"
                    except NotImplementedError as e:
                        r["transpose_"] = str(e)
            out[way] = r
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    out["hint"] = [m for m in said if "fxshard.kept" in m]
    # a dataclass the model returns (an object the call creates) holds its sharded tensors as
    # KeptTensors too (no gather unless read); under autograd plain global tensors
    torch._dynamo.reset()

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor

    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.Linear(64, 64)

        def forward(self, x):
            return Out(self.h(x))

    from torch.distributed.tensor.parallel import ColwiseParallel

    net = Returns()
    plan = {"h": ColwiseParallel()}
    f = torch.compile(net, backend="fxshard", options={"mesh": dm, "plan": plan})
    with torch.no_grad():
        o = f(xs[0])
        out["dataclass"] = (type(o.y).__name__, _rel(o.y, net(xs[0]).y))
    o = f(xs[0])
    o.y.pow(2).sum().backward()
    grad = net.h.weight.grad.clone()
    net.zero_grad()
    net(xs[0]).y.pow(2).sum().backward()
    out["dataclass_grad"] = (type(o.y).__name__, _rel(grad, net.h.weight.grad))
    return out


def hf_cache_state(rank, world):
    """transformers' Llama under its own tp_plan with the default state="sharded": generate() with
    its default DynamicCache and with a static cache, greedy (twice: no new program the second
    time) and sampled tokens vs single device, the programs built and the decode program's
    collectives (nothing on the cache); direct calls with a DynamicCache (its tensors held as
    heads' shards between calls, read eagerly: single device's cache); state="global" for
    comparison (the cache gathered every call)."""
    import copy

    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.backend import compiled_programs, programs_built

    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=4)  # fmt: skip
    ref = T.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():  # larger weights: the greedy tokens vary
            p.mul_(3)
    dm = init_device_mesh("cpu", (world,))
    x = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    out = {}
    for state in ("sharded", "global"):
        torch._dynamo.reset()
        model = copy.deepcopy(ref)
        model.compile(
            backend="fxshard", options={"mesh": dm, "plan": model.tp_plan, "state": state}
        )
        for cache in ("dynamic", "static") if state == "sharded" else ("dynamic",):
            kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=10)
            if cache == "static":
                kw["cache_implementation"] = "static"
            r = {}
            with torch.no_grad():
                want = ref.generate(x, do_sample=False, **kw)
                n0 = programs_built()
                r["greedy"] = [bool(torch.equal(model.generate(x, do_sample=False, **kw), want))
                               for _ in range(2)]  # fmt: skip
                r["varied"] = len(set(want[:, 8:].flatten().tolist()))
                progs = compiled_programs(n0)
                r["programs"] = len(progs)
                r["symbolic"] = [p.symbolic for p in progs]
                r["decode"] = sorted((c.kind, c.bytes) for c in progs[-1].collectives())
                torch.manual_seed(3)
                want = ref.generate(x, do_sample=True, top_k=0, **kw)
                torch.manual_seed(3)
                got = model.generate(x, do_sample=True, top_k=0, **kw)
                r["sampled"] = bool(torch.equal(got, want))
                r["after_sampling"] = len(compiled_programs(n0))
            out[f"{state}/{cache}"] = r
        if state == "sharded":  # direct calls: the DynamicCache stays sharded in between
            caches = [T.DynamicCache(config=cfg) for _ in range(2)]
            errs = []
            with torch.no_grad():
                for step in range(3):
                    ids = x if step == 0 else x[:, :1] + step
                    got = model(ids, past_key_values=caches[0], use_cache=True).logits
                    want = ref(ids, past_key_values=caches[1], use_cache=True).logits
                    errs.append(_rel(got, want))
            k = caches[0].layers[0].keys
            out["direct"] = dict(err=max(errs), type=type(k).__name__, spec=str(k.spec),
                                 local=tuple(k.local.shape), shape=tuple(k.shape),
                                 keys=_rel(k * 1, caches[1].layers[0].keys))  # fmt: skip
    return out


def moe_expert_dispatch(rank, world):
    """A Mixtral whose 3 experts are split over the ranks (uneven blocks): tokens split by batch
    through ``fxshard.shard(...).compile()`` (token dispatch: all-to-alls inside the experts
    region), and the model's own expert-parallel plan through ``torch.compile`` (tokens replicated:
    each rank its experts' pairs, all-reduced).  Errors against single device and the experts ops
    each per-rank program runs."""
    import transformers as T
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from fxshard.backend import compiled_programs, programs_built

    torch.manual_seed(0)
    cfg = T.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=8, num_experts_per_tok=2, num_local_experts=3)  # fmt: skip
    model = T.MixtralForCausalLM(cfg).eval()
    x = torch.randint(1, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).logits

    class Logits(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(ids).logits

    def experts_ops(gm):
        return sorted({str(n.target) for n in gm.graph.nodes if "moe_experts" in str(n.target)})

    dm = init_device_mesh("cpu", (world,))
    out = {}
    experts = "m.model.layers.*.mlp.experts."
    plan = {experts + p: "grouped_gemm" for p in ("gate_up_proj", "down_proj")}
    rows = [(Shard(0),)]
    prog = fxshard.shard(Logits(model), dm, plan, example_inputs=(x,), input_placements=rows,
                         output_placements=rows)  # fmt: skip
    fn = prog.compile()
    with torch.no_grad():
        got = fn(x)
    local_want = fn.output_specs[0].local_of(want, fn.coord_ints)
    out["dispatch"] = (_rel(got, local_want), experts_ops(prog.local_graph))
    torch._dynamo.reset()
    n0 = programs_built()
    f = torch.compile(model, backend="fxshard", options={"mesh": dm, "plan": dict(model._ep_plan)})
    with torch.no_grad():
        got = f(x).logits
    (p,) = compiled_programs(n0)
    out["ep_plan"] = (_rel(got, want), experts_ops(p.local_graph))
    out["train"] = _dispatch_train(dm, experts_ops)
    return out


def _dispatch_train(dm, experts_ops):
    """A router + Mixtral's experts class, trained through ``fxshard.parallelize`` on a
    batch-split DTensor: loss and gradients against single device, and the experts ops run."""
    import copy

    import transformers as T
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            cfg = T.MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=3,
                                  num_experts_per_tok=2)  # fmt: skip
            self.gate = nn.Linear(16, 3, bias=False)
            self.experts = MixtralExperts(cfg)

        def forward(self, x):
            w, idx = torch.topk(self.gate(x).softmax(-1), 2)
            return self.experts(x, idx, w).pow(2).mean()

    torch.manual_seed(0)
    model = Loss()
    with torch.no_grad():
        for p in model.experts.parameters():
            p.normal_(0, 0.2)
    ref = copy.deepcopy(model)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    want = ref(x)
    want.backward()
    plan = {f"experts.{p}": "grouped_gemm" for p in ("gate_up_proj", "down_proj")}
    torch._dynamo.reset()
    pm = fxshard.parallelize(model, dm, plan)
    loss = pm(distribute_tensor(x, dm, [Shard(0)]))
    loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    loss.backward()
    errs = [_rel(loss.detach(), want.detach())]
    for (_n, p), q in zip(pm.named_parameters(), ref.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errs.append(_rel(g, q.grad))
    progs = [p for p, _ in pm._programs.values()]
    ops = sorted({o for p in progs for o in experts_ops(p.local_graph)})
    return max(errs), ops


# ---- training as users train (tests/test_user_paths.py) ------------------------------------------
class WithLoss(nn.Module):
    """A language model and its loss in one module: the loss is inside the compiled graph (its
    backward, e.g. cross-entropy's scatter, is in the per-rank backward program)."""

    def __init__(self, model, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x, y):
        return loss_of(self.loss, self.model(x), y)


def loss_of(kind, logits, y):
    logits = logits.float()
    if kind == "mse":
        return nn.functional.mse_loss(logits, y)
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), ignore_index=3, label_smoothing=0.1
    )


def _optimizer(name, params):
    # AdamW's first steps divide by |g|: eps keeps an element whose gradient is ~1e-9 (equal to
    # rounding) from moving by lr on one side and not the other
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)
    return torch.optim.SGD(params, lr=0.5)


def train_losses(rank, world, cases, steps=3):
    """For each (loss, where, optimizer): ``steps`` training steps of the zoo Llama through
    torch.compile(backend="fxshard") (Inductor, real ranks) and on single device, an eval()/no_grad
    forward between steps; returns the worst relative error of losses, eval outputs and weights."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.backend import compiled_programs, programs_built

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for loss, where, optimizer, *plan_name in cases:
        torch._dynamo.reset()
        n0 = programs_built()
        vocab = 8192 if plan_name == ["vocab"] else 128  # logits of 1 MiB
        llama = zoo.init_weights(zoo.Llama(zoo.LlamaConfig(vocab_size=vocab)), seed=0)
        (x,) = zoo.example_input(llama, generator=torch.Generator().manual_seed(1))
        g = torch.Generator().manual_seed(2)
        if loss == "mse":
            y = torch.randn(*x.shape, llama.cfg.vocab_size, generator=g)
        else:
            y = torch.randint(0, llama.cfg.vocab_size, x.shape, generator=g)
            y[0, :3] = 3  # ignored positions
        # "vocab": the logits leave the head vocab-sharded (loss parallel where the loss is in
        # the graph)
        plan = zoo.vocab_parallel_plan() if plan_name == ["vocab"] else zoo.megatron_tp_plan()
        if where == "inside":  # the loss in the compiled graph
            ref = WithLoss(llama, loss)
            plan = {f"model.{k}": v for k, v in plan.items()}
        else:  # logits out of the compiled graph, the loss in eager code
            ref = llama
        model = copy.deepcopy(ref)
        f = torch.compile(model, backend="fxshard", options={"mesh": dm, "plan": plan})
        opts = [_optimizer(optimizer, m.parameters()) for m in (ref, model)]
        errs = []
        for _ in range(steps):
            for fn, opt in zip((ref, f), opts):
                opt.zero_grad()
                loss_value = fn(x, y) if where == "inside" else loss_of(loss, fn(x), y)
                loss_value.backward()
                opt.step()
                if fn is ref:
                    want = loss_value.detach()
                else:
                    errs.append(_rel(loss_value.detach(), want))
            # evaluation between steps: the inference program, then training again
            for m in (ref, model):
                m.eval()
            with torch.no_grad():
                args = (x, y) if where == "inside" else (x,)
                errs.append(_rel(f(*args), ref(*args)))
            for m in (ref, model):
                m.train()
        errs += [_rel(p.detach(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())]
        # the largest tensor a training program's forward collectives move (its backward gathers
        # the parameters' gradients to the global ones the backend returns)
        moved = max(
            c.bytes
            for p in compiled_programs(n0)
            if p.training
            for c in p.collectives()
            if c.phase == "forward"
        )
        out.append((loss, where, optimizer, max(errs), moved))
    return out


def hf_train(rank, world, names, steps=3):
    """For each transformers architecture of tests/test_hf.py: ``steps`` AdamW steps of
    ``model(x, labels=...).loss`` (transformers' own cross-entropy, some labels -100) through
    torch.compile(backend="fxshard") on real ranks with Inductor, a no_grad default call between
    steps, then greedy generate(); the worst relative error of losses, logits and weights against
    single device, and whether generate gave single device's tokens (None: not a text model)."""
    import copy

    import test_hf
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for name in names:
        torch._dynamo.reset()
        ref, plan, kind, x, labels = test_hf._build(name)
        labels = labels.clone()
        if kind != "vision":
            labels[0, :2] = -100
        ref.train()
        model = copy.deepcopy(ref)
        f = torch.compile(model, backend="fxshard", options={"mesh": dm, "plan": plan})
        opts = [_optimizer("adamw", m.parameters()) for m in (ref, model)]
        errs = []
        for _ in range(steps):
            losses = []
            for fn, opt in zip((ref, f), opts):
                opt.zero_grad()
                loss = fn(x, labels=labels).loss
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            errs.append(_rel(losses[1], losses[0]))
            with torch.no_grad():
                errs.append(_rel(f(x).logits, ref(x).logits))
        # weights against their scale (init std 0.02): a key bias without RoPE has a zero true
        # gradient (softmax ignores a constant per query), so its value is rounding on both sides
        errs += [
            float((p - q).abs().max() / q.abs().max().clamp_min(1e-2))
            for p, q in zip(model.parameters(), ref.parameters())
        ]
        if kind != "text":  # a masked LM, an image classifier: nothing to generate
            out.append((name, max(errs), None))
            continue
        # greedy generate() after training: the tokens of single device
        mask = torch.ones_like(x)
        with torch.no_grad():
            got = f.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
            want = ref.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
        out.append((name, max(errs), bool(torch.equal(got, want))))
    return out


class VocabHead(nn.Module):
    """A model whose output leaves a ColwiseParallel layer (a vocab-parallel head)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 100)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def parallelize_calls(rank, world):
    """fxshard.parallelize of a vocab-parallel head called every way a training loop calls it: the
    global output of single device each time (name -> (shape, max abs error or None))."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel

    torch.manual_seed(0)
    ref = VocabHead()
    x = torch.randn(4, 8, 16)
    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = fxshard.parallelize(copy.deepcopy(ref), dm, {"head": ColwiseParallel()})
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, pm)]
    out = {}

    def check(name, got, want):
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        same = tuple(got.shape) == tuple(want.shape)
        out[name] = (tuple(got.shape), float((got - want).abs().max()) if same else None)

    with torch.no_grad():
        check("no_grad", pm(x), ref(x))
        check("torch.compile of it", torch.compile(pm)(x), ref(x))
    for step in range(2):  # training steps with a no_grad evaluation between them
        for m, opt in zip((ref, pm), opts):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
        with torch.no_grad():
            check(f"eval after step {step}", pm(x), ref(x))
    # torch's state-dict helpers on the module and its optimizer: the model's own FQNs
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(pm, opts[1])
    out["state_dict_keys"] = (
        sorted(msd) == sorted(ref.state_dict()),
        sorted(osd["param_groups"][0]["params"]),
    )
    set_state_dict(pm, opts[1], model_state_dict=msd, optim_state_dict=osd)
    with torch.no_grad():
        check("after set_state_dict", pm(x), ref(x))
    for p in pm.parameters():
        p.requires_grad_(False)
    check("frozen", pm(x), ref(x).detach())
    return out


def _dtensor_fn(x):
    return torch.relu(x) * 2 + x.sum(-1, keepdim=True)


def dtensor_returns(rank, world):
    """Where eager returns a DTensor, the compiled call returns one (name -> (is a DTensor,
    placements, max abs error of the global value)); where eager returns a plain tensor, a plain
    global one."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}

    def record(name, got, want):
        is_dt = isinstance(got, DTensor)
        full = got.full_tensor() if is_dt else got
        want_full = want.full_tensor() if isinstance(want, DTensor) else want
        err = float((full - want_full).abs().max()) if full.shape == want_full.shape else None
        out[name] = (is_dt, tuple(str(p) for p in got.placements) if is_dt else None, err)

    torch.manual_seed(0)
    x = torch.randn(4, 6)
    dx = distribute_tensor(x, dm, [Shard(0)])
    torch._dynamo.reset()
    f = torch.compile(_dtensor_fn, backend="fxshard", options={"mesh": dm, "plan": {}})
    record("dtensor in", f(dx), _dtensor_fn(dx))

    # use_local_output=False: torch's way to ask a layer for a DTensor output
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = VocabHead()
    plan = {
        "body": ColwiseParallel(),
        "head": RowwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    eager = parallelize_module(copy.deepcopy(ref), dm, plan)
    xs = torch.randn(4, 8, 16)
    got = torch.compile(copy.deepcopy(ref), backend="fxshard", options={"mesh": dm, "plan": plan})
    record("use_local_output=False", got(xs), eager(xs))
    record("eager torch", eager(xs), ref(xs))
    # the plain default: plain inputs and a plan give global tensors
    torch._dynamo.reset()
    plain = {"body": ColwiseParallel(), "head": RowwiseParallel()}
    got = torch.compile(copy.deepcopy(ref), backend="fxshard", options={"mesh": dm, "plan": plain})
    record("plain", got(xs), ref(xs))
    _dtensor_args_dynamo_traces(dm, record)
    return out


class _GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def _dtensor_args_dynamo_traces(dm, record):
    """DTensor arguments where DTensor's own rules refuse the program while dynamo traces it
    (eager DTensor raises on each): plain parameters (no implicit_replication), a DTensor crossing
    a graph break into plain parameters, an uneven batch flattened by a Linear, sequence-split
    input ids with dynamic=True (two lengths).  The backend runs each; the global values equal
    single device's."""
    import copy

    from torch.distributed.tensor import Shard, distribute_tensor

    from fxshard import zoo

    torch.manual_seed(0)
    ref = _GraphBreak()
    for name, x in (
        ("plain params", torch.randn(4, 6, 8)),
        ("uneven batch", torch.randn(3, 5, 8)),
    ):
        torch._dynamo.reset()
        got = torch.compile(copy.deepcopy(ref), backend="fxshard", options={"mesh": dm, "plan": {}})
        record(name, got(distribute_tensor(x, dm, [Shard(0)])), ref(x))
    torch._dynamo.reset()
    model = zoo.init_weights(zoo.Llama(), seed=0)
    got = torch.compile(
        copy.deepcopy(model),
        backend="fxshard",
        dynamic=True,
        options={"mesh": dm, "plan": zoo.megatron_tp_plan()},
    )
    for seq in (16, 24):
        ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            record(f"dynamic seq {seq}", got(distribute_tensor(ids, dm, [Shard(1)])), model(ids))
    # batch-split ids: attention's sdpa has no DTensor rule on CPU, its decomposition does
    torch._dynamo.reset()
    got = torch.compile(
        copy.deepcopy(model),
        backend="fxshard",
        options={"mesh": dm, "plan": zoo.megatron_tp_plan()},
    )
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        record("batch ids", got(distribute_tensor(ids, dm, [Shard(0)])), model(ids))


def lone_read(rank, world, timeout_s):
    """A decode loop over a kept-sharded cache; every rank reads it eagerly once (right), then
    rank 0 alone reads it (a print on rank 0) while the others decode on.  Per rank: the joint
    read's error, what the lone read / the next calls raised, and how long that took."""
    import copy
    import time

    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    ref = CachedBlock()
    dm = init_device_mesh("cpu", (world,))
    xs = torch.randn(6, 2, 1, 64, generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    options = {
        "mesh": dm,
        "plan": _cache_plan(),
        "agreement": fxshard.AgreementOptions(timeout_s=timeout_s, collective_timeout_s=60),
    }
    model = torch.compile(copy.deepcopy(ref), backend="fxshard", options=options)
    mine, theirs = CacheLayer(), CacheLayer()
    out = {}
    with torch.no_grad():
        for i in range(2):
            pos = torch.tensor([i])
            model(xs[i], pos, mine)
            ref(xs[i], pos, theirs)
        out["kept"] = type(mine.k).__name__
        out["joint read"] = abs(float(mine.k.sum()) - float(theirs.k.sum()))
        start = time.monotonic()
        try:
            if rank == 0:
                print(float(mine.k.sum()))  # rank 0 alone
            for i in range(2, 6):
                model(xs[i], torch.tensor([i]), mine)
            out["error"] = None
        except Exception as e:  # noqa: BLE001 - the test reads what each rank got
            out["error"] = f"{type(e).__name__}: {e}"
        out["seconds"] = time.monotonic() - start
    return out


def _train_step(model, x, labels) -> None:
    model(x, labels=labels).loss.backward()


def _comm_counts(fn, *args, **kwargs) -> dict:
    """{collective: count} torch runs in ``fn(*args, **kwargs)`` (torch's CommDebugMode: DTensor's
    functional collectives and c10d's in-place ones, which transformers' own TP hooks call)."""
    from torch.distributed.tensor.debug import CommDebugMode

    mode = CommDebugMode()
    with mode:
        fn(*args, **kwargs)
    return {str(op).split(".")[-1].rstrip("_"): n for op, n in mode.get_comm_counts().items()}


def hf_default_call(rank, world, names):
    """transformers causal LMs called the default way (``model(input_ids)``: the model creates a
    DynamicCache and returns it) through the backend on gloo ranks: the collectives of the prefill
    and of a decode step that takes the returned cache, against transformers' own TP
    (``apply_tensor_parallelism``, counted by CommDebugMode) in the same run; the logits and the
    returned cache against single device, and what the cache's tensors are."""
    import copy

    import test_hf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from fxshard.backend import compiled_programs, programs_built

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name in names:
        torch._dynamo.reset()
        ref, plan, _, x, _ = test_hf._build(name)
        f = torch.compile(copy.deepcopy(ref), backend="fxshard", options={"mesh": dm, "plan": plan})
        hf = apply_tensor_parallelism(copy.deepcopy(ref), dm)
        with torch.no_grad():
            want = ref(x)
            nxt = want.logits[:, -1:].argmax(-1)
            kv = [(lay.keys.clone(), lay.values.clone()) for lay in want.past_key_values.layers]
            want2 = ref(nxt, past_key_values=want.past_key_values)
            n0 = programs_built()
            got = f(x)
            cache = got.past_key_values
            kept = [t for lay in cache.layers for t in (lay.keys, lay.values)]
            kinds = sorted({type(t).__name__ for t in kept})
            errs = [_rel(got.logits, want.logits)]
            for a, (k, v) in zip(cache.layers, kv):
                errs += [_rel(a.keys * 1, k), _rel(a.values * 1, v)]
            errs.append(_rel(f(nxt, past_key_values=cache).logits, want2.logits))
            ours = [
                sum(1 for c in p.collectives() if c.phase == "forward")
                for p in compiled_programs(n0)
            ]
            first = hf(x)
            theirs = [
                sum(_comm_counts(hf, x).values()),
                sum(_comm_counts(hf, nxt, past_key_values=first.past_key_values).values()),
            ]
        out[name] = dict(err=max(errs), kinds=kinds, ours=ours, torch=theirs)
    return out


def hf_train_cache(rank, world, names):
    """transformers causal LMs trained the default way (``model(x, labels=y)`` in train mode makes
    and returns a DynamicCache) through the backend on gloo ranks: what the returned cache's
    tensors are, the forward's collectives against transformers' own TP's forward (counted by
    CommDebugMode in the same run), and gradients against single device where the loss reads the
    returned cache and where the cache goes back into a second training call."""
    import copy

    import test_hf
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from fxshard.backend import compiled_programs, programs_built

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name in names:
        torch._dynamo.reset()
        ref, plan, _, x, labels = test_hf._build(name)
        ref.train()
        model = copy.deepcopy(ref)
        f = torch.compile(model, backend="fxshard", options={"mesh": dm, "plan": plan})
        nxt = x[:, 3:6]
        errs, kinds, ours = [], None, None
        grads = []
        for m, params in ((ref, ref), (f, model)):
            n0 = programs_built()
            o = m(x, labels=labels)
            if m is f:
                ours = sum(
                    1 for p in compiled_programs(n0) for c in p.collectives()
                    if c.phase == "forward"
                )  # fmt: skip
                ours_step = sum(len(p.collectives()) for p in compiled_programs(n0))
                layers = o.past_key_values.layers
                kinds = sorted({type(t).__name__ for lay in layers for t in (lay.keys, lay.values)})
            # a loss that reads the returned cache, and the cache handed back into a training call
            cache_term = sum(
                lay.keys.pow(2).mean() + lay.values.mean() for lay in o.past_key_values.layers
            )
            o2 = m(nxt, past_key_values=o.past_key_values, labels=nxt)
            loss = o.loss + cache_term + o2.loss
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in params.parameters()]))
        errs.append(_rel(grads[1][0], grads[0][0]))
        errs += [_rel(a, b) for a, b in zip(grads[1][1], grads[0][1])]
        hf = apply_tensor_parallelism(copy.deepcopy(ref), dm)
        theirs = sum(_comm_counts(hf, x, labels=labels).values())
        step = sum(_comm_counts(_train_step, hf, x, labels).values())
        out[name] = dict(err=max(errs), kinds=kinds, ours=ours, torch=theirs)
        out[name].update(ours_step=ours_step, torch_step=step)
    return out


def hf_parallelize_train(rank, world, names, steps=3):
    """transformers models trained with sharded parameters, called as users call them:
    ``fxshard.parallelize(model, mesh, tp_plan)`` then ``pm(input_ids=x, labels=y).loss
    .backward()`` and AdamW on the DTensor parameters, an eval call with ``attention_mask=``
    between steps.  The default call makes and returns a ``DynamicCache``: it comes back as
    KeptTensors where sharded (no gather), and the first step's loss reads it (its gradient
    reaches the program's backward).  Per architecture: the worst relative error of losses,
    logits, the returned cache and the final weights against single device, the collectives of
    one training step (fxshard: its program's; transformers' own TP: counted by CommDebugMode in
    the same run), the programs built, and the types of the returned cache's tensors."""
    import copy

    import test_hf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name in names:
        torch._dynamo.reset()
        ref, plan, _, x, labels = test_hf._build(name)
        labels = labels.clone()
        labels[0, :2] = -100
        ref.train()
        hf = apply_tensor_parallelism(copy.deepcopy(ref), dm)
        try:
            with CommDebugMode() as cm:
                hf(input_ids=x, labels=labels).loss.backward()
            theirs = cm.get_total_counts()
        except RuntimeError:  # its TP cannot split these heads over the ranks (2 kv heads on 4)
            theirs = None
        pm = fxshard.parallelize(copy.deepcopy(ref), dm, plan)
        opts = [_optimizer("adamw", m.parameters()) for m in (ref, pm)]
        mask = torch.ones_like(x)
        mask[1, :3] = 0  # left padding on one row
        errs, cache_types = [], set()
        for step in range(steps):
            losses, caches = [], []
            for m, opt in zip((ref, pm), opts):
                opt.zero_grad()
                result = m(input_ids=x, labels=labels)
                loss, cache = result.loss, result.past_key_values
                caches.append([t for layer in cache.layers for t in (layer.keys, layer.values)])
                if step == 0:  # a loss that reads the returned cache (every rank, same order)
                    loss = loss + 0.1 * cache.layers[-1].values.float().pow(2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            errs.append(_rel(losses[1], losses[0]))
            cache_types |= {type(t).__name__ for t in caches[1]}
            errs += [_rel(b.detach(), a.detach()) for a, b in zip(*caches)]
            with torch.no_grad():
                got = pm(x, attention_mask=mask).logits
                want = ref(x, attention_mask=mask).logits
            errs.append(_rel(got, want))
        full = pm.full_state_dict()
        errs += [
            float((full[k] - v).abs().max() / v.abs().max().clamp_min(1e-2))
            for k, v in ref.state_dict().items()
            if k in full
        ]
        train = [p for (key, (p, _)) in pm._programs.items() if key[0]]
        out[name] = {
            "err": max(errs),
            "ours": len(train[0].collectives()) if train else None,
            "torch": theirs,
            "programs": len(pm._programs),
            "cache": sorted(cache_types),
        }
    return out
