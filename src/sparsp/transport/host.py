"""Host transport: slot windows in shared host memory (paper §6; DESIGN "PCIe-class path").

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
streams because D2H and H2D then run at once: DESIGN measured ≈33.5 GB/s each way for a
2-rank exchange this way on the 2×H200 box, and half that with one stream and no chunking.

Flag writes that must follow GPU work use ``cuStreamWriteValue32`` on the stream (no host
round trip; cuda-python's ``cuda.bindings``), else a host thread that polls an event and then
stores. The consumer waits for each chunk's flag on a host thread by default and issues the
copy when it is there; ``stream_waits=True`` (or ``SPARSP_STREAM_WAITS=1``) queues
``cuStreamWaitValue32`` instead. Host-side waiting is the default because a device-side wait
has no timeout (a dead peer would hang the stream forever, instead of raising the
``TimeoutError`` that names peer, slot and epoch) and, on a GPU whose streams share hardware
queues, a blocked wait can stall unrelated work queued behind it.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .base import ByteCounter, DoneHandle, register_transport
from .shm import (HEADER_BYTES, PAGE, Backoff, FlagLayout, ShmSegment, agree_tag, describe_flag,
                  encode_flag, round_up, sweep_stale, wait_flag)

log = logging.getLogger("sparsp")


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    if not t.is_contiguous():
        raise ValueError("transport buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() in ("1", "true", "yes", "on")


# --------------------------------------------------------------------------- CUDA helpers


class DeviceOps:
    """CUDA pieces the host and ipc transports share: pinning shared memory, stream flag ops."""

    def __init__(self, device: torch.device, stream_waits: bool) -> None:
        self.device = device
        try:
            from cuda.bindings import driver
        except ImportError:
            try:  # cuda-python before 12.6
                from cuda import cuda as driver
            except ImportError:
                driver = None
        self.driver = driver
        self.mem_ops = False  # cuStreamWriteValue32 works on our flag pages
        self.wait_ops = False  # ... and cuStreamWaitValue32 was asked for and works
        self._want_waits = stream_waits
        self._registered: dict[int, str] = {}

    def _check(self, result, what: str):
        err = result[0]
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what} failed: {err!r}")
        return result[1] if len(result) > 1 else None

    def register(self, ptr: int, size: int) -> int | None:
        """Pin ``[ptr, ptr + size)``; returns its device address when the driver API is here."""
        if self.driver is not None:
            try:
                # PORTABLE (1): pinned for every context; DEVICEMAP (2): device-addressable,
                # which the stream memory operations need
                self._check(self.driver.cuMemHostRegister(ptr, size, 1 | 2), "cuMemHostRegister")
            except RuntimeError as e:
                log.warning("sparsp: %s; pinning through the CUDA runtime instead", e)
            else:
                self._registered[ptr] = "driver"
                try:
                    return int(self._check(self.driver.cuMemHostGetDevicePointer(ptr, 0),
                                           "cuMemHostGetDevicePointer"))
                except RuntimeError as e:
                    log.warning("sparsp: %s; flags will be written by host threads", e)
                    return None
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 1)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {err}")
        self._registered[ptr] = "runtime"
        return None

    def unregister(self, ptr: int) -> None:
        how = self._registered.pop(ptr, None)
        if how == "driver":
            self.driver.cuMemHostUnregister(ptr)
        elif how == "runtime":
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def write(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Store ``value`` at device address ``addr`` after the work queued on ``stream``.

        Default flags: the write is preceded by a system-scope memory barrier, so the data the
        stream wrote before is visible to whoever sees the flag.
        """
        d = self.driver
        self._check(d.cuStreamWriteValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(addr),
                                           value, 0), "cuStreamWriteValue32")

    def wait(self, stream: torch.cuda.Stream, addr: int, value: int) -> None:
        """Make ``stream`` wait until ``(int32)(*addr - value) >= 0`` (CU_STREAM_WAIT_VALUE_GEQ)."""
        d = self.driver
        self._check(d.cuStreamWaitValue32(d.CUstream(stream.cuda_stream), d.CUdeviceptr(addr),
                                          value, 0), "cuStreamWaitValue32")

    def probe(self, words: np.ndarray, index: int, devptr: int | None) -> None:
        """Try the stream memory operations once on a scratch flag word; fall back quietly."""
        if self.driver is None or devptr is None:
            return
        stream = torch.cuda.Stream(self.device)
        addr = devptr + 4 * index
        try:
            words[index] = 0
            self.write(stream, addr, 0x5A5A0001)
            stream.synchronize()
            if int(words[index]) != 0x5A5A0001:
                raise RuntimeError("a stream write did not reach the host flag page")
            self.mem_ops = True
            if self._want_waits:
                self.wait(stream, addr, 0x5A5A0001)  # already satisfied: must pass at once
                stream.synchronize()
                self.wait_ops = True
        except Exception as e:  # noqa: BLE001 - any failure means "use the host fallback"
            log.warning("sparsp: stream memory operations unavailable on %s (%s); "
                        "using host threads for flags", self.device, e)
        finally:
            words[index] = 0


