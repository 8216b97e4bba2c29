"""Host transport: slot windows in shared host memory (paper §6; docs/design.md, "Kernels and
transports": the PCIe-class path).

For GPUs without peer access (the common PCIe server) and, with the same code, for CPU-only
runs, where it is what the multi-process CI tests exercise.

Each rank exports once (and again only when ``reserve`` grows the slots) one shared-memory
segment (``shm.ShmSegment``) holding its flag page and, for every peer, a window of
``window`` slots of ``slot_bytes``. The k-th transfer from producer p to consumer c within an
attention call uses slot ``k mod window`` of p's window for c, for the ``k // window``-th time
("use"); both ends count, so no slot number crosses the wire.

    producer p                                consumer c
    send_buffer(c) waits until use u-1 of the slot was released (the window bounds how far
    p runs ahead), then returns a buffer to pack into
    publish(c, buf) copies/marks the slot, then  fetch(p, out) waits for 'published', copies
    sets 'published' = (epoch, u, chunks)        ``out.numel()`` elements out of the slot
                                                 release(p) sets 'released' = (epoch, u, 1)
    fence(): all ranks meet, reset every flag they write to (epoch + 1, 0, 0), meet again.

CPU tensors: the producer packs straight into the shared slot; fetch is a synchronous copy.

CUDA tensors: the segments are pinned with ``cuMemHostRegister`` (portable, device-mapped).
``send_buffer`` returns a device staging buffer; ``publish`` copies it to the host slot on a
dedicated D2H stream (ordered after the pack through an event) in ``chunk_bytes`` chunks and
advances the 'published' count after each chunk, so the consumer's H2D of chunk j overlaps the
producer's D2H of chunk j+1; ``fetch`` copies chunk by chunk on a dedicated H2D stream. Two
streams because D2H and H2D then run at once: ≈33.5 GB/s each way was measured for a
2-rank exchange this way on the 2×H200 box, and half that with one stream and no chunking.

Flag writes that must follow GPU work use ``cuStreamWriteValue32`` on the stream (no host
round trip; cuda-python's ``cuda.bindings``), else a host thread that polls an event and then
stores. The consumer queues ``cuStreamWaitValue32`` on each chunk's flag and the chunk's H2D
behind it (``stream_waits``, the default where the driver has stream memory operations), so
chunk j+1's H2D starts as soon as the producer's D2H of it is flagged, with no host thread
between, and the handle's ``wait()`` only orders the caller's stream. The host checks those
flags in ``settle`` with the timeout (once per attention call, after the call is queued, and
in ``fence``/``close``): a dead peer raises the ``TimeoutError`` naming peer, slot and epoch,
and ``settle`` first stores the awaited values so the blocked stream runs on. With
``stream_waits=False`` a host thread waits for each chunk's flag and then issues its copy. A device-side wait can stall other work only on a GPU whose streams
share one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``); the strategies publish every
payload of a round before they fetch, so even there each wait depends only on work a peer
queued earlier.
"""


from __future__ import annotations

import torch

from .base import DoneHandle, Topology, register_transport
from .cuda_ops import CopyHandle, Worker, keep_alive
from .flags import encode_flag
from .shm import HEADER_BYTES
from .slots import SlotWindows


