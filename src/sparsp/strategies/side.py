"""The side stream of a call: where packs and transfers go beside kernels already queued.

A ``local_first`` call queues its local kernel before the host read (``Call.attend_local_early``)
and issues its first round while that kernel runs; ``sparsp`` issues a round's late steps after
the kernel of a landed chunk (``Call.stage_side``). Queued on the compute stream, those packs
and copies would wait for the kernels ahead of them, so they go on one high-priority stream per
device that starts where the plan stage ended (``mark``: its layouts and token rows are ready
there), and whose blocks the GPU schedules ahead of the kernels' pending ones. Waits
(``handle.wait()``) stay on the compute stream; ``join`` orders the compute stream after the
side stream once the run is queued. Nothing of it exists on the CPU.
"""

from __future__ import annotations

import contextlib

import torch

_STREAMS: dict[str, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per device for the side work of every call: its blocks are
    scheduled ahead of the queued kernels' pending ones."""
    stream = _STREAMS.get(str(device))
    if stream is None:
        _, high = torch.cuda.Stream.priority_range()
        stream = _STREAMS[str(device)] = torch.cuda.Stream(device, priority=high)
    return stream


class SideStream:
    """One call's use of the side stream on ``device``: where it starts (``mark``), whether
    work is being issued on it now (``active``: a benchmark's timer names its packs apart), and
    whether it was used at all (``join``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start: torch.cuda.Event | None = None  # the compute stream's end when marked
        self.used: torch.cuda.Stream | None = None  # the stream, once work was issued on it
        self.active = False

    def mark(self) -> None:
        """Mark the compute stream's present end as where side work starts; nothing on the
        CPU or when marked already. Called before the kernels the side work must not wait for."""
        if self.start is None and self.device.type == "cuda":
            self.start = torch.cuda.Event()
            self.start.record()

    def issue(self, on: bool = True):
        """Context for issuing packs and transfers on the side stream, starting from the mark;
        no context before any mark (or on the CPU), or with ``on`` false."""
        if self.start is None or not on:
            return contextlib.nullcontext()
        stream = side_stream(self.device)
        stream.wait_event(self.start)
        self.used = stream
        return self._on(stream)

    @contextlib.contextmanager
    def _on(self, stream: torch.cuda.Stream):
        self.active = True
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            self.active = False  # later rounds (issued after a wait) pack on the compute stream

    def join(self) -> None:
        """The compute stream waits for everything issued on the side stream: the call's
        output, and every later use of its inputs and buffers, come after it."""
        if self.used is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.used)


__all__ = ["SideStream", "side_stream"]
