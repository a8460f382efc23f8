"""Every causal LM of the installed transformers that ships a ``base_model_tp_plan``, tiny and
built from config (nothing downloaded), on 2 simulated ranks with the model's own plan, against
single device, through each way in:

- ``forward``: ``torch.compile(model, backend="fxshard", ...)`` called the default way
  (``model(input_ids=ids)``: a cache is made and returned), logits compared;
- ``train (backend)``: ``model(input_ids=ids, labels=labels).loss.backward()`` through the
  backend (a few labels -100), the loss and every gradient compared;
- ``train (shard)``: the same loss through ``fxshard.shard(..., training=True)``, the capture
  ``fxshard.parallelize`` trains with.

    python scripts/sweep_hf_archs.py [--only llama,mixtral] [--timeout 300] [--jobs 2]

Against another transformers release: ``PYTHONPATH=.venv-transformers5.25.0 python ...`` after
``make compat-hf``.

Each architecture runs in its own interpreter (a crash or hang costs one row). Prints one
markdown row per architecture (right / clear error / WRONG / unclear error / hang, with the
worst relative error or the error's first words) and the totals per column. A multimodal
model whose text model is its own entry (``gemma3`` and ``gemma3_text``) is swept as that
entry."""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import copy
import json
import os
import subprocess
import sys
import time

COLUMNS = ["forward", "train (backend)", "train (shard)"]
# transformers' config attributes set small wherever a config has them (dims divisible by 2
# ranks, 2 layers, MoE with 4 experts, MLA ranks small)
TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=128,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, n_shared_experts=1,
    first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, sliding_window=8,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=8,
    linear_value_head_dim=8, num_kv_shared_layers=0, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip


def _text_types():
    """(model type, its causal-LM class name) of every type with a tp_plan, multimodal types
    whose text model has an entry of its own left out."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            cfg = CONFIG_MAPPING[mt]()
        except Exception:  # noqa: BLE001 - a config that needs arguments has no default plan
            continue
        try:
            text = cfg.get_text_config()
        except ValueError:  # several text configs (an encoder-decoder): not a plain causal LM
            continue
        if not getattr(text, "base_model_tp_plan", None):
            continue
        if text is not cfg and f"{mt}_text" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        out.append((mt, cls))
    return out


def _has(cfg, k) -> bool:
    try:  # some configs raise other errors than AttributeError for per-layer attributes
        getattr(cfg, k)
        return True
    except Exception:  # noqa: BLE001
        return False


def _tiny_model(mt):
    """The model type's causal LM, tiny: the first of a few configs (all of TINY with every kind
    of layer once; without the layer types; at the default depth) that builds and runs a
    forward on single device. Raises the first variant's error where none does."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    default = CONFIG_MAPPING[mt]()
    text = default.get_text_config()
    kw = {k: v for k, v in TINY.items() if _has(text, k)}
    kw.update({k: 0.0 for k in vars(text) if k.endswith(("dropout", "pdrop"))})
    if _has(text, "rotary_dim"):  # GPT-J style partial rotary: within the 8-wide heads
        kw["rotary_dim"] = 4
    if "qk_rope_head_dim" in kw:  # MLA: the rotary head is the head transformers rotates
        kw.pop("head_dim", None)
        if "num_key_value_heads" in kw:  # MLA's keys have a head per query head
            kw["num_key_value_heads"] = kw["num_attention_heads"]
    variants = []
    layer_types = getattr(text, "layer_types", None) if _has(text, "layer_types") else None
    if isinstance(layer_types, list) and "layer_types" in vars(text):  # every kind, once
        kinds = list(dict.fromkeys(layer_types))
        lt = (kinds * 2)[: max(2, len(kinds))]
        variants.append({**kw, "layer_types": lt, "num_hidden_layers": len(lt)})
    variants.append(kw)
    # hybrids whose attention layers sit at given depths (Jamba's period, Bamba's indices): the
    # default depth, everything else tiny
    variants.append({k: v for k, v in kw.items() if k != "num_hidden_layers"})
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    first = None
    for v in variants:
        try:
            cfg = CONFIG_MAPPING[mt](**v) if text is default else CONFIG_MAPPING[mt](text_config=v)
            torch.manual_seed(0)
            model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt])(cfg)
            model = model.float().eval()
            with torch.no_grad():
                copy.deepcopy(model)(input_ids=ids)
            return model
        except Exception as e:  # noqa: BLE001 - the next variant
            first = first or e
    raise first


def _rel(a, b):
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-6))