class HostTransport(SlotWindows):
    """Slots in shared host memory; pinned and fed by copy-engine D2H/H2D for CUDA tensors."""

    name = "host"
    fabric = "host"

    def __init__(self, group=None, *, timeout_s: float = 60.0, device=None, **options) -> None:
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._d2h_done: dict[tuple[int, int], torch.cuda.Event] = {}
        super().__init__(group, timeout_s=timeout_s, device=device, **options)

    def _slot_area_bytes(self, slot_bytes: int) -> int:
        return (self.world_size - 1) * self.window * slot_bytes

    def _slot(self, producer: int, consumer: int, slot: int) -> torch.Tensor:
        """The host bytes of producer's slot for consumer (in the producer's segment)."""
        index = (consumer - (consumer > producer)) * self.window + slot
        offset = HEADER_BYTES + self._layout.nbytes + index * self.slot_bytes
        return self._segs[producer].view(offset, self.slot_bytes)

    def _start_threads(self) -> None:
        super()._start_threads()
        self._d2h = torch.cuda.Stream(self.device)
        self._h2d = torch.cuda.Stream(self.device)
        self._streams = [self._d2h, self._h2d]
        assert self._ops is not None
        if not self._ops.wait_ops:
            self._worker = Worker("sparsp-host-fetch", self.device)

    def _unexport_slots(self) -> None:
        self._staging.clear()
        self._d2h_done.clear()

    def _send_view(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        if not self.cuda:
            return self._slot(self.rank, peer, slot)[:nbytes]
        staging = self._staging.get((peer, slot))
        if staging is None:
            staging = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
            self._staging[(peer, slot)] = staging
        done = self._d2h_done.get((peer, slot))
        if done is not None:  # the previous D2H out of this staging buffer has to finish first
            torch.cuda.current_stream(self.device).wait_event(done)
        return staging[:nbytes]

    def _publish(self, peer: int, slot: int, use: int, src: torch.Tensor) -> None:
        dst = self._slot(self.rank, peer, slot)
        index = self._layout.published(peer, slot)
        if not self.cuda:
            if src.data_ptr() != dst.data_ptr():  # packed elsewhere: copy it in
                dst[: src.numel()].copy_(src)
            self._write_flag(self.rank, index, encode_flag(self.epoch, use, 1))  # after data
            return
        packed = torch.cuda.Event()
        packed.record(torch.cuda.current_stream(self.device))
        if src.data_ptr() != self._staging[(peer, slot)].data_ptr():
            src.record_stream(self._d2h)  # a caller's buffer: keep it alive for the copy
        with torch.cuda.stream(self._d2h):
            self._d2h.wait_event(packed)
            for count, lo, hi in self._chunks(src.numel()):
                dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                self._write_flag(self.rank, index, encode_flag(self.epoch, use, count), self._d2h)
        done = torch.cuda.Event()
        done.record(self._d2h)
        self._d2h_done[(peer, slot)] = done
        self._track(done, f"publish to peer {peer}, slot {slot} (epoch {self.epoch})")

    def _fetch(self, peer: int, slot: int, use: int, dst: torch.Tensor):
        src = self._slot(peer, self.rank, slot)
        epoch = self.epoch
        if not self.cuda:
            self._wait_published(peer, slot, use, 1, epoch)
            dst.copy_(src[: dst.numel()])
            return DoneHandle()
        assert self._ops is not None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        chunks = self._chunks(dst.numel())
        h2d = self._h2d
        keep_alive(dst, h2d)
        done = torch.cuda.Event()
        index = self._layout.published(self.rank, slot)
        device_waits = self._ops.wait_ops

        def issue() -> None:
            h2d.wait_event(ready)
            with torch.cuda.stream(h2d):
                for count, lo, hi in chunks:
                    if device_waits:
                        self._ops.wait(h2d, self._devflags[peer] + 4 * index, encode_flag(epoch, use, count))
                    else:
                        self._wait_published(peer, slot, use, count, epoch)
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
            done.record(h2d)
            if device_waits:
                self._await_on_gpu(peer, slot, use, len(chunks), epoch)

        task = None
        if self._worker is None:
            issue()
        else:
            task = self._worker.submit(issue)
        self._track(done, f"fetch from peer {peer}, slot {slot} (epoch {epoch})")
        return CopyHandle(self.device, done, task)

    def _release(self, peer: int, slot: int, use: int) -> None:
        if not self.cuda:
            return super()._release(peer, slot, use)
        index = self._layout.released(self.rank, slot)
        value = encode_flag(self.epoch, use, 1)

        def signal() -> None:  # on the H2D stream: after this slot's copies
            self._write_flag(peer, index, value, self._h2d)

        if self._worker is None:
            signal()
        else:
            self._worker.submit(signal)  # FIFO: after the fetch task that issues the copies


def _auto(topo: Topology) -> str | None:
    if topo.device_type == "cuda" and topo.one_host and topo.world_size > 1:
        why = ("ranks see different GPU lists (CUDA_VISIBLE_DEVICES): no CUDA IPC" if not topo.same_gpus
               else f"no peer access between some of GPUs {list(topo.gpus)}")
        return why
    return None


@register_transport("host", auto=_auto, priority=10)
def _make_host(group=None, *, timeout_s: float = 60.0, device=None, **options):
    return HostTransport(group, timeout_s=timeout_s, device=device, **options)
