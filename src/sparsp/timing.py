"""Wall time on this process's device: CUDA events on a GPU, the host clock elsewhere.

What the runtime measures for itself (``strategies.one_gpu``: its kernels' rates) and what the
benchmarks time on one rank share ``call_ms`` and ``times_ms``; the benchmarks' collective
timing (``bench.common.time_ms``: the slowest rank of a group) times each call with ``call_ms``
too. ``PhaseTimer`` times the phases inside one ``sp_attention`` call (benchmarks only).
"""

from __future__ import annotations

import contextlib
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


class PhaseTimer:
    """CUDA events around the phases of one call on the compute stream (benchmarks only).

    ``phase(name)`` is a context manager; ``fetch_issued``/``fetch_landed`` bracket a payload's
    transfer as the compute stream sees it (``TimedHandle``). ``summary()`` (after a
    synchronize) sums each phase in ms. Off (``None``) in normal calls: no events, no cost.
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[int, torch.cuda.Event] = {}
        self.local_first = False  # the call queued its local kernel before the host read
        self.drain_chunks: int | None = None  # messages of the last round's received payload (sparsp)

    def _event(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    class _Phase:
        def __init__(self, timer: "PhaseTimer", name: str) -> None:
            self.timer, self.name = timer, name

        def __enter__(self):
            self.start = self.timer._event()

        def __exit__(self, *exc):
            self.timer.events.append((self.name, self.start, self.timer._event()))
            return False

    def phase(self, name: str) -> "PhaseTimer._Phase":
        return PhaseTimer._Phase(self, name)

    def fetch_issued(self, key: int) -> None:
        self._open[key] = self._event()

    def fetch_landed(self, key: int) -> None:
        start = self._open.pop(key, None)
        if start is not None:
            self.events.append(("transfer", start, self._event()))

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, a, b in self.events:
            out[name] = out.get(name, 0.0) + a.elapsed_time(b)
        return out


_UNTIMED = contextlib.nullcontext()


def phase_of(timer: PhaseTimer | None, name: str):
    """``timer.phase(name)``, or nothing where no timer watches (a call outside a benchmark)."""
    return _UNTIMED if timer is None else timer.phase(name)


class TimedHandle:
    """A transfer's handle whose ``wait()`` also tells ``timer`` when the payload landed on the
    compute stream (``timer.fetch_issued(key)`` was called when it was issued)."""

    def __init__(self, handle, timer: PhaseTimer, key: int) -> None:
        self._handle, self._timer, self._key = handle, timer, key

    def wait(self) -> None:
        self._handle.wait()
        self._timer.fetch_landed(self._key)
