"""Slot windows: the publish/fetch/release protocol shared by the ``host`` and ``ipc`` transports.

``SlotWindows`` implements ``base.Transport`` over slots that a producer exports and its
consumers read (paper §6.1; docs/design.md "The mechanism", decoupled transfer runtime). The
subclasses only say where the slots live and how bytes move; everything below is here, once.

**Windows and slots.** Every rank p exports, for every peer c, a *window* of ``window`` slots
(default 3) of ``slot_bytes`` each (rounded up to a page; ``reserve`` grows them): p packs
payloads for c into them, and c copies them out. ``host`` keeps the slots in p's shared-memory
segment, ``ipc`` in a device buffer of p's GPU shared over CUDA IPC. The flags of the window
are always in p's shared-memory segment (its flag page, ``flags.FlagLayout``): per (consumer,
slot) a 'published' word that p writes and a 'released' word that c writes.

**Which slot.** Within one attention call (an *epoch*), the k-th transfer from p to c uses slot
``k mod window`` of p's window for c, for the ``use = k // window``-th time. Both ends count
their sends (``send_buffer``) and fetches per peer, and the strategy makes them in the same
order on both ends, so no slot number crosses the wire. A zero-byte transfer takes no slot.

**One transfer**, with flag values ``(epoch, use, count)`` (``flags`` describes the word):

    producer p                                    consumer c
    send_buffer(c): for use > 0, wait until c
      released use - 1 of the slot; return the
      slot (or a staging buffer) to pack into
    publish(c, buf): move the payload into the    fetch(p, out): wait until 'published'
      slot, then set 'published' = (epoch, use,     reaches (epoch, use, chunk) for each
      chunks), chunk by chunk on the CUDA path      chunk, copy it out of the slot into ``out``
                                                  release(p): once the copy has completed, set
                                                    'released' = (epoch, use, 1)

**Reuse ordering.** A slot is packed again only after its consumer released the previous use,
so a producer runs at most ``window`` transfers ahead of each consumer, and a payload is never
overwritten while it is being read. ``release`` hands back the *oldest* unreleased fetch from
that peer (FIFO), which is the order the slots were used in; on CUDA the 'released' write is
queued on the copy stream behind the copy, so "released" means "copied", not "copy issued".

**What each side waits on.** The producer waits on 'released' words in its own flag page
(``send_buffer``, only when it reuses a slot); the consumer waits on 'published' words in the
producer's page (``fetch`` on the CPU path and with host-side waits; ``settle`` where the GPU
waits on the flag); every
rank waits on every peer's barrier counter at export and once in ``fence``; on CUDA, ``fence``
and ``close`` also wait for the GPU work this rank queued (copies, flag writes).

**Epochs.** ``fence`` (once per attention call) checks that every ``send_buffer`` was
published, waits for this rank's queued work, meets the group (so every copy of the old
epoch has completed everywhere before any slot is packed again), advances the epoch, resets
every flag word this rank writes to ``(new epoch, 0, 0)`` and restarts the counts. It does not
meet the group a second time after the reset: a peer already in the new epoch can only read
an older epoch's value in a word not yet reset, which its waits reject (``flags.py``). Slots
fetched but not released are released implicitly: their copies are complete.

**Timeouts.** Every host-side wait gives up after ``timeout_s`` with a ``TimeoutError`` that
names this rank, the peer and the step: the slot, its use, the epoch and the value the flag
holds for a flag wait; the peer that did not arrive for a barrier; the transfer ("fetch from
peer p, slot s (epoch e)") for GPU work. A wait queued on the GPU (stream waits) has no timeout
of its own: ``settle`` (once per ``sp_attention`` call, after the call is queued; and in
``fence`` and ``close``) checks each awaited flag on the host with one, and on a timeout stores
the awaited values itself, so the blocked stream runs on, before it raises. A dead or silent
peer raises; nothing hangs. Setup steps run through ``_agree``, so a failure on one rank raises on every
rank instead of leaving the others waiting in a collective.

The CUDA mechanics (stream writes and waits, copy streams, host threads) are described in the
``host`` and ``ipc`` docstrings.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .base import DoneHandle, Transport
from ..groups import gather_objects, resolve_device
from .cuda_ops import DeviceOps, Worker, as_bytes
from .flags import (Backoff, DeviceWaits, FlagLayout, describe_flag, encode_flag, not_published,
                    wait_flag)
from .shm import HEADER_BYTES, PAGE, ShmSegment, agree_tag, round_up, sweep_stale

log = logging.getLogger("sparsp")


CHUNK_BYTES = 16 << 20
"""The default step of a chunked copy (``host``: the D2H/H2D pieces a consumer copies as they
land; 16–64 MiB pieces reach the two-way ceiling: docs/design.md "Kernels and transports",
docs/decisions.md)."""


class SlotWindows(Transport):
    """Protocol bookkeeping shared by ``HostTransport`` and ``IpcTransport`` (module docstring).

    Subclasses say where the slots live (``_slot_area_bytes``, ``_export_slots``) and how a
    payload moves (``_send_view``, ``_publish``, ``_fetch``); windows, flags, epochs, barriers,
    timeouts, segments and the CUDA helpers are here, once.

    Construction is collective over ``group`` (every rank, the same settings, else
    ``ValueError``): it agrees on the segment tag, exports the segments and meets the group.

    - ``timeout_s``: how long any wait (flag, barrier, GPU work) may take before it raises;
    - ``device``: where payload tensors live (default: the group's device, ``resolve_device``);
    - ``window``: slots per (producer, consumer) pair, i.e. how many transfers a producer may
      run ahead of a consumer;
    - ``slot_bytes``: initial payload bytes per slot (rounded up to a page; ``reserve`` grows);
    - ``chunk_bytes``: the chunk of a chunked copy, i.e. the step of the 'published' count
      (default ``CHUNK_BYTES``; the same on every rank);
    - ``tag``: shared-memory segment names (``shm.agree_tag``: default drawn per transport);
    - ``stream_waits``: queue ``cuStreamWaitValue32`` for flags instead of host-side waits
      (default on; used where the driver has stream memory operations); the host then checks
      those flags in ``settle``, with the timeout. False: a host thread waits for each flag
      and then issues the copy (the path taken anyway without stream memory operations).
    """

    name = "slots"

    def __init__(self, group=None, *, timeout_s: float = 60.0, device=None, window: int = 3,
                 slot_bytes: int = 1 << 20, chunk_bytes: int = CHUNK_BYTES, tag: str | None = None,
                 stream_waits: bool = True) -> None:
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
        self.device = resolve_device(device, group)
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
        self._waits = DeviceWaits()  # settle(): the flags our streams wait for on the GPU
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
        """Bytes of this rank's shared-memory segment after the flag page (0: slots elsewhere)."""
        raise NotImplementedError

    def _export_slots(self) -> None:
        """Collective: set up the slots after the flag segments exist (ipc: device windows)."""

    def _unexport_slots(self) -> None:
        """Drop what ``_export_slots`` made."""

    def _send_view(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` uint8 to pack into for ``slot`` of our window for ``peer`` (it is free)."""
        raise NotImplementedError

    def _publish(self, peer: int, slot: int, use: int, src: torch.Tensor) -> None:
        """Move packed ``src`` (uint8) into the slot, then set its 'published' flag."""
        raise NotImplementedError

    def _fetch(self, peer: int, slot: int, use: int, dst: torch.Tensor):
        """Once ``peer`` published (epoch, ``use``), copy its slot into ``dst`` (uint8).

        Returns the handle whose ``wait()`` makes ``dst`` valid on the current stream.
        """
        raise NotImplementedError

    def _release(self, peer: int, slot: int, use: int) -> None:
        """Set the 'released' flag in ``peer``'s page once the copy out of the slot is done."""
        self._write_flag(peer, self._layout.released(self.rank, slot),
                         encode_flag(self.epoch, use, 1))

    def _copies(self) -> str:
        """How payload bytes move, for ``describe``."""
        return "chunked copies through pinned host memory"

    def _start_threads(self) -> None:
        """CUDA only: streams and worker threads (here: a flag writer without stream writes)."""
        if self._ops is not None and not self._ops.mem_ops:
            self._signaler = Worker(f"sparsp-{self.name}-signal", self.device)

    # -- the protocol ---------------------------------------------------------------------

    def send_buffer(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``numel`` ``dtype`` elements to pack for ``peer``; waits for a free slot.

        The slot is the next one of our window for ``peer``; when it was used before in this
        epoch, this waits (``timeout_s``) until ``peer`` released that use. ``ValueError`` when
        the payload exceeds ``slot_bytes`` (call ``reserve`` first); ``RuntimeError`` when the
        previous buffer for ``peer`` was not published yet.
        """
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
        """``buf`` (from ``send_buffer``) is packed: the peer may fetch it.

        ``buf`` may be shorter than asked for, never longer. Ordered after the pack on the
        current stream; does not wait for the peer.
        """
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
        """Copy ``out.numel()`` elements of the next slot ``peer`` publishes for us into ``out``.

        Waits for the 'published' flag: here on the CPU path (``timeout_s``); on the CUDA paths
        on the GPU (stream waits, the default; the host checks the flag in ``settle``) or in a
        worker thread (``timeout_s``). Every fetch needs one ``release(peer)``, also a
        0-element one.
        """
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
        """Hand back the oldest slot fetched from ``peer`` (after its copy has completed).

        Never waits: on CUDA the 'released' write is queued behind the copy.
        """
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
        self.settle()
        unpublished = [p for p, c in self._pending.items() if c is not None]
        if unpublished:
            raise RuntimeError(f"rank {self.rank}: fence with send_buffer(s) for peers "
                               f"{unpublished} never published (epoch {self.epoch})")
        self._quiesce()
        self._barrier("fence")
        self.epoch += 1
        # no second barrier: a peer that is past this fence already may see a word of ours
        # before its reset, but only ever an older epoch's value, which no wait of the new
        # epoch accepts (flags.py, "Comparison"); and every word has one writer, so our
        # reset never overwrites a peer's write of the new epoch
        self._reset_flags()
        self._reset_state()

    def settle(self) -> None:
        """Check on the host that every payload a stream of ours waits for on the GPU was
        published; ``TimeoutError`` (naming peer, slot, chunk, epoch) after ``timeout_s``.

        With stream waits a fetch queues ``cuStreamWaitValue32`` and its copy, and the handle's
        ``wait()`` only orders the caller's stream behind the copy: no host poll sits between
        a payload landing and the kernel that reads it. Whether the peer is alive is checked
        here instead: ``sp_attention`` calls this once per call, after the whole call is
        queued, and ``fence`` and ``close`` call it too. Before raising, the awaited values are
        stored into the flag words, so that no stream of ours stays blocked on a dead peer
        (those copies then move stale bytes, of a call that raises); a watchdog thread does
        that at the deadline if the host is blocked elsewhere first, and the error waits here
        (``flags.DeviceWaits``). Never waits for a flag that already holds its value, so a
        healthy call pays a few word reads.
        """
        self._waits.settle(cap_s=self._poll_cap, spin_s=self._poll_spin)

    def _await_on_gpu(self, peer: int, slot: int, use: int, count: int, epoch: int) -> None:
        """A stream of ours waits on the GPU for this 'published' value: ``settle`` checks it
        (and ``flags.DeviceWaits``' watchdog, should the host block before that)."""
        self._waits.add(self._flags[peer], self._layout.published(self.rank, slot),
                        encode_flag(epoch, use, count), self.timeout_s,
                        self._fetch_what(peer, slot, use, count, epoch))

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
        """Wait for queued GPU work (logging, not raising, on timeout), then unmap everything.

        Safe to call twice; the segment names are already gone after export.
        """
        if self._closed:
            return
        self._closed = True
        for step in (self.settle, self._quiesce):  # settle first: it unblocks stuck streams
            try:
                step()
            except Exception as e:  # noqa: BLE001 - a dead peer must not keep us from cleaning up
                log.warning("sparsp: %s transport on rank %d closed with transfers pending: %s",
                            self.name, self.rank, e)
        self._teardown()

    def __enter__(self):
        """``with HostTransport(group) as t:`` closes ``t`` on the way out."""
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
            mech = f"{self.device}, {self._copies()}, {writes}, {waits}"
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

    def _fetch_what(self, peer: int, slot: int, use: int, count: int, epoch: int) -> str:
        return (f"rank {self.rank}: fetch from peer {peer}: slot {slot} (use {use}, chunk "
                f"{count}) of epoch {epoch}")

    def _wait_published(self, peer: int, slot: int, use: int, count: int, epoch: int) -> None:
        what = self._fetch_what(peer, slot, use, count, epoch)
        wait_flag(self._flags[peer], self._layout.published(self.rank, slot),
                  encode_flag(epoch, use, count), timeout_s=self.timeout_s,
                  describe=lambda value: not_published(what, self.timeout_s, value),
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
            raise ValueError(f"rank {self.rank}: transport settings differ between ranks (class, slot_bytes, "
                             f"window, chunk_bytes): {configs}")
        size = HEADER_BYTES + self._layout.nbytes + self._slot_area_bytes(slot_bytes)
        segs: list = [None] * self.world_size
        self._segs = segs

        def create() -> None:
            segs[self.rank] = ShmSegment.create(self._tag, self.rank, size)

        def open_peers() -> None:
            for p in self.peers:
                segs[p] = ShmSegment.open(self._tag, p, size)

        # every rank sweeps before any rank creates: a sweep that ran beside a peer's create could
        # see a crashed run's segment of the same name (a given tag), and unlink by name the new
        # one the peer made between the sweep's check and its unlink (seen once in CI, 2 cores)
        self._agree("removing stale segments", lambda: len(sweep_stale()))
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
        self._waits.stop()
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
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def _allgather(self, obj) -> list:
        return gather_objects(obj, self.group)

    def _agree(self, step: str, fn: Callable[[], object]) -> list:
        """Run a setup step on every rank; a failure anywhere raises everywhere (no hang).

        Returns what ``fn`` returned on each rank (rank order), gathered in the same collective.
        """
        error, value = None, None
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - reported to the group, then re-raised
            error = e
        report = None if error is None else f"{type(error).__name__}: {error}"
        try:
            gathered = self._allgather((report, None if error is not None else value))
        except RuntimeError as e:  # a peer died mid-setup: gloo's message names no rank or step
            raise RuntimeError(f"rank {self.rank}: {step}: the group did not finish this step "
                               f"(a peer died or left): {e}") from e
        if error is not None:
            raise error
        for r, (report, _) in enumerate(gathered):
            if report is not None:
                raise RuntimeError(f"rank {self.rank}: {step} failed on rank {r}: {report}")
        return [v for _, v in gathered]

    def _chunks(self, nbytes: int) -> list[tuple[int, int, int]]:
        """(count after this chunk, start, end) for each ``chunk_bytes`` piece of a payload. Both
        ends call it on the same size, so they agree on every boundary."""
        step = self.chunk_bytes
        return [(j + 1, lo, min(lo + step, nbytes)) for j, lo in enumerate(range(0, nbytes, step))]