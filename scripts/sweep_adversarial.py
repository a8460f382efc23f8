"""An adversarial sweep of the newest features, written the way users of torch and transformers
write code: DTensor boundaries, graph breaks, KV caches and ``KeptTensor``, training loops,
``fxshard.parallelize`` with optimizers and state dicts, uneven shapes, MoE, bad options.

    python scripts/sweep_adversarial.py [--modes simulated,gloo] [--timeout 900]

Each case runs against single device on simulated ranks (a (2, 2) mesh in this process, where
the case needs no process group) and on 2 gloo ranks with the Inductor-compiled per-rank program.
A case is one of: right (the global values of single device), clear error (an error that names
fxshard and what to do, where the case is one fxshard should refuse or cannot run), unclear
error, WRONG (a silently different answer, or a bad option accepted), hang (no answer within the
timeout).  Prints a table of cases and a count per class."""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fxshard  # noqa: E402
from fxshard import zoo  # noqa: E402
from fxshard.runtime.launch import spawn  # noqa: E402

TOL = 1e-4


class Refuse(Exception):
    """A case that must end in a clear error ran without one."""


def _rel(a, b) -> float:
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = b.full_tensor() if hasattr(b, "full_tensor") else b
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-2))


def _opts(ctx, **kw) -> dict:
    out = {"mesh": ctx["mesh"], **kw}
    if ctx["sim"]:
        out["simulate"] = True
    return out


def _llama(seed=0):
    return zoo.init_weights(zoo.Llama(), seed=seed)


def _ids(b=2, s=16, seed=1):
    return torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(seed))


def _compiled(model, ctx, plan, **kw):
    torch._dynamo.reset()
    return torch.compile(model, backend="fxshard", options=_opts(ctx, plan=plan, **kw))


# ---- the cases: each returns the worst relative error against single device, or raises ----------


def dtensor_plain_params(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 6, 8)
    got = _compiled(copy.deepcopy(ref), ctx, {})(distribute_tensor(x, ctx["mesh"], [Shard(0)]))
    return _rel(got, ref(x)) if type(got).__name__ == "DTensor" else float("inf")


class SameAsEager(Exception):
    """Eager torch raises the same error on the same program: the compiled call may too."""


def _as_eager(eager, compiled):
    """The compiled call's value; where eager raises, the compiled call raising the same error is
    what eager does (anything else: the compiled call's own outcome)."""
    try:
        eager()
    except Exception as e:  # noqa: BLE001
        want = str(e).splitlines()[0]
        try:
            return compiled()
        except Exception as got:  # noqa: BLE001
            if want in str(got):
                raise SameAsEager(want[:100]) from None
            raise
    return compiled()


def dtensor_graph_break(ctx):
    """A DTensor crossing a graph break (not in a loop) into plain parameters."""
    from e2e_workers import BreakMLP
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = zoo.init_weights(BreakMLP(), seed=2)
    x = torch.randn(4, 6)
    with torch.no_grad():
        got = _compiled(copy.deepcopy(ref), ctx, {})(distribute_tensor(x, ctx["mesh"], [Shard(0)]))
        return _rel(got, ref(x))


def dtensor_graph_break_in_a_loop(ctx):
    """A graph break inside the loop over layers: dynamo runs that frame eagerly, so the model's
    plain parameters meet the DTensor in eager DTensor code."""
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = zoo.init_weights(zoo.GraphBreakLlama(zoo.LlamaConfig()), seed=0)
    x = _ids()
    dx = distribute_tensor(x, ctx["mesh"], [Shard(0)])
    f = _compiled(copy.deepcopy(ref), ctx, zoo.megatron_tp_plan())
    with torch.no_grad():
        return _rel(_as_eager(lambda: copy.deepcopy(ref)(dx), lambda: f(dx)), ref(x))


