"""One rank's compiled step on an accelerator: fxshard vs DTensor + torch.compile, Inductor codegen
check.

Runs in ONE process as rank 0 of a ``fake`` process group of ``--world`` ranks (torch's testing
backend: collectives are accepted and return at once without moving data), so on a single GPU it
measures what one rank's compiled program costs apart from the network: Inductor's generated
kernels, the local shapes, and the collectives' launch/bookkeeping.  Numerics are not checked here
(the fake collectives do not reduce); the CPU test suite checks them on simulated and gloo ranks.

For each of forward (inference) and training (fwd + bwd + AdamW), Megatron TP plan on a
``(world,)`` mesh: compile time, median step time (CUDA-synchronised), collectives in the graphs
Inductor compiled, and, for fxshard, whether Inductor's output code holds Triton kernels and the
functional collectives; and the memory high-water mark (``torch.cuda.max_memory_allocated``) of
each variant against DTensor's.  The generated code is written under ``--dump`` when given.

What one GPU under a fake process group does not measure: communication (the collectives return at
once, moving nothing), its overlap with compute, and anything about the other ranks.

    python benchmarks/gpu_step.py [--device cuda] [--world 8] [--layers 4] [--dim 2048] [--seq 2048]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from train_step import CollectiveCounter, WithLoss  # this folder's training benchmark


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, steps):
    out = []
    for _ in range(steps):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out)


class CodeCapture:
    """Collects Inductor's generated source (its output-code log) while compiling."""

    def __init__(self):
        self.chunks = []

    def __enter__(self):
        import logging

        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.chunks.append(record.getMessage())
        self.logger = logging.getLogger("torch._inductor.codecache")
        self.old = self.logger.level
        self.logger.addHandler(self.handler)
        torch._logging.set_logs(output_code=True)
        return self

    def __exit__(self, *exc):
        torch._logging.set_logs()
        self.logger.removeHandler(self.handler)
        return False

    @property
    def text(self):
        return "\n".join(self.chunks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--modes", nargs="+", default=["forward", "train"])
    ap.add_argument("--dump", default=None, help="folder for Inductor's generated code")
    args = ap.parse_args()

    import torch._inductor.config as inductor_config
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxshard
    from fxshard import zoo

    # not pip-installed (no entry point): register by hand
    if "fxshard" not in torch._dynamo.list_backends():
        from fxshard.backend import fxshard_backend

        torch._dynamo.register_backend(name="fxshard")(fxshard_backend)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    dm = init_device_mesh(device.type, (args.world,), mesh_dim_names=("tp",))
    cfg = zoo.LlamaConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads // 2,
        ffn_hidden=int(3.5 * args.dim),
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    torch.manual_seed(0)
    base = zoo.init_weights(zoo.Llama(cfg), seed=0).to(device=device, dtype=dtype)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    plan = zoo.megatron_tp_plan()
    print(
        f"device {torch.cuda.get_device_name() if device.type == 'cuda' else device}, torch "
        f"{torch.__version__}; "
        f"rank 0 of {args.world} fake ranks; Llama {args.layers} layers, hidden {args.dim}, "
        f"{args.heads} heads, "
        f"batch {args.batch} x seq {args.seq}, {args.dtype}; Megatron TP plan"
    )
    rows = []
    print(
        f"{'mode':8} {'variant':26} {'step ms':>9} {'vs DTensor':>10} {'compile s':>9} "
        f"{'collectives':>11} "
        f"{'kernels':>8} {'coll. calls in code':>19} {'peak GiB':>8} {'vs DTensor':>10}"
    )
    for mode in args.modes:
        variants = {}
        if mode == "forward":
            variants["DTensor + torch.compile"] = lambda: torch.compile(
                parallelize_module(copy.deepcopy(base), dm, plan)
            )
            variants["fxshard (backend)"] = lambda: torch.compile(
                copy.deepcopy(base), backend="fxshard", options={"mesh": dm, "plan": plan}
            )
        else:
            tplan = {"model." + k: v for k, v in plan.items()}
            variants["DTensor + torch.compile"] = lambda tplan=tplan: torch.compile(
                parallelize_module(WithLoss(copy.deepcopy(base)), dm, tplan)
            )
            variants["fxshard (parallelize)"] = lambda tplan=tplan: fxshard.parallelize(
                WithLoss(copy.deepcopy(base)), dm, tplan
            )
        for label, make in variants.items():
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            counter = CollectiveCounter()
            t = time.perf_counter()
            fn = make()
            if mode == "forward":

                def step(fn=fn):
                    with torch.no_grad():
                        return fn(tokens)
            else:
                # DTensor and plain parameters in separate groups: foreach kernels cannot mix them
                from torch.distributed.tensor import DTensor

                params = list(fn.parameters())
                groups = [
                    g
                    for g in (
                        [p for p in params if isinstance(p, DTensor)],
                        [p for p in params if not isinstance(p, DTensor)],
                    )
                    if g
                ]
                opt = torch.optim.AdamW([{"params": g} for g in groups], lr=1e-4, foreach=True)

                def step(fn=fn, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    fn(tokens).backward()
                    opt.step()

            with (
                CodeCapture() as code,
                inductor_config.patch(post_grad_custom_post_pass=counter, fx_graph_cache=False),
            ):
                step()
                _sync(device)
            compile_s = time.perf_counter() - t
            step()  # warm
            ms = _time(step, device, args.steps)
            # high-water mark of this variant's compile and steps (the model copy included)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            src = code.text
            kernels = src.count("@triton.jit") if device.type == "cuda" else src.count('extern "C"')
            colls = sum(
                src.count(f"_c10d_functional.{c}")
                for c in (
                    "all_reduce",
                    "all_gather_into_tensor",
                    "reduce_scatter_tensor",
                    "all_to_all_single",
                )
            )
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                name = f"{mode}_{label.split()[0].lower()}.py"
                with open(os.path.join(args.dump, name), "w") as f:
                    f.write(src)
            rows.append((mode, label, ms, compile_s, counter.n, kernels, colls, peak))
            # DTensor + torch.compile, measured first
            anchor = next(r for r in rows if r[0] == mode)
            print(
                f"{mode:8} {label:26} {ms:9.2f} {ms / anchor[2]:10.2f} {compile_s:9.1f} "
                f"{counter.n:11d} "
                f"{kernels:8d} {colls:19d} "
                + (f"{peak:8.2f} {peak / anchor[7]:10.2f}" if anchor[7] else f"{'-':>8} {'-':>10}"),
                flush=True,
            )  # each row at once: a later failure keeps it
            del fn, step
            if mode != "forward":
                del opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