def _one(mt):
    """Run one architecture; return {column: [verdict, detail]}."""
    import torch

    import fxshard

    mesh = fxshard.MeshSpec((2,), ("tp",))
    try:
        model = _tiny_model(mt)
    except Exception as e:  # noqa: BLE001
        why = f"no tiny config runs on single device: {type(e).__name__}: {_first(e)}"
        return {c: ["n/a", why[:200]] for c in COLUMNS}
    plan = model.tp_plan
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :2] = -100
    out = {}

    def run(col, fn):
        try:
            err = fn()
            out[col] = ["right" if err < 1e-4 else "WRONG", f"{err:.1e}"]
        except Exception as e:  # noqa: BLE001 - every failure is classified
            text = f"{type(e).__name__}: {_first(e)}"
            out[col] = ["clear error" if "fxshard" in text else "unclear error", text[:200]]

    def forward():
        ref = copy.deepcopy(model)
        torch._dynamo.reset()
        cm = torch.compile(
            copy.deepcopy(model),
            backend="fxshard",
            options={"mesh": mesh, "plan": plan, "simulate": True},
        )
        with torch.no_grad():
            return _rel(cm(input_ids=ids).logits, ref(input_ids=ids).logits)

    def reference():
        ref = copy.deepcopy(model).train()
        torch.manual_seed(1234)  # models that sample in training (PhiMoE's router) draw alike
        loss = ref(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        return loss, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    def train_backend():
        want, grads = reference()
        mine = copy.deepcopy(model).train()
        torch._dynamo.reset()
        cm = torch.compile(
            mine, backend="fxshard", options={"mesh": mesh, "plan": plan, "simulate": True}
        )
        torch.manual_seed(1234)
        loss = cm(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        errs = [_rel(loss, want)]
        errs += [_rel(p.grad, grads[n]) for n, p in mine.named_parameters() if n in grads]
        return max(errs)

    def train_shard():
        want, grads = reference()

        class WithLabels(torch.nn.Module):
            def __init__(self, m):
                super().__init__()
                self.model = m

            def forward(self, x, y):
                return self.model(input_ids=x, labels=y, use_cache=False).loss

        mine = WithLabels(copy.deepcopy(model).train())
        prog = fxshard.shard(
            mine,
            mesh,
            {f"model.{k}": v for k, v in plan.items()},
            example_inputs=(ids, labels),
            training=True,
        )
        torch.manual_seed(1234)
        loss, got = prog.simulate(ids, labels)
        errs = [_rel(loss, want)]
        errs += [_rel(got[f"model.{n}"], g) for n, g in grads.items() if f"model.{n}" in got]
        return max(errs)

    run("forward", forward)
    run("train (backend)", train_backend)
    run("train (shard)", train_shard)
    return out


def _first(e):
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[0].strip() if lines else ""


def _run_one(mt, timeout, jobs):
    """One architecture in its own interpreter: (results, seconds)."""
    t0 = time.time()
    try:
        p = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--one", mt],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // jobs))},
        )
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if line:
            res = json.loads(line[-1][7:])
        else:
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:160]
            res = {c: ["unclear error", f"crash: {tail}"] for c in COLUMNS}
    except subprocess.TimeoutExpired:
        res = {c: ["hang", f"over {timeout:.0f} s"] for c in COLUMNS}
    return res, time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated model types (default: all)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per architecture")
    ap.add_argument("--jobs", type=int, default=1, help="architectures run at once")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import logging

        logging.disable(logging.WARNING)
        print("RESULT " + json.dumps(_one(args.one)), flush=True)
        return
    import transformers

    types = _text_types()
    if args.only:
        keep = set(args.only.split(","))
        types = [t for t in types if t[0] in keep]
    print(f"transformers {transformers.__version__}: {len(types)} causal LMs with a tp_plan\n")
    print(f"| model type | {' | '.join(COLUMNS)} |")
    print("|---|" + "---|" * len(COLUMNS))
    totals = {c: collections.Counter() for c in COLUMNS}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        runs = [pool.submit(_run_one, mt, args.timeout, args.jobs) for mt, _ in types]
        for (mt, _), run in zip(types, runs):
            res, secs = run.result()
            for c in COLUMNS:
                totals[c][res[c][0]] += 1
            cells = [v if v == "right" else f"{v}: {d}" for v, d in (res[c] for c in COLUMNS)]
            cells = [c.replace("|", "/") for c in cells]
            print(f"| {mt} | {' | '.join(cells)} | <!-- {secs:.0f} s -->", flush=True)
    print()
    for c in COLUMNS:
        print(f"{c}: " + ", ".join(f"{n} {k}" for k, n in totals[c].most_common()))


if __name__ == "__main__":
    main()