def dtensor_uneven_batch(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = _llama()
    x = _ids(b=3)
    with torch.no_grad():
        got = _compiled(copy.deepcopy(ref), ctx, zoo.megatron_tp_plan())(
            distribute_tensor(x, ctx["mesh"], [Shard(0)])
        )
        return _rel(got, ref(x))


def dtensor_seq_ids_dynamic(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = _llama()
    torch._dynamo.reset()
    f = torch.compile(
        copy.deepcopy(ref),
        backend="fxshard",
        dynamic=True,
        options=_opts(ctx, plan=zoo.megatron_tp_plan()),
    )
    errs = []
    with torch.no_grad():
        for s in (16, 24):
            x = _ids(s=s, seed=s)
            errs.append(_rel(f(distribute_tensor(x, ctx["mesh"], [Shard(1)])), ref(x)))
    return max(errs)


def dtensor_grad_placement(ctx):
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = zoo.init_weights(zoo.MLP(dim=8, hidden=16), seed=0)
    x = torch.randn(4, 8)
    xr = x.clone().requires_grad_(True)
    ref(xr).pow(2).sum().backward()
    dx = distribute_tensor(x, ctx["mesh"], [Shard(0)]).requires_grad_(True)
    f = _compiled(copy.deepcopy(ref), ctx, zoo.mlp_plan())
    out = f(dx)
    (out.full_tensor() if hasattr(out, "full_tensor") else out).pow(2).sum().backward()
    if tuple(dx.grad.placements) != (Shard(0),):
        return float("inf")
    return _rel(dx.grad, xr.grad)


def use_local_output_false(ctx):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    ref = zoo.init_weights(zoo.MLP(dim=8, hidden=16), seed=0)
    plan = {
        "fc1": ColwiseParallel(use_local_output=False),
        "fc2": RowwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    x = torch.randn(4, 8)
    eager = parallelize_module(copy.deepcopy(ref), ctx["mesh"], copy.deepcopy(plan))(x)
    got = _compiled(copy.deepcopy(ref), ctx, plan)(x)
    if type(got).__name__ != type(eager).__name__:
        return float("inf")
    return _rel(got, ref(x))


def graph_break_training(ctx):
    ref = zoo.init_weights(zoo.GraphBreakLlama(zoo.LlamaConfig()), seed=0)
    return _train(ref, ctx, zoo.megatron_tp_plan(), "ce", "adamw")


def _loss_parallel():
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _train(
    ref, ctx, plan, loss, opt, steps=3, accumulate=1, evals=False, freeze=None, smoothing=0.1
):
    model = copy.deepcopy(ref)
    if freeze:
        for m in (ref, model):
            for n, p in m.named_parameters():
                p.requires_grad_(not n.startswith(freeze))
    f = _compiled(model, ctx, plan)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5),
    }[opt]
    opts = [make([p for p in m.parameters() if p.requires_grad]) for m in (ref, model)]
    errs = []
    for step in range(steps):
        for fn, o in zip((ref, f), opts):
            o.zero_grad()
            for micro in range(accumulate):
                x = _ids(seed=10 * step + micro)
                logits = fn(x)
                y = torch.roll(x, -1, dims=1)
                # vocab-sharded DTensor logits (use_local_output=False, as eager torch returns
                # them): the loss under torch's loss_parallel(), as torch users write it
                dt = type(logits).__name__ == "DTensor"
                with _loss_parallel() if dt else contextlib.nullcontext():
                    if loss == "ce":
                        value = F.cross_entropy(
                            logits.flatten(0, 1).float(),
                            y.flatten(),
                            label_smoothing=smoothing,
                        )
                    else:
                        value = F.mse_loss(logits.float(), torch.zeros_like(logits))
                    (value / accumulate).backward()
            o.step()
        if evals:
            x = _ids(seed=99)
            for m in (ref, model):
                m.eval()
            with torch.no_grad():
                errs.append(_rel(f(x), ref(x)))
            for m in (ref, model):
                m.train()
    errs += [_rel(p, q) for p, q in zip(model.parameters(), ref.parameters())]
    return max(errs)


def ce_adamw(ctx):
    return _train(_llama(), ctx, zoo.megatron_tp_plan(), "ce", "adamw")


def mse_sgd_eval_between(ctx):
    return _train(_llama(), ctx, zoo.megatron_tp_plan(), "mse", "sgd", evals=True)


def grad_accumulation(ctx):
    return _train(_llama(), ctx, zoo.megatron_tp_plan(), "ce", "sgd", steps=2, accumulate=2)


def frozen_embeddings(ctx):
    return _train(_llama(), ctx, zoo.megatron_tp_plan(), "ce", "adamw", freeze="tok_embeddings")


def vocab_parallel_loss(ctx):
    return _train(_llama(), ctx, zoo.vocab_parallel_plan(), "ce", "adamw", smoothing=0.0)


def hf_default_call_and_decode(ctx):
    import test_hf

    ref, plan, _, x, _ = test_hf._build("llama")
    f = _compiled(copy.deepcopy(ref), ctx, plan)
    with torch.no_grad():
        a, b = f(x), ref(x)
        nxt = b.logits[:, -1:].argmax(-1)
        a2 = f(nxt, past_key_values=a.past_key_values)
        b2 = ref(nxt, past_key_values=b.past_key_values)
    return max(_rel(a.logits, b.logits), _rel(a2.logits, b2.logits))


def hf_generate(ctx):
    import test_hf

    ref, plan, _, x, _ = test_hf._build("mixtral")
    f = _compiled(copy.deepcopy(ref), ctx, plan)
    mask = torch.ones_like(x)
    with torch.no_grad():
        got = f.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False)
        want = ref.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False)
    return 0.0 if torch.equal(got, want) else float("inf")


