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
        n_params=sum(p.numel() for p in pm.parameters()),
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


def ranks_disagree(rank, world):
    """Differences between the ranks the runtime must notice: every rank's outcome per case."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = zoo.mlp_plan()
    opts = fxshard.AgreementOptions(timeout_s=30)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
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
