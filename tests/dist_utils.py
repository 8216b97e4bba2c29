"""Run a function on every rank of a fresh process group on this machine (tests only).

``run_distributed(fn, world_size, *args, timeout=...)`` spawns ``world_size`` processes
(start method ``spawn``), joins them in a gloo group on a free localhost port (or NCCL, one GPU
per rank, with ``backend="nccl"``), calls ``fn(rank, world_size, *args)`` on each and returns
the list of their return values. ``fn`` must be a module-level function (it is pickled by
name). An exception in any rank is re-raised here with that rank's traceback; a rank that dies
without reporting (a crash, ``os._exit``) is an error too; after ``timeout`` seconds, or a
short grace period after the first failure, every process still running is killed.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp

_GRACE_S = 15.0  # how long the other ranks may keep running after one has failed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, port: int, backend: str, args: tuple, results,
           timeout: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    status = 0
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        results.put((rank, False, traceback.format_exc()))
        status = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # sys.exit (not os._exit): atexit handlers and finalizers run, as in a real job
    sys.exit(status)


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0,
                    backend: str = "gloo") -> list:
    """``[fn(rank, world_size, *args) for rank]``, each rank in its own process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, name=f"rank{r}",
                         args=(fn, r, world_size, port, backend, args, results, timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        while len(values) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            try:
                rank, ok, payload = results.get(timeout=min(1.0, left))
            except queue.Empty:
                for r, p in enumerate(procs):  # died without a report: crash or os._exit
                    if r not in values and r not in errors and p.exitcode not in (None, 0):
                        errors[r] = f"process exited with code {p.exitcode} without a report"
            else:
                (values if ok else errors)[rank] = payload
            if errors:
                deadline = min(deadline, time.monotonic() + _GRACE_S)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not (errors or timed_out) else 0.5)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise RuntimeError(f"{len(errors)} of {world_size} ranks failed:\n{text}")
    if timed_out:
        missing = [r for r in range(world_size) if r not in values]
        raise TimeoutError(f"ranks {missing} did not finish within {timeout:g} s")
    return [values[r] for r in range(world_size)]