def hf_labels_training(ctx):
    import test_hf

    ref, plan, _, x, labels = test_hf._build("qwen3_moe")
    model = copy.deepcopy(ref)
    f = _compiled(model, ctx, plan)
    losses = []
    for fn in (ref, f):
        loss = fn(x, labels=labels).loss
        loss.backward()
        losses.append(loss)
    grads = [
        _rel(p.grad, q.grad)
        for p, q in zip(model.parameters(), ref.parameters())
        if q.grad is not None and q.grad.abs().max() > 1e-6
    ]
    return max([_rel(losses[1], losses[0]), *grads])


def parallelize_no_grad(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel

    ref = _llama()
    pm = fxshard.parallelize(copy.deepcopy(ref), ctx["mesh"], {"output": ColwiseParallel()})
    x = _ids()
    with torch.no_grad():
        return _rel(pm(x), ref(x))


def parallelize_state_dict(ctx):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ref = _llama()
    pm = fxshard.parallelize(copy.deepcopy(ref), ctx["mesh"], zoo.megatron_tp_plan())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    pm(_ids()).float().pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(pm, opt)
    return 0.0 if set(msd) == set(ref.state_dict()) and osd["state"] else float("inf")


def compile_a_parallel_module(ctx):
    ref = _llama()
    pm = fxshard.parallelize(copy.deepcopy(ref), ctx["mesh"], zoo.megatron_tp_plan())
    torch._dynamo.reset()
    x = _ids()
    with torch.no_grad():
        return _rel(torch.compile(pm)(x), ref(x))


def parallelize_hf_default_cache(ctx):
    import test_hf

    ref, plan, _, x, _ = test_hf._build("llama")
    pm = fxshard.parallelize(copy.deepcopy(ref), ctx["mesh"], plan)
    with torch.no_grad():
        return _rel(pm(x).logits, ref(x).logits)


def block_compiled_alone(ctx):
    ref = _llama()
    model = copy.deepcopy(ref)
    plan = {
        k.removeprefix("layers.*."): v
        for k, v in zoo.megatron_tp_plan().items()
        if k.startswith("layers.*.")
    }
    torch._dynamo.reset()
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block, backend="fxshard", options=_opts(ctx, plan=plan))
    x = _ids()
    with torch.no_grad():
        return _rel(model(x), ref(x))