class _Task:
    def __init__(self, fn: Callable[[], None], worker: Worker) -> None:
        self.fn, self.worker = fn, worker
        self.done = threading.Event()
        self.error: BaseException | None = None

    def join(self) -> None:
        while not self.done.wait(0.5):
            if not self.worker.alive:
                raise RuntimeError("sparsp transport worker thread has died")
        if self.error is not None:
            if self.worker.error is self.error:
                self.worker.error = None  # reported here, not again at the fence
            raise self.error


class Worker:
    """A FIFO of host-side steps run off the caller's thread (wait for a flag, issue a copy)."""

    def __init__(self, name: str, device: torch.device) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._device = device
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], None]) -> _Task:
        task = _Task(fn, self)
        self._q.put(task)
        return task

    def _run(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # makes the primary context current here
        while (task := self._q.get()) is not None:
            try:
                task.fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                task.error = e
                if self.error is None:
                    self.error = e
            finally:
                task.done.set()

    def drain(self) -> None:
        """Wait until every step submitted so far ran; raise the first unreported error."""
        self.submit(lambda: None).join()
        err, self.error = self.error, None
        if err is not None:
            raise err

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5.0)


class CopyHandle:
    """``wait()``: the copy was issued (host side), then the current stream waits for it."""

    def __init__(self, device: torch.device, event: torch.cuda.Event,
                 task: _Task | None = None) -> None:
        self._device, self._event, self._task = device, event, task

    def wait(self) -> None:
        if self._task is not None:
            self._task.join()
            self._task = None
        torch.cuda.current_stream(self._device).wait_event(self._event)


# --------------------------------------------------------------------------- slot windows


