"""The user paths, swept: {torch.compile backend, shard + compile(), parallelize} x {forward,
cross-entropy training, MSE training, eval between training steps, generate} on 2 gloo ranks with
the Inductor-compiled per-rank program, on the zoo Llama and three transformers models.

    python scripts/sweep_user_paths.py [--models zoo,llama,gpt2,mixtral] [--timeout 600]

Prints one row per (way, model): each mode right / clear error / WRONG / hang / n/a (a path that
has no such mode), with the worst relative error or the error's first words."""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import fxshard  # noqa: E402
from fxshard import zoo  # noqa: E402
from fxshard.runtime.launch import spawn  # noqa: E402

MODES = ["forward", "ce train", "mse train", "eval between", "generate"]
WAYS = ["backend", "shard+compile", "parallelize"]


def _build(name):
    if name == "zoo":
        torch.manual_seed(0)
        model = zoo.init_weights(zoo.Llama(), seed=0)
        (x,) = zoo.example_input(model, generator=torch.Generator().manual_seed(1))
        return model, zoo.megatron_tp_plan(), x, False
    import test_hf

    model, plan, _, x, _ = test_hf._build(name)
    model.config.use_cache = False  # shard / parallelize return tensors; the backend keeps caches
    return model, plan, x, True


class _Logits(torch.nn.Module):
    def __init__(self, model, hf):
        super().__init__()
        self.model, self.hf = model, hf

    def forward(self, x):
        out = self.model(x)
        return out.logits if self.hf else out


def _rel(a, b):
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-12))


def _loss(kind, logits, y):
    logits = logits.float()
    if kind == "mse":
        return F.mse_loss(logits, y)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _targets(kind, x, vocab):
    g = torch.Generator().manual_seed(2)
    if kind == "mse":
        return torch.randn(*x.shape, vocab, generator=g)
    y = torch.randint(0, vocab, x.shape, generator=g)
    y[0, :2] = -100
    return y


def _train(way, model, plan, x, hf, kind, dm, evals):
    """Three SGD steps through ``way`` (an eval()/no_grad forward after each where ``evals``);
    the worst relative error of losses, eval outputs and weights."""
    ref = _Logits(copy.deepcopy(model), hf).train()
    mine = _Logits(model, hf).train()
    vocab = ref(x).shape[-1]
    y = _targets(kind, x, vocab)
    if way == "backend":
        torch._dynamo.reset()
        f = torch.compile(
            mine, backend="fxshard", options={"mesh": dm, "plan": _prefixed(plan, hf)}
        )
        params = mine.parameters()
    elif way == "parallelize":
        f = fxshard.parallelize(mine, dm, _prefixed(plan, hf))
        params = f.parameters()
    else:
        return "n/a"
    opts = [torch.optim.SGD(p, lr=0.1) for p in (ref.parameters(), params)]
    errs = []
    for _ in range(3):
        losses = []
        for fn, opt in zip((ref, f), opts):
            opt.zero_grad()
            loss = _loss(kind, fn(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        errs.append(_rel(losses[1], losses[0]))
        if evals:
            for m in (ref, mine):
                m.eval()
            with torch.no_grad():
                errs.append(_rel(f(x), ref(x)))
            for m in (ref, mine):
                m.train()
    state = f.full_state_dict() if way == "parallelize" else dict(mine.named_parameters())
    errs += [_rel(state[k], v) for k, v in ref.named_parameters() if k in state]
    return max(errs)


def _prefixed(plan, hf):
    return {f"model.{k}": v for k, v in plan.items()} if isinstance(plan, dict) else plan


def _case(way, name, mode, dm):
    model, plan, x, hf = _build(name)
    model.eval()
    if mode == "forward":
        wrapped = _Logits(model, hf)
        with torch.no_grad():
            want = wrapped(x)
            if way == "backend":
                torch._dynamo.reset()
                f = torch.compile(
                    copy.deepcopy(wrapped),
                    backend="fxshard",
                    options={"mesh": dm, "plan": _prefixed(plan, hf)},
                )
                return _rel(f(x), want)
            if way == "parallelize":
                return _rel(
                    fxshard.parallelize(copy.deepcopy(wrapped), dm, _prefixed(plan, hf))(x), want
                )
            prog = fxshard.shard(wrapped, dm, _prefixed(plan, hf), example_inputs=(x,))
            fn = prog.compile()
            return _rel(fn(x), fn.output_specs[0].local_of(want, fn.coord_ints))
    if mode in ("ce train", "mse train", "eval between"):
        kind = "mse" if mode == "mse train" else "ce"
        if way == "shard+compile":
            wrapped = _Logits(model, hf)
            y = _targets(kind, x, wrapped(x).shape[-1])

            class WithLoss(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.inner = wrapped

                def forward(self, x, y):
                    return _loss(kind, self.inner(x), y)

            m = WithLoss().train()
            ref = copy.deepcopy(m)
            want = ref(x, y)
            want.backward()
            plan_ = {f"inner.{k}": v for k, v in _prefixed(plan, hf).items()}
            prog = fxshard.shard(m, dm, plan_, example_inputs=(x, y), training=True)
            fn = prog.compile()
            outs, grads = fn(x, y)
            loss = outs[0] if isinstance(outs, (tuple, list)) else outs
            err = _rel(loss, want)
            if mode == "eval between":
                return "n/a"
            from fxshard.ir import info

            specs = {info(p).fqn: info(p).spec for p in prog.placeholders if info(p).fqn}
            for fqn, p in ref.named_parameters():
                if p.grad is not None and fqn in grads:
                    err = max(err, _rel(grads[fqn], specs[fqn].local_of(p.grad, fn.coord_ints)))
            return err
        return _train(way, model, plan, x, hf, kind, dm, evals=mode == "eval between")
    if mode == "generate":
        if not hf or way != "backend":
            return "n/a"
        model.config.use_cache = True
        ref = copy.deepcopy(model)
        torch._dynamo.reset()
        model.compile(backend="fxshard", options={"mesh": dm, "plan": plan})
        mask = torch.ones_like(x)
        with torch.no_grad():
            got = model.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
            want = ref.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False)
        return 0.0 if torch.equal(got, want) else 1.0


def _worker(rank, world, way, name):
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for mode in MODES:
        try:
            r = _case(way, name, mode, dm)
            out[mode] = r if isinstance(r, str) else ("right" if r < 1e-4 else "WRONG", r)
        except Exception as e:  # noqa: BLE001 - the sweep classifies every failure
            text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            clear = text.startswith(
                (
                    "RuntimeError: fxshard",
                    "ValueError: fxshard",
                    "NotImplementedError: fxshard",
                    "TypeError: fxshard",
                )
            )
            out[mode] = ("clear error" if clear else "unclear error", text[:160])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="zoo,llama,gpt2,mixtral")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    print(f"| way | model | {' | '.join(MODES)} |")
    print("|---|---|" + "---|" * len(MODES))
    for way in args.ways.split(","):
        for name in args.models.split(","):
            try:
                res = spawn(2, _worker, way, name, timeout=args.timeout, collective_timeout=60)[0]
                cells = []
                for mode in MODES:
                    r = res[mode]
                    if isinstance(r, str):
                        cells.append(r)
                    elif r[0] in ("right", "WRONG"):
                        cells.append(f"{r[0]} ({r[1]:.1e})")
                    else:
                        cells.append(f"{r[0]}: {r[1]}")
            except Exception as e:  # noqa: BLE001
                cells = [f"hang / crash: {str(e).splitlines()[0][:80]}"] * len(MODES)
            print(f"| {way} | {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