def uneven_heads_and_vocab(ctx):
    ref = zoo.init_weights(zoo.Llama(zoo.uneven_config()), seed=0)
    x = torch.randint(0, ref.tok_embeddings.num_embeddings, (2, 16))
    with torch.no_grad():
        return _rel(_compiled(copy.deepcopy(ref), ctx, zoo.megatron_tp_plan())(x), ref(x))


def uneven_batch_plain(ctx):
    ref = _llama()
    x = _ids(b=3, s=13)
    with torch.no_grad():
        return _rel(_compiled(copy.deepcopy(ref), ctx, zoo.megatron_tp_plan())(x), ref(x))


def shard_example_inputs_tensor(ctx):
    ref = _llama()
    x = _ids()
    prog = fxshard.shard(
        ref, ctx["mesh"], zoo.megatron_tp_plan(), example_inputs=x, output_placements="replicate"
    )
    with torch.no_grad():
        got = prog.simulate(x) if ctx["sim"] else prog.compile()(x)
        return _rel(got[0] if isinstance(got, (tuple, list)) else got, ref(x))


def _refused(fn) -> float:
    fn()
    raise Refuse("ran without an error")


def bad_bucket_bytes_str(ctx):
    return _refused(lambda: _compiled(_llama(), ctx, {}, bucket_bytes="25MB")(_ids()))


def bad_bucket_bytes_negative(ctx):
    return _refused(lambda: _compiled(_llama(), ctx, {}, bucket_bytes=-1)(_ids()))


def bad_mesh_int(ctx):
    return _refused(
        lambda: torch.compile(_llama(), backend="fxshard", options={"mesh": 4, "plan": {}})(_ids())
    )


def bad_simulate_str(ctx):
    opts = {"mesh": (2,), "plan": {}, "simulate": "yes"}
    return _refused(lambda: torch.compile(_llama(), backend="fxshard", options=opts)(_ids()))


def bad_auto_options(ctx):
    return _refused(lambda: _compiled(_llama(), ctx, "auto", auto_options={"budget": 3})(_ids()))


def bad_output_placements_flat(ctx):
    from torch.distributed.tensor import Shard

    return _refused(lambda: _compiled(_llama(), ctx, {}, output_placements=[Shard(0)])(_ids()))


def bad_output_placements_two(ctx):
    from torch.distributed.tensor import Replicate, Shard

    bad = [[Shard(0)], [Replicate()]]
    return _refused(lambda: _compiled(_llama(), ctx, {}, output_placements=bad)(_ids()))


def bad_plan_fqn(ctx):
    from torch.distributed.tensor.parallel import ColwiseParallel

    return _refused(
        lambda: _compiled(_llama(), ctx, {"layers.*.attn.q": ColwiseParallel()})(_ids())
    )


def bad_plan_style(ctx):
    return _refused(lambda: _compiled(_llama(), ctx, {"layers.*.attention.wq": "diagonal"})(_ids()))


def bad_unknown_option(ctx):
    return _refused(lambda: _compiled(_llama(), ctx, {}, fuse_all=True)(_ids()))


