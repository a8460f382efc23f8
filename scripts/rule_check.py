"""Check fxshard's sharding rules over all of torch's OpInfo samples (``op_db``).

    python scripts/rule_check.py                       # summary table (about a minute)
    python scripts/rule_check.py --write               # ... and rewrite fxshard/rules/excluded.json
    python scripts/rule_check.py --merge --write       # on another torch release: add what it finds
    python scripts/rule_check.py --only cumsum,squeeze # some OpInfos

Every ATen call the first samples of each OpInfo make (sizes made even, plus each call with its
dims written negatively), and of training steps (the zoo's Llama and ConvNet; with transformers
installed, GPT-2 and Mixtral built from tiny configs: LayerNorm, Conv1D, grouped matmuls; ``--only
"training steps"`` for these alone), is checked by ``fxshard.runtime.rulecheck``: every strategy
fxshard would use (from replicated inputs and from each input sharded on each dim), on simulated
meshes (2,) and (2, 2), against single device.  Wrong strategies are excluded;
``--write`` commits the exclusions (and this run's summary) to ``fxshard/rules/excluded.json``,
which fxshard loads at import.  A strategy's meaning does not depend on the torch release (only
which strategies DTensor's rules propose does), so ``--merge`` run under another release adds the
wrong strategies its rules propose to the table, for every release.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import signal
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fxshard.rules import dims, excluded  # noqa: E402
from fxshard.runtime import rulecheck  # noqa: E402


class _Timeout(BaseException):  # not an Exception: rules catch those
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _hf_models() -> list:
    """GPT-2 (Conv1D, LayerNorm, gelu_new, tied embeddings) and Mixtral (top-2 routing, grouped
    matmuls, GQA), tiny and random, where transformers is installed."""
    try:
        import transformers
    except ImportError:
        return []
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    mixtral = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
        max_position_embeddings=32,
    )  # fmt: skip
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return [
        (transformers.GPT2LMHeadModel(gpt2), (ids,)),
        (transformers.MixtralForCausalLM(mixtral), (ids,)),
    ]


def training_step_calls(samples: int) -> list:
    """The ATen calls of training steps, forward and backward: op_db's samples call forward ops,
    these reach the backward ones (convolution_backward, native_layer_norm_backward, index_put)."""
    from fxshard import zoo

    models = []
    for model in (zoo.Llama(zoo.LlamaConfig()), zoo.ConvNet()):
        model = zoo.init_weights(model)
        models.append((model, zoo.example_input(model, generator=torch.Generator().manual_seed(1))))
    calls = []
    for model, inputs in models + _hf_models():

        def step(model=model, inputs=inputs):
            out = model(*inputs)
            out = getattr(out, "logits", out)
            out.float().pow(2).mean().backward()

        calls += rulecheck.unique_calls(rulecheck.record_calls(step), per_op=samples)
    return calls


def calls_of(opinfo, samples: int, negative: bool) -> list:
    calls = opinfo if isinstance(opinfo, list) else rulecheck.opinfo_calls(opinfo, samples)
    if negative:
        more = []
        for op, a, k in calls:
            if op.name().startswith("aten::_fft"):  # torch's FFT kernels crash on dims < 0
                continue
            na, nk = dims.negate_dims(op, a, k)
            if (na, nk) != (tuple(a), dict(k)):
                more.append((op, na, nk))
        calls += more
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated OpInfo names")
    ap.add_argument("--samples", type=int, default=3, help="samples per OpInfo")
    ap.add_argument("--per-op", type=int, default=6, help="distinct calls checked per ATen op")
    ap.add_argument("--timeout", type=int, default=60, help="seconds per OpInfo")
    ap.add_argument("--no-negative-dims", action="store_true")
    ap.add_argument("--write", action="store_true", help="rewrite fxshard/rules/excluded.json")
    ap.add_argument(
        "--merge", action="store_true", help="keep the table's exclusions (another torch release)"
    )
    ap.add_argument(
        "--raw-dims", action="store_true", help="rules see dims as written (what normalising fixes)"
    )
    ap.add_argument("--json", default="", help="write the report here too")
    opt = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("fxshard").setLevel(logging.ERROR)  # the summary says it all
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    from fxshard._torch import opinfo_db

    op_db = opinfo_db()
    if opt.raw_dims:
        import fxshard.rules

        fxshard.rules.normalize_dims = lambda op, a, k: (tuple(a), dict(k))
    before = excluded.excluded() if opt.merge else {}
    excluded.reset()  # check from nothing: the table this run writes is complete by itself
    want = set(filter(None, opt.only.split(",")))
    start = time.time()
    report = rulecheck.RuleReport()
    counted: collections.Counter = collections.Counter()
    timeouts, opinfos = [], 0
    for opinfo in [*op_db, "training steps"]:
        if opinfo == "training steps":
            if want and opinfo not in want:
                continue
            name, opinfo = opinfo, training_step_calls(opt.samples)
        else:
            name = opinfo.name + (
                f".{opinfo.variant_test_name}" if opinfo.variant_test_name else ""
            )
            if want and opinfo.name not in want and name not in want:
                continue
        opinfos += 1
        signal.alarm(opt.timeout)
        try:
            calls = calls_of(opinfo, opt.samples, not opt.no_negative_dims)
            todo = []
            for op, a, k in rulecheck.unique_calls(calls, per_op=opt.per_op):
                if counted[op] < opt.per_op:
                    counted[op] += 1
                    todo.append((op, a, k))
            if todo:
                report.merge(rulecheck.check_calls(todo, exclude=True))
        except _Timeout:
            timeouts.append(name)
        finally:
            signal.alarm(0)
    elapsed = time.time() - start
    by_op = collections.defaultdict(list)
    for w in report.wrong:
        by_op[w.op].append(w)
    summary = {
        "torch": torch.__version__,
        "opinfos": opinfos,
        "aten_ops": len(report.ops),
        "call_mesh_pairs": report.calls,
        "strategies_checked": report.checked,
        "strategies_wrong": len(report.wrong),
        "exclusions": len(report.excluded),
        "ops_with_exclusions": len(by_op),
        "skipped": report.skipped,
        "timeouts": timeouts,
        "seconds": round(elapsed),
    }
    print(f"## Rule check over op_db (torch {torch.__version__})\n")
    print("| OpInfos | ATen ops | (call, mesh) pairs | strategies checked | wrong | excluded |")
    print("|---|---|---|---|---|---|")
    print(
        f"| {opinfos} | {len(report.ops)} | {report.calls} | {report.checked} | "
        f"{len(report.wrong)} | {len(report.excluded)} |\n"
    )
    print("| op | wrong strategies | why (first) |")
    print("|---|---|---|")
    for op, ws in sorted(by_op.items(), key=lambda kv: -len(kv[1])):
        print(f"| `{op}` | {len(ws)} | {ws[0].strategy}: {ws[0].why[:90]} |")
    print(f"\nskipped: {dict(report.skipped)}; timeouts: {timeouts}; {elapsed:.0f} s")
    if opt.write:
        path = os.path.join(ROOT, "fxshard", "rules", "excluded.json")
        table = excluded.excluded()
        for op, keys in table.items():  # what only this release's rules propose, marked so
            for key in keys:
                if before and key not in before.get(op, {}):
                    keys[key] = f"[torch {torch.__version__}] {keys[key]}"
        for op, keys in before.items():
            table.setdefault(op, {}).update(keys)
        excluded.write(path, table, summary, merge=opt.merge)
        print(f"wrote {path}")
    if opt.json:
        with open(opt.json, "w") as f:
            json.dump({"summary": summary, "wrong": [w.__dict__ for w in report.wrong]}, f)


if __name__ == "__main__":
    main()