class SlotWindows(ByteCounter):
    """Protocol bookkeeping shared by ``HostTransport`` and ``IpcTransport``.

    Subclasses say where the slots live (``_slot_area_bytes``, ``_export_slots``) and how a
    payload moves (``_send_view``, ``_publish``, ``_fetch``); windows, flags, epochs, barriers,
    timeouts, segments and the CUDA helpers are here, once.
    """

    name = "slots"

    def __init__(self, group=None, *, timeout_s: float = 60.0, device=None, window: int = 3,
                 slot_bytes: int = 1 << 20, chunk_bytes: int = 16 << 20, tag: str | None = None,
                 stream_waits: bool | None = None) -> None:
        super().__init__()
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        if chunk_bytes < PAGE:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= {PAGE}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.peers = [p for p in range(self.world_size) if p != self.rank]
        self.timeout_s = float(timeout_s)
        self.window = int(window)
        self.chunk_bytes = int(chunk_bytes)
        self.device = _resolve_device(device, group)
        self.cuda = self.device.type == "cuda"
        self.epoch = 0
        self.slot_bytes = 0
        self._layout = FlagLayout(self.world_size, self.window)
        self._segs: list[ShmSegment] = []
        self._flags: list[np.ndarray] = []
        self._devflags: list[int | None] = []
        self._bar = 0
        self._closed = False
        self._inflight: list[tuple[torch.cuda.Event, str]] = []
        self._streams: list[torch.cuda.Stream] = []
        self._worker: Worker | None = None
        self._signaler: Worker | None = None
        self._ops: DeviceOps | None = None
        if stream_waits is None:
            stream_waits = bool(_env_flag("SPARSP_STREAM_WAITS"))
        self._reset_state()
        try:
            with self._device_ctx():
                if self.cuda:
                    torch.empty(1, device=self.device)  # create the CUDA context now
                    self._ops = DeviceOps(self.device, stream_waits)
                self._tag = agree_tag(group, tag, device=self.device if self.cuda else None)
                self._export(round_up(max(int(slot_bytes), 1), PAGE))
                if self.cuda:
                    self._start_threads()
        except BaseException:
            self._teardown()
            raise

    # -- subclass hooks -------------------------------------------------------------------

    def _slot_area_bytes(self, slot_bytes: int) -> int:
        raise NotImplementedError

    def _export_slots(self) -> None:
        """Collective: set up the slots after the flag segments exist (ipc: device windows)."""

    def _unexport_slots(self) -> None:
        """Drop what ``_export_slots`` made."""

    def _send_view(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        raise NotImplementedError

    def _publish(self, peer: int, slot: int, use: int, src: torch.Tensor) -> None:
        raise NotImplementedError

    def _fetch(self, peer: int, slot: int, use: int, dst: torch.Tensor):
        raise NotImplementedError

    def _release(self, peer: int, slot: int, use: int) -> None:
        self._write_flag(peer, self._layout.released(self.rank, slot),
                         encode_flag(self.epoch, use, 1))

    def _start_threads(self) -> None:
        if self._ops is not None and not self._ops.mem_ops:
            self._signaler = Worker(f"sparsp-{self.name}-signal", self.device)

    # -- the protocol ---------------------------------------------------------------------

    def send_buffer(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``numel`` ``dtype`` elements to pack for ``peer``; waits for a free slot."""
        self._check_peer(peer)
        if peer in self._pending:
            raise RuntimeError(f"rank {self.rank}: send_buffer({peer}) called twice without "
                               "publish in between")
        nbytes = int(numel) * dtype.itemsize
        if nbytes > self.slot_bytes:
            raise ValueError(f"rank {self.rank}: {nbytes} bytes for peer {peer} exceed the slot "
                             f"size {self.slot_bytes}; call reserve({nbytes}) on every rank first")
        if nbytes == 0:
            self._pending[peer] = None
            return torch.empty(0, dtype=dtype, device=self.device)
        k = self._sent[peer]
        slot, use = k % self.window, k // self.window
        encode_flag(self.epoch, use, 1)  # range check before anything moves
        if use > 0:
            self._wait_released(peer, slot, use - 1)
        self._sent[peer] = k + 1
        self._pending[peer] = (slot, use, nbytes)
        return self._send_view(peer, slot, nbytes).view(dtype)

    def publish(self, peer: int, buf: torch.Tensor) -> None:
        """``buf`` (from ``send_buffer``) is packed: the peer may fetch it."""
        if peer not in self._pending:
            raise RuntimeError(f"rank {self.rank}: publish({peer}) without send_buffer")
        claim = self._pending.pop(peer)
        nbytes = buf.numel() * buf.element_size()
        if claim is None:
            if nbytes:
                raise ValueError(f"rank {self.rank}: publish({peer}) of {nbytes} bytes into a "
                                 "0-byte send_buffer")
            return
        slot, use, claimed = claim
        if nbytes > claimed:
            raise ValueError(f"rank {self.rank}: publish({peer}) of {nbytes} bytes, but "
                             f"send_buffer asked for {claimed}")
        self._count_send(peer, buf)
        self._publish(peer, slot, use, as_bytes(buf))

    def fetch(self, peer: int, out: torch.Tensor):
        """Copy ``out.numel()`` elements of the next slot ``peer`` publishes for us into ``out``."""
        self._check_peer(peer)
        nbytes = out.numel() * out.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"rank {self.rank}: fetch of {nbytes} bytes from peer {peer} "
                             f"exceeds the slot size {self.slot_bytes}; call reserve() first")
        if nbytes == 0:
            self._unreleased[peer].append(None)
            return DoneHandle()
        k = self._fetched[peer]
        slot, use = k % self.window, k // self.window
        encode_flag(self.epoch, use, 1)
        handle = self._fetch(peer, slot, use, as_bytes(out))
        self._fetched[peer] = k + 1
        self._unreleased[peer].append((slot, use))
        self._count_recv(peer, out)
        return handle

    def release(self, peer: int) -> None:
        """Hand back the oldest slot fetched from ``peer`` (after its copy has completed)."""
        self._check_peer(peer)
        if not self._unreleased[peer]:
            raise RuntimeError(f"rank {self.rank}: release({peer}) without a fetch to release")
        entry = self._unreleased[peer].popleft()
        if entry is not None:
            self._release(peer, *entry)

    def fence(self) -> None:
        """Once per attention call: everyone is done with this epoch; flags reset; epoch + 1.

        Slots fetched but not released are released implicitly (their copies are complete).
        """
        self._check_open()
        unpublished = [p for p, c in self._pending.items() if c is not None]
        if unpublished:
            raise RuntimeError(f"rank {self.rank}: fence with send_buffer(s) for peers "
                               f"{unpublished} never published (epoch {self.epoch})")
        self._quiesce()
        self._barrier("fence")
        self.epoch += 1
        self._reset_flags()
        self._barrier("fence flag reset")
        self._reset_state()

    def reserve(self, nbytes: int) -> None:
        """Collective: make every slot hold at least ``nbytes`` (same value on every rank).

        Re-exports the segments (and device windows) only when they grow; implies a fence.
        """
        self._check_open()
        if nbytes <= self.slot_bytes:
            return
        self.fence()
        with self._device_ctx():
            self._unexport()
            self._export(round_up(int(nbytes), PAGE))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._quiesce()
        except Exception as e:  # noqa: BLE001 - a dead peer must not keep us from cleaning up
            log.warning("sparsp: %s transport on rank %d closed with transfers pending: %s",
                        self.name, self.rank, e)
        self._teardown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        """One line for the log: fabric and synchronization mechanics actually in use."""
        if not self.cuda:
            mech = "cpu copies"
        else:
            assert self._ops is not None
            writes = "stream writes" if self._ops.mem_ops else "host-thread writes"
            waits = "stream waits" if self._ops.wait_ops else "host-polled waits"
            mech = f"{self.device}, {writes}, {waits}"
        return (f"{self.name} ({mech}; window {self.window} x {self.slot_bytes} B, "
                f"chunk {self.chunk_bytes} B)")

    # -- flags, waits, barriers -----------------------------------------------------------

    def _write_flag(self, owner: int, index: int, value: int,
                    stream: torch.cuda.Stream | None = None) -> None:
        """Store a flag word of ``owner``'s page: now, or after the work queued on ``stream``."""
        if stream is None:
            self._flags[owner][index] = value
        elif self._ops is not None and self._ops.mem_ops:
            self._ops.write(stream, self._devflags[owner] + 4 * index, value)
        else:
            assert self._signaler is not None
            event = torch.cuda.Event()
            event.record(stream)
            words = self._flags[owner]

            def store() -> None:
                self._wait_event(event, "GPU work before a flag write")
                words[index] = value

            self._signaler.submit(store)

    def _wait_published(self, peer: int, slot: int, use: int, count: int, epoch: int) -> None:
        def describe(value: int) -> str:
            return (f"rank {self.rank}: fetch from peer {peer}: slot {slot} (use {use}, chunk "
                    f"{count}) of epoch {epoch} not published within {self.timeout_s:g} s "
                    f"(flag holds {describe_flag(value)})")

        wait_flag(self._flags[peer], self._layout.published(self.rank, slot),
                  encode_flag(epoch, use, count), timeout_s=self.timeout_s, describe=describe,
                  cap_s=self._poll_cap, spin_s=self._poll_spin)

    def _wait_released(self, peer: int, slot: int, use: int) -> None:
        def describe(value: int) -> str:
            return (f"rank {self.rank}: send_buffer to peer {peer}: slot {slot} (use {use}) of "
                    f"epoch {self.epoch} not released within {self.timeout_s:g} s: the window "
                    f"of {self.window} is full (flag holds {describe_flag(value)})")

        wait_flag(self._flags[self.rank], self._layout.released(peer, slot),
                  encode_flag(self.epoch, use, 1), timeout_s=self.timeout_s, describe=describe,
                  cap_s=self._poll_cap, spin_s=self._poll_spin)

    @property
    def _poll_cap(self) -> float:
        # CPU runs share few cores with the peers; a GPU waiter wants low latency
        return 2e-5 if self.cuda else 1e-3

    @property
    def _poll_spin(self) -> float:
        return 5e-3 if self.cuda else 5e-5

    def _barrier(self, what: str) -> None:
        """Shared-memory barrier with a timeout that names the missing peer."""
        self._bar = (self._bar + 1) & 0xFFFFFFFF
        self._flags[self.rank][self._layout.barrier] = self._bar
        for p in self.peers:
            def describe(value: int, p=p) -> str:
                return (f"rank {self.rank}: {what} (epoch {self.epoch}): peer {p} did not "
                        f"arrive within {self.timeout_s:g} s")

            wait_flag(self._flags[p], self._layout.barrier, self._bar,
                      timeout_s=self.timeout_s, describe=describe, cap_s=self._poll_cap,
                      spin_s=self._poll_spin)

    def _reset_flags(self) -> None:
        """Every word this rank writes := (epoch, use 0, count 0): 'nothing yet this epoch'."""
        value = encode_flag(self.epoch, 0, 0)
        own = self._flags[self.rank]
        for p in self.peers:
            for s in range(self.window):
                own[self._layout.published(p, s)] = value
                self._flags[p][self._layout.released(self.rank, s)] = value

    def _wait_event(self, event: torch.cuda.Event, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        backoff = Backoff(spin_s=self._poll_spin, cap_s=self._poll_cap)
        while not event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank}: {what}: not complete within "
                                   f"{self.timeout_s:g} s")
            backoff.pause()

    def _quiesce(self) -> None:
        """Everything this rank queued (copies, flag writes) has completed."""
        if not self.cuda:
            return
        if self._worker is not None:
            self._worker.drain()
        for event, what in self._inflight:
            self._wait_event(event, what)
        self._inflight.clear()
        for stream in self._streams:
            event = torch.cuda.Event()
            event.record(stream)
            self._wait_event(event, f"{self.name} copy stream")
        if self._signaler is not None:
            self._signaler.drain()

    def _track(self, event: torch.cuda.Event, what: str) -> None:
        """Remember GPU work whose timeout should name ``what`` at the next fence."""
        if len(self._inflight) > 256:  # nobody fences: forget what already completed
            self._inflight = [(e, w) for e, w in self._inflight if not e.query()]
        self._inflight.append((event, what))

    # -- export ---------------------------------------------------------------------------

    def _export(self, slot_bytes: int) -> None:
        """Collective: create, exchange and map the segments; the names are gone afterwards."""
        config = (type(self).__name__, slot_bytes, self.window, self.chunk_bytes)
        configs = self._allgather(config)
        if any(c != config for c in configs):
            raise ValueError(f"rank {self.rank}: transport settings differ between ranks "
                             f"(class, slot_bytes, window, chunk_bytes): {configs}")
        size = HEADER_BYTES + self._layout.nbytes + self._slot_area_bytes(slot_bytes)
        segs: list = [None] * self.world_size
        self._segs = segs

        def create() -> None:
            sweep_stale()
            segs[self.rank] = ShmSegment.create(self._tag, self.rank, size)

        def open_peers() -> None:
            for p in self.peers:
                segs[p] = ShmSegment.open(self._tag, p, size)

        self._agree("creating the shared-memory segment", create)
        self._agree("opening the peers' segments", open_peers)
        segs[self.rank].unlink()  # everyone has it mapped: a crash from here on leaks nothing
        self.slot_bytes = slot_bytes
        self._flags = [seg.words(HEADER_BYTES, self._layout.nwords) for seg in segs]
        self._devflags = [None] * self.world_size
        if self.cuda:
            assert self._ops is not None
            for p, seg in enumerate(segs):
                base = self._ops.register(seg.ptr, seg.size)
                self._devflags[p] = None if base is None else base + HEADER_BYTES
            mapped = all(d is not None for d in self._devflags)
            if self._ops.mem_ops and not mapped:  # a re-export lost what the first one had
                raise RuntimeError("the flag pages could not be mapped for stream writes")
            if not self._ops.mem_ops and mapped:
                self._ops.probe(self._flags[self.rank], self._layout.scratch,
                                self._devflags[self.rank])
        self._agree("setting up the slots", self._export_slots)
        self._bar = 0
        self._reset_flags()
        self._barrier("export")
        self._reset_state()

    def _unexport(self) -> None:
        self._unexport_slots()
        self._flags = []
        for seg in self._segs:
            if seg is None:
                continue
            if self._ops is not None:
                self._ops.unregister(seg.ptr)
            seg.close()
        self._segs = []

    def _teardown(self) -> None:
        for w in (self._worker, self._signaler):
            if w is not None:
                w.stop()
        self._worker = self._signaler = None
        self._unexport()

    # -- helpers --------------------------------------------------------------------------

    def _reset_state(self) -> None:
        g = self.world_size
        self._sent = [0] * g
        self._fetched = [0] * g
        self._pending: dict[int, tuple[int, int, int] | None] = {}
        self._unreleased: list[deque] = [deque() for _ in range(g)]

    def _check_peer(self, peer: int) -> None:
        self._check_open()
        if not (0 <= peer < self.world_size) or peer == self.rank:
            raise ValueError(f"rank {self.rank}: peer {peer} is not another rank of a group "
                             f"of {self.world_size}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")

    def _device_ctx(self):
        return torch.cuda.device(self.device) if self.cuda else _nullctx()

    def _allgather(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _agree(self, step: str, fn: Callable[[], None]) -> None:
        """Run a setup step on every rank; a failure anywhere raises everywhere (no hang)."""
        error = None
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - reported to the group, then re-raised
            error = e
        reports = self._allgather(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        for r, report in enumerate(reports):
            if report is not None:
                raise RuntimeError(f"rank {self.rank}: {step} failed on rank {r}: {report}")

    def _chunks(self, nbytes: int) -> list[tuple[int, int, int]]:
        """(count after this chunk, start, end) for each chunk of a payload."""
        c = self.chunk_bytes
        return [(j + 1, lo, min(lo + c, nbytes)) for j, lo in enumerate(range(0, nbytes, c))]


class _nullctx:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _resolve_device(device, group) -> torch.device:
    if device is None:
        device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device} is not supported; use a cpu or cuda device")
    return device


# --------------------------------------------------------------------------- host transport


class HostTransport(SlotWindows):
    """Slots in shared host memory; pinned and fed by copy-engine D2H/H2D for CUDA tensors."""

    name = "host"

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
        _keep_alive(dst, self._h2d)
        done = torch.cuda.Event()
        chunks = self._chunks(dst.numel())
        index = self._layout.published(self.rank, slot)
        device_waits = self._ops.wait_ops

        def issue() -> None:
            with torch.cuda.stream(self._h2d):
                self._h2d.wait_event(ready)
                for count, lo, hi in chunks:
                    if device_waits:
                        self._ops.wait(self._h2d, self._devflags[peer] + 4 * index,
                                       encode_flag(epoch, use, count))
                    else:
                        self._wait_published(peer, slot, use, count, epoch)
                    dst[lo:hi].copy_(src[lo:hi], non_blocking=True)
                done.record(self._h2d)

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


def _keep_alive(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator ``t`` is in use on ``stream`` (no-op for foreign memory)."""
    try:
        t.record_stream(stream)
    except RuntimeError:
        pass


@register_transport("host")
def _make_host(group=None, *, timeout_s: float = 60.0, device=None, **options):
    return HostTransport(group, timeout_s=timeout_s, device=device, **options)