# (class, case, needs a process group)
CASES = [
    ("DTensor boundaries", dtensor_plain_params, True),
    ("DTensor boundaries", dtensor_graph_break, True),
    ("DTensor boundaries", dtensor_graph_break_in_a_loop, True),
    ("DTensor boundaries", dtensor_uneven_batch, True),
    ("DTensor boundaries", dtensor_seq_ids_dynamic, True),
    ("DTensor boundaries", dtensor_grad_placement, True),
    ("DTensor boundaries", use_local_output_false, True),
    ("graph breaks", graph_break_training, False),
    ("KV caches", hf_default_call_and_decode, False),
    ("KV caches", hf_generate, False),
    ("training loops", ce_adamw, False),
    ("training loops", mse_sgd_eval_between, False),
    ("training loops", grad_accumulation, False),
    ("training loops", frozen_embeddings, False),
    ("training loops", vocab_parallel_loss, False),
    ("training loops", hf_labels_training, False),
    ("parallelize", parallelize_no_grad, True),
    ("parallelize", parallelize_state_dict, True),
    ("parallelize", compile_a_parallel_module, True),
    ("parallelize", parallelize_hf_default_cache, True),
    ("parallelize", block_compiled_alone, False),
    ("uneven shapes", uneven_heads_and_vocab, False),
    ("uneven shapes", uneven_batch_plain, False),
    ("uneven shapes", shard_example_inputs_tensor, False),
    ("bad options", bad_bucket_bytes_str, False),
    ("bad options", bad_bucket_bytes_negative, False),
    ("bad options", bad_mesh_int, False),
    ("bad options", bad_simulate_str, False),
    ("bad options", bad_auto_options, False),
    ("bad options", bad_output_placements_flat, False),
    ("bad options", bad_output_placements_two, False),
    ("bad options", bad_plan_fqn, False),
    ("bad options", bad_plan_style, False),
    ("bad options", bad_unknown_option, False),
]


def _verdict(fn, ctx) -> tuple[str, str]:
    refusal = fn.__name__.startswith("bad_")  # a clear error is the right answer
    torch.manual_seed(0)  # every rank builds the same model and inputs
    try:
        err = fn(ctx)
    except Refuse as e:
        return "WRONG", str(e)
    except SameAsEager as e:
        return "right (eager raises too)", str(e)
    except Exception as e:  # noqa: BLE001 - the sweep classifies every failure
        text = f"{type(e).__name__}: {e}".strip()
        notes = " ".join(getattr(e, "__notes__", ()))
        raw = isinstance(e, (AssertionError, AttributeError, KeyError, IndexError, TypeError))
        clear = "fxshard" in (text + notes).lower() and not (raw and "fxshard" not in text[:200])
        kind = "clear error" if clear else "unclear error"
        if clear and refusal:
            kind = "right (clear error)"
        return kind, text.splitlines()[0][:140]
    return ("right" if err < TOL else "WRONG"), f"{err:.1e}"


def _run(cases, ctx):
    fns = {fn.__name__: fn for _, fn, _ in CASES}
    return {name: _verdict(fns[name], ctx) for name in cases}


def _gloo_worker(rank, world, cases):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return _run(cases, {"mesh": mesh, "sim": False})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="simulated,gloo")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    wanted = [c for c in args.cases.split(",") if c]
    rows = [(k, fn.__name__, pg) for k, fn, pg in CASES if not wanted or fn.__name__ in wanted]
    results: dict = {}
    for mode in args.modes.split(","):
        if mode == "simulated":
            names = [n for _, n, pg in rows if not pg]
            mesh = fxshard.MeshSpec((2, 2), names=("dp", "tp"))
            results[mode] = _run(names, {"mesh": mesh, "sim": True})
        else:
            names = [n for _, n, _ in rows]
            try:
                results[mode] = spawn(
                    2, _gloo_worker, names, timeout=args.timeout, collective_timeout=60
                )[0]
            except Exception as e:  # noqa: BLE001
                results[mode] = {n: ("hang", str(e).splitlines()[0][:100]) for n in names}
    modes = list(results)
    print(f"| class | case | {' | '.join(modes)} |")
    print("|---|---|" + "---|" * len(modes))
    count: Counter = Counter()
    for klass, name, _ in rows:
        cells = []
        for mode in modes:
            got = results[mode].get(name)
            if got is None:
                cells.append("n/a (needs a process group)")
                continue
            count[got[0]] += 1
            cells.append(f"{got[0]} ({got[1]})")
        print(f"| {klass} | {name} | {' | '.join(cells)} |", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(count.items())))


if __name__ == "__main__":
    main()
