"""Run a function on N local processes with a real process group (gloo on CPU, loopback only).

    results = fxshard.launch.spawn(4, fn, arg1, arg2)   # fn(rank, world_size, arg1, arg2) on every
    rank

For the end-to-end tests and the step-time benchmarks; production jobs use torchrun.  ``fn`` must be
importable (a module-level function).  Every rank's return value comes back in rank order; an
exception on any rank is re-raised here with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, threads, collective_timeout, fn, args, queue):
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # not after fxshard aborted the groups (fail_together)
                dist.destroy_process_group()
        queue.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))


def spawn(
    world_size: int,
    fn: Callable,
    *args,
    backend: str = "gloo",
    threads: int = 1,
    timeout: float = 900.0,
    collective_timeout: float = 300.0,
) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns every rank's result.

    ``timeout``: seconds the whole run may take (then every rank is stopped and this raises);
    ``collective_timeout``: the process group's timeout (a collective that waits longer raises)."""
    import queue as queues
    import time

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, threads, collective_timeout, fn, args, queue),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=max(0.1, deadline - time.monotonic()))
            except queues.Empty:
                if time.monotonic() < deadline and any(p.is_alive() for p in procs):
                    continue
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                if not errors:
                    errors[-1] = (
                        f"ranks {missing} did not finish within {timeout:.0f} s (a hang, or a rank "
                        "that died without reporting)"
                    )
                break
            (results if ok else errors)[rank] = payload
            if errors:  # the others get a few seconds to report their side of it
                deadline = min(deadline, time.monotonic() + 10)
    finally:
        stopped = set()
        for r, p in enumerate(procs):
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                stopped.add(r)
    for r, p in enumerate(procs):  # a rank that died without a word (a crash in native code)
        if r in results or r in errors or r in stopped:
            continue
        if p.exitcode not in (None, 0):
            how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"exit code {p.exitcode}"
            errors[r] = f"rank {r} died ({how}) without reporting a result or an error"
    if errors:
        rank = min(errors, key=lambda r: (r < 0, r))  # a rank's own error first
        others = "".join(
            f"\n--- rank {r} also failed:\n{errors[r][-1500:]}" for r in sorted(errors) if r != rank
        )
        who = "the run" if rank < 0 else f"rank {rank} of {world_size}"
        raise RuntimeError(f"{who} failed:\n{errors[rank]}{others}")
    return [results[r] for r in range(world_size)]
