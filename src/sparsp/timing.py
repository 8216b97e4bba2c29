"""Wall time of a call on this process's device: CUDA events on a GPU, the host clock elsewhere.

What the runtime measures for itself (``strategies.one_gpu``: its kernels' rates) and what the
benchmarks time on one rank share these two functions; the benchmarks' collective timing
(``bench.common.time_ms``: the slowest rank of a group) times each call with ``call_ms`` too.
"""

from __future__ import annotations

import time

import torch


def call_ms(fn, device: torch.device) -> float:
    """One call of ``fn`` in ms, from an idle device to its last kernel's end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def times_ms(fn, *, warmup: int, iters: int, device: torch.device) -> list[float]:
    """``iters`` calls' times in ms after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [call_ms(fn, device) for _ in range(iters)]
