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


def _worker(rank, world_size, port, backend, threads, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
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
) -> list:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes; returns every rank's result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, backend, threads, fn, args, queue),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get()
            (results if ok else errors)[rank] = payload
            if errors:
                break
    finally:
        for p in procs:
            p.join(timeout=timeout if not errors else 5)
            if p.is_alive():
                p.terminate()
    if errors:
        rank = min(errors)
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{errors[rank]}")
    return [results[r] for r in range(world_size)]
