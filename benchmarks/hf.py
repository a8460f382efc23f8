"""Hugging Face models under their own ``tp_plan``: fxshard's backend against HF's own tensor
parallelism, same run, same weights, same inputs.

Per architecture (tiny random-init transformers models built from config, nothing downloaded),
on ``--ranks`` gloo ranks of this machine (CPU, loopback):

* **HF TP + torch.compile**: transformers' ``apply_tensor_parallelism(model, mesh)`` (the styles
  its ``from_pretrained(tp_plan="auto")`` installs: DTensor parameters and forward hooks), then
  ``torch.compile`` (Inductor);
* **fxshard**: ``torch.compile(model, backend="fxshard", options={"mesh": mesh,
  "plan": model.tp_plan})`` (default options: the KV cache stays as each rank's heads between
  decode steps, one program for every cache length).

Columns: collectives of one forward step (fxshard: its per-rank program; HF: counted at dispatch
on the compiled step's eager twin, the same collectives), the same for the default call
(``model(x)``, which makes and returns a ``DynamicCache``), forward step time (median of
``--repeats`` calls, a barrier before each, the variants alternating; ``use_cache=False``), whether
the logits equal single device, greedy ``generate`` tokens/s (``--tokens`` new tokens, with
transformers' default cache (``DynamicCache``, growing by a token per step) and with a static
cache; two untimed generations compile every program, then the median of three timed ones,
prefill included) and its median decode step (time between tokens, from a streamer), the
collectives and bytes one decode step moves (fxshard: its last decode program; HF: counted at
dispatch), and how many programs fxshard built for the generations (prefill + decode programs,
whatever the length).
The first forward's time is the compile (first call). The training table: ``model(x,
labels=x).loss.backward()`` and an AdamW step in train mode (the model makes and returns its
cache, as users call it): collectives per step, step time, the first step's time (compile), and
whether the losses of the first steps equal single device's, for the backend and for
``fxshard.parallelize(model, mesh, tp_plan)`` (DTensor parameters: gradients stay sharded; called
``pm(input_ids=x, labels=x)`` with ``use_cache=False``, as it returns no cache object).
Ratios are fxshard / HF. On 2 cores
the ranks share the CPUs: quote medians and ratios.

    python benchmarks/hf.py [--ranks 4] [--archs llama,qwen3,...] [--batch 4] [--seq 64]
                            [--forward-only] [--no-train]
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time

import torch
from decode import CollectiveBytes

import fxshard

SIZE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=1024,
            max_position_embeddings=256, num_attention_heads=8, num_key_value_heads=4)  # fmt: skip
MOE = dict(num_experts_per_tok=2, head_dim=32)
HF, FX = "HF TP + torch.compile", "fxshard"
PAR = "fxshard.parallelize"  # sharded parameters (training table)
CACHES = ("dynamic", "static")
GENERATIONS = 3  # timed generations per variant and cache (medians)


def build(name):
    import transformers as T

    torch.manual_seed(0)
    make = {
        "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**SIZE)),
        "qwen2": lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**SIZE)),
        "olmo2": lambda: T.Olmo2ForCausalLM(T.Olmo2Config(**SIZE)),
        "qwen3": lambda: T.Qwen3ForCausalLM(T.Qwen3Config(**SIZE, head_dim=32)),
        "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(**SIZE, head_dim=32)),
        "llama_eager": lambda: T.LlamaForCausalLM(
            T.LlamaConfig(**SIZE, attn_implementation="eager")
        ),
        "mixtral": lambda: T.MixtralForCausalLM(
            T.MixtralConfig(**SIZE, **MOE, num_local_experts=4)
        ),
        "qwen3_moe": lambda: T.Qwen3MoeForCausalLM(
            T.Qwen3MoeConfig(**SIZE, **MOE, moe_intermediate_size=128, num_experts=4)
        ),
        # fused qkv / gate_up projections, gathered and split again by their plan
        "phi3": lambda: T.Phi3ForCausalLM(T.Phi3Config(**SIZE, pad_token_id=0, eos_token_id=1)),
        "gemma2": lambda: T.Gemma2ForCausalLM(
            T.Gemma2Config(**SIZE, head_dim=32, pad_token_id=0, eos_token_id=1, bos_token_id=2)
        ),
    }[name]
    return make().eval()


class Stamps:
    """A generate() streamer that only notes when each token arrives: the prompt, then one call
    per generated token, so the gaps after the first are decode steps."""

    def __init__(self):
        self.at = []

    def put(self, value):
        self.at.append(time.perf_counter())

    def end(self):
        pass

    def decode_step(self) -> float:
        gaps = [b - a for a, b in zip(self.at[1:], self.at[2:])]
        return statistics.median(gaps) if gaps else float("nan")


def train_rows(dm, archs, x, repeats, steps=3):
    """Per architecture: a training step (``model(x, labels=x).loss.backward()``, AdamW, train
    mode: the model makes and returns its cache, as users call it) under HF TP +
    ``torch.compile`` and under the fxshard backend: the first step's time (compile), the median
    of ``repeats`` more (alternating), the collectives of one step (fxshard: its training
    programs, forward and backward; HF: counted at dispatch on its eager twin), and whether every
    step's loss equals single device's."""
    import torch.distributed as dist
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from fxshard.backend import compiled_programs, programs_built

    out = {}
    for name in archs:
        base = build(name).train()
        torch._dynamo.reset()
        ref = copy.deepcopy(base)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        hf_eager = apply_tensor_parallelism(copy.deepcopy(base), dm)
        counter = CollectiveBytes()
        with counter:
            hf_eager(x, labels=x).loss.backward()
        hf = apply_tensor_parallelism(copy.deepcopy(base), dm)
        fx = copy.deepcopy(base)
        # the sharded-parameter path, called the same way, without the cache (it returns none)
        par = copy.deepcopy(base)
        par.config.use_cache = False
        pm = fxshard.parallelize(par, dm, base.tp_plan)
        models = {
            HF: torch.compile(hf),
            FX: torch.compile(fx, backend="fxshard", options={"mesh": dm, "plan": base.tp_plan}),
            PAR: pm,
        }
        opts = {HF: torch.optim.AdamW(hf.parameters(), lr=1e-3),
                FX: torch.optim.AdamW(fx.parameters(), lr=1e-3),
                PAR: torch.optim.AdamW(pm.parameters(), lr=1e-3)}  # fmt: skip
        row = {k: dict(times=[], same=True) for k in models}
        n0 = programs_built()
        for step in range(1 + repeats):
            ref_opt.zero_grad()
            want = ref(x, labels=x).loss
            want.backward()
            ref_opt.step()
            for label, m in models.items():
                if "error" in row[label]:
                    continue
                dist.barrier()
                t = time.perf_counter()
                opts[label].zero_grad()
                try:
                    loss = m(input_ids=x, labels=x).loss
                    loss.backward()
                except Exception as e:  # (every rank fails alike: a compile error) the row says
                    row[label]["error"] = f"{type(e).__name__}: {str(e).splitlines()[-1][:80]}"
                    print(f"{name} {label}: {row[label]['error']}", file=sys.stderr)
                    continue
                opts[label].step()
                dt = time.perf_counter() - t
                if step == 0:
                    row[label]["first_s"] = dt
                else:
                    row[label]["times"].append(dt)
                if step < steps:  # AdamW drifts apart in rounding after a few steps
                    close = torch.allclose(loss.detach(), want.detach(), rtol=1e-4, atol=1e-4)
                    row[label]["same"] &= bool(close)
        row[HF]["calls"] = len(counter.calls)
        row[FX]["calls"] = sum(len(p.collectives()) for p in compiled_programs(n0))
        row[PAR]["calls"] = sum(len(p.collectives()) for k, (p, _) in pm._programs.items() if k[0])
        for label in models:
            times = row[label].pop("times")
            row[label]["step_ms"] = 1e3 * statistics.median(times) if times else math.nan
            row[label].setdefault("first_s", math.nan)
        out[name] = row
    return out


def worker(rank, world, archs, batch, seq, tokens, repeats, generate=True, train=True):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    from fxshard.backend import compiled_programs, programs_built

    dm = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, SIZE["vocab_size"], (batch, seq), generator=g)
    prompt = x[:, :8]
    gen_kws = {
        cache: dict(
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
            **({"cache_implementation": "static"} if cache == "static" else {}),
        )  # fmt: skip
        for cache in CACHES
    }
    out = {}
    for name in archs:
        base = build(name)
        with torch.no_grad():
            want = base(x, use_cache=False).logits
            want_tokens = {c: base.generate(prompt, **kw) for c, kw in gen_kws.items()}
        row = {}
        torch._dynamo.reset()
        hf = apply_tensor_parallelism(copy.deepcopy(base), dm)
        counter = CollectiveBytes()
        with torch.no_grad(), counter:
            hf(x, use_cache=False)
        hf_calls = len(counter.calls)
        with torch.no_grad(), CollectiveBytes() as c:  # the default call: it returns its cache
            hf(x)
        hf_default = len(c.calls)
        hf_c = torch.compile(hf)
        fx_model = copy.deepcopy(base)
        # by identity (held, so no id is reused): earlier architectures' graphs may be dropped
        before = list(compiled_programs())
        fx_c = torch.compile(
            fx_model, backend="fxshard", options={"mesh": dm, "plan": fx_model.tp_plan}
        )
        variants = {HF: hf_c, FX: fx_c}
        times = {k: [] for k in variants}
        same = {}
        with torch.no_grad():
            for label, m in variants.items():  # first calls: compile
                dist.barrier()
                t = time.perf_counter()
                got = m(x, use_cache=False).logits
                row[label] = dict(first_s=time.perf_counter() - t)
                same[label] = bool(torch.allclose(got, want, rtol=1e-4, atol=1e-4))
            fx_progs = [p for p in compiled_programs() if not any(p is q for q in before)]
            fx_calls = sum(len(p.collectives()) for p in fx_progs)
            n0 = programs_built()
            fx_c(x)  # the default call (its DynamicCache comes back as each rank's heads)
            fx_default = sum(len(p.collectives()) for p in compiled_programs(n0))
            for _ in range(repeats):
                for label, m in variants.items():
                    dist.barrier()
                    t = time.perf_counter()
                    m(x, use_cache=False)
                    times[label].append(time.perf_counter() - t)
            for label, cache in [(v, c) for c in CACHES for v in variants if generate]:
                gen_kw = gen_kws[cache]
                # each variant's graphs on their own: they share the model's code objects, whose
                # dynamo cache entries (at most 8 each) would otherwise run out
                torch._dynamo.reset()
                if label == HF:
                    model = hf
                    # one decode step's collectives, counted eagerly: generate 2 tokens less 1
                    vars(model).pop("forward", None)  # the eager forward (a cache's run before)
                    counted = []
                    for n in (1, 2):
                        with CollectiveBytes() as c:
                            model.generate(prompt, **{**gen_kw, "max_new_tokens": n})
                        counted.append(c)
                    decode = (
                        len(counted[1].calls) - len(counted[0].calls),
                        counted[1].bytes - counted[0].bytes,
                    )
                    model.forward = torch.compile(model.forward)
                    programs = None
                    for _ in range(2):  # compiles prefill and decode (as below)
                        model.generate(prompt, **gen_kw)
                else:
                    model = copy.deepcopy(base)
                    model.compile(backend="fxshard", options={"mesh": dm, "plan": base.tp_plan})
                    n0 = programs_built()
                    for _ in range(2):  # compiles prefill and decode (as below)
                        model.generate(prompt, **gen_kw)
                    new = compiled_programs(n0)
                    programs = len(new)
                    calls = new[-1].collectives()  # the last program built: a decode step
                    decode = (len(calls), sum(c.bytes for c in calls))
                gens, decodes = [], []
                for _ in range(GENERATIONS):  # one generation's time is noise on 2 cores
                    dist.barrier()
                    t = time.perf_counter()
                    stamps = Stamps()
                    got_tokens = model.generate(prompt, streamer=stamps, **gen_kw)
                    gens.append(time.perf_counter() - t)
                    decodes.append(stamps.decode_step())
                gen_s = statistics.median(gens)
                r = row.setdefault(label, {})
                r[cache] = dict(
                    same=same[label] and bool(torch.equal(got_tokens, want_tokens[cache])),
                    tokens_s=batch * tokens / gen_s,
                    decode_ms=1e3 * statistics.median(decodes),
                    decode_calls=decode[0],
                    decode_bytes=decode[1],
                    programs=programs,
                )
        for label in variants:
            row.setdefault(label, {})["step_ms"] = 1e3 * statistics.median(times[label])
            row[label]["same"] = same[label]
        row[HF]["calls"] = hf_calls
        row[FX]["calls"] = fx_calls
        row[HF]["calls_default"] = hf_default
        row[FX]["calls_default"] = fx_default
        out[name] = row
    if train:
        out["train"] = train_rows(dm, archs, x, repeats)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--archs", default="llama,qwen3,mistral,llama_eager,mixtral,qwen3_moe")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--forward-only", action="store_true", help="no generate() tables")
    ap.add_argument("--no-train", action="store_true", help="no training-step table")
    args = ap.parse_args()
    from fxshard.runtime.launch import spawn

    archs = args.archs.split(",")
    per_rank = spawn(args.ranks, worker, archs, args.batch, args.seq, args.tokens, args.repeats,
                     not args.forward_only, not args.no_train, timeout=3000)  # fmt: skip
    hf, fx = HF, FX

    def med(name, label, key, cache=None):
        return statistics.median(
            (r[name][label][cache] if cache else r[name][label])[key] for r in per_rank
        )

    print(
        f"HF models under their tp_plan: hidden {SIZE['hidden_size']}, "
        f"{SIZE['num_hidden_layers']} layers, 8 heads / 4 kv heads, batch {args.batch}, seq "
        f"{args.seq}; {args.ranks} gloo ranks (CPU); medians over ranks of {args.repeats} steps; "
        f"generate: {args.tokens} greedy tokens"
    )
    print(
        f"{'arch':12} {'collectives HF/fx':>17} {'default call':>12} {'step ms HF':>10} "
        f"{'step ms fx':>10} {'fx/HF':>6} {'same HF/fx':>10} {'first call s HF/fx':>18} "
        f"{'fx/HF':>6}"
    )
    for name in archs:
        r0 = per_rank[0][name]
        same = [all(r[name][k]["same"] for r in per_rank) for k in (hf, fx)]
        first = [med(name, k, "first_s") for k in (hf, fx)]
        default = f"{r0[hf]['calls_default']}/{r0[fx]['calls_default']}"
        print(
            f"{name:12} {r0[hf]['calls']:>8d}/{r0[fx]['calls']:<8d} {default:>12} "
            f"{med(name, hf, 'step_ms'):10.1f} {med(name, fx, 'step_ms'):10.1f} "
            f"{med(name, fx, 'step_ms') / med(name, hf, 'step_ms'):6.2f} "
            f"{str(same[0]):>5}/{str(same[1]):<5} {first[0]:8.1f}/{first[1]:<9.1f} "
            f"{first[1] / first[0]:6.2f}"
        )
    if not args.no_train:
        print()
        print(
            "training step (labels=, AdamW, train mode: the model returns its cache): collectives "
            "per step (HF: eager twin; fx: its programs), step ms (median), first step s "
            "(compile), losses equal to single device"
        )
        print(
            "fx: the backend (global parameters: their gradients gathered); par: "
            "fxshard.parallelize (DTensor parameters, use_cache=False), called alike"
        )
        print(
            f"{'arch':12} {'collectives HF/fx/par':>21} {'step ms HF':>10} {'fx':>6} {'par':>6} "
            f"{'fx/HF':>6} {'par/HF':>6} {'first s HF/fx/par':>18} {'same HF/fx/par':>15}"
        )
        for name in archs:
            rows = [r["train"][name] for r in per_rank]
            r0 = rows[0]
            ks = (hf, fx, PAR)
            ms = [statistics.median(r[k]["step_ms"] for r in rows) for k in ks]
            first = [statistics.median(r[k]["first_s"] for r in rows) for k in ks]
            same = [
                "error" if any("error" in r[k] for r in rows) else all(r[k]["same"] for r in rows)
                for k in ks
            ]
            calls = "/".join(str(r0[k]["calls"]) for k in ks)
            print(
                f"{name:12} {calls:>21} {ms[0]:10.1f} {ms[1]:6.1f} {ms[2]:6.1f} "
                f"{ms[1] / ms[0]:6.2f} {ms[2] / ms[0]:6.2f} "
                f"{'/'.join(f'{f:.1f}' for f in first):>18} "
                f"{'/'.join(str(x) for x in same):>15}"
            )
    for cache in CACHES if not args.forward_only else ():
        print()
        print(
            f"generate, {cache} cache: per variant (HF TP + torch.compile | fxshard): tok/s, "
            "median decode step ms (ratio to HF), one decode step's collectives / bytes, same "
            "tokens; fxshard's programs"
        )
        for name in archs:
            r0 = per_rank[0][name]
            cells = []
            for k in (hf, fx):
                ratio = med(name, k, "decode_ms", cache) / med(name, hf, "decode_ms", cache)
                same = all(r[name][k][cache]["same"] for r in per_rank)
                c = r0[k][cache]
                cells.append(
                    f"{med(name, k, 'tokens_s', cache):6.1f} "
                    f"{med(name, k, 'decode_ms', cache):5.1f} ({ratio:4.2f}) "
                    f"{c['decode_calls']:>2d} / {c['decode_bytes']:>6d} B {str(same):5}"
                )
            print(f"{name:12} " + " | ".join(cells) + f" | {r0[fx][cache]['programs']} programs")


if __name__ == "__main__":
    main()
