"""Process-group helpers every stage shares: waits with timeouts, rank translation, gathering
Python objects, and the device a group's tensors live on.

They sit here, public, because the plan, the strategies and the transports all need them;
nothing here knows about attention.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist

from .caches import lru_get, per_geometry

__all__ = ["HostRead", "all_gather_flat", "gather_objects", "global_rank", "marker", "resolve_device",
           "start_host_read", "stream_ordered", "to_host", "wait"]

# torch 2.13 renames all_gather_into_tensor (deprecated there) to all_gather_single; the GPU
# machine's torch 2.11 has only the old name.
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_NO_MARKER = contextlib.nullcontext()  # what ``marker`` returns when no profiler records


def marker(name: str):
    """A named range of the call for profilers (``bench attention --torch-profile``, ``nsys`` with
    ``emit_nvtx``): ``torch.profiler.record_function(name)`` while a profiler records, else a
    no-op. Entering and leaving a ``record_function`` costs the host ≈ 12 µs on an H200 host
    even with no profiler running, and a call has six (docs/performance.md)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_MARKER


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group=None):
    """Async all-gather of equal-size ``inp`` into ``out`` (rank-major); returns the work."""
    return _ALL_GATHER_FLAT(out, inp, group=group, async_op=True)


def wait(work, timeout_s: float, what: str) -> None:
    """Wait for an async collective, turning a silent or dead peer into a ``TimeoutError``."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"{what}: {e}") from e
    if ok is False:
        raise TimeoutError(f"{what}: no answer from a peer within {timeout_s} s")


def stream_ordered(group) -> bool:
    """True when a collective of ``group`` can be waited for on the device stream (NCCL): the
    host then does not block on it, and the call's next host read (``to_host``) carries the
    timeout instead."""
    return "nccl" in str(dist.get_backend(group))


def to_host(t: torch.Tensor, timeout_s: float, what: str) -> torch.Tensor:
    """``t`` copied to the host. On CUDA the copy goes to pinned memory behind an event that
    is polled, so a peer that never answers a collective the stream waits on becomes a
    ``TimeoutError`` naming ``what`` instead of a hang (the one host synchronisation of a
    call carries the timeout of the collectives before it)."""
    return start_host_read(t).result(timeout_s, what)


def start_host_read(t: torch.Tensor, *, reuse: bool = False) -> "HostRead":
    """Queue ``t``'s copy to the host now and collect it later (``HostRead.result``): work
    queued on the stream in between (a kernel that needs no host value) runs while the host
    waits for the copy, and the copy does not wait for it. ``reuse``: copy into the pinned
    buffer and event kept for this shape, dtype and stream (``HostRead``), for a read made once
    per call whose result the caller has used up before its next read of the same shape."""
    return HostRead(t, reuse=reuse)


_READ_BUFFERS = per_geometry("groups: host-read buffers")  # key -> (pinned buffer, event)
MAX_READ_BUFFERS = 64


class HostRead:
    """A device tensor's copy to the host, queued at construction (``start_host_read``).

    On CUDA: a non-blocking copy into pinned memory and an event recorded right behind it on
    the current stream; ``result`` polls the event with a timeout. On the CPU the copy is
    ``t.cpu()`` at once. With ``reuse`` the pinned buffer and the event are made once per
    (shape, dtype, device, stream) and kept: a fresh pinned allocation, its allocator event and a
    new CUDA event cost the host tens of µs on the call's path (docs/performance.md)."""

    def __init__(self, t: torch.Tensor, *, reuse: bool = False) -> None:
        self._done: torch.cuda.Event | None = None
        if t.device.type != "cuda":
            self._host = t.cpu()
            return
        with marker("sparsp.host_read"):  # benchmarks count these (under their profiler)
            stream = torch.cuda.current_stream(t.device)
            make = lambda: (torch.empty(t.shape, dtype=t.dtype, pin_memory=True), torch.cuda.Event())  # noqa: E731
            self._host, self._done = (lru_get(_READ_BUFFERS, (tuple(t.shape), t.dtype, t.device, stream.cuda_stream),
                                              make, MAX_READ_BUFFERS) if reuse else make())
            self._host.copy_(t, non_blocking=True)
            self._done.record(stream)

    @classmethod
    def queued(cls, host: torch.Tensor, done: torch.cuda.Event) -> "HostRead":
        """The read of a copy into pinned ``host`` already queued on the current stream (a node
        of a replayed CUDA graph): only ``done`` is recorded now, behind it."""
        read = cls.__new__(cls)
        with marker("sparsp.host_read"):
            done.record()
        read._host, read._done = host, done
        return read

    def result(self, timeout_s: float, what: str) -> torch.Tensor:
        """The host copy, once it landed; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
        done = self._done
        if done is None:
            return self._host
        with marker("sparsp.host_wait"):
            start = time.monotonic()
            while not done.query():
                waited = time.monotonic() - start
                if waited > timeout_s:
                    raise TimeoutError(f"{what}: no answer from a peer within {timeout_s} s")
                # yield only for the first milliseconds (the usual wait: the device is
                # finishing the call's mask), then sleep so that a long wait does not burn a core
                time.sleep(0 if waited < 5e-3 else 5e-4)
        self._done = None
        return self._host


def global_rank(group, rank: int) -> int:
    """The global rank of ``group``'s member ``rank`` (p2p ops address global ranks)."""
    return dist.get_global_rank(group, rank) if group is not None else rank


def gather_objects(obj, group=None) -> list:
    """``obj`` of every rank of ``group``, in rank order (one ``all_gather_object``)."""
    if dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def resolve_device(device, group=None) -> torch.device:
    """``device`` as a full ``torch.device`` (a CUDA device gets its index); ``None`` means
    the current CUDA device for an NCCL group and the CPU otherwise."""
    if device is None:
        device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} is not supported; use a cpu or cuda device")
    return device
