"""IPC transport: slot windows in GPU memory, read by peers over CUDA IPC (paper §6.1–6.2).

Export: each rank allocates one device buffer holding, for every peer, ``window`` slots of
``slot_bytes`` (once, and again only when ``reserve`` grows them) and shares it through a CUDA
IPC memory handle, exchanged with ``all_gather_object`` on the group: handles never leave the
group. ``cuIpcOpenMemHandle`` with lazy peer access maps each peer's window into *our own*
context, and a fetch is one ``cuMemcpyDtoDAsync`` on our copy stream: our copy engine reads the
peer's memory ("pull"), and every process works on its own GPU only. This needs cuda-python on
every rank; where it is missing, ``topology`` reports no peer access and ``auto`` picks
``host``.

Pull against push (the owner's copy engine writing into ours through torch's CUDA tensor
sharing, which costs a second CUDA context per peer GPU in each process): push was faster
alone on 2×H200 NVLink (368.2–370.3 GB/s against 346.0–353.7 at 256 MiB), pull under an
attention kernel (324.5 against 307.6), and the attention path's exposed transfer at LTX-Video
size was 0.81 ms with pull, 0.86 with push (docs/decisions.md, docs/transport.md). Pull is the
one kept: one context per GPU, and no slower where it counts.

The protocol on top:

- ``send_buffer`` returns a view of our own exported slot: the producer packs in place;
- ``publish`` writes the 'published' flag with ``cuStreamWriteValue32`` on the current
  stream, i.e. ordered after the pack (paper §6.1: "Publish is issued on the same CUDA stream
  as the packing operation"); where the driver lacks stream memory operations, an event and
  a host thread;
- ``fetch`` queues ``cuStreamWaitValue32`` on that flag and then the peer copy: no host thread
  sits in the path (host polling cost ~0.3 ms per exchange on the 2×H200 box: 272 → 358 GB/s
  at 256 MiB), and the handle's ``wait()`` only makes the caller's stream wait for the copy,
  so the kernel that reads the payload is queued at once and starts when the bytes land. The
  host checks the flag later, with the timeout, in ``settle`` (once per attention call, after
  the call is queued): a dead peer raises a ``TimeoutError`` naming peer, slot and epoch
  instead of hanging. Without the stream operations (or with ``stream_waits=False``) a host
  worker thread waits for the flag and issues the copy;
- ``release`` writes the 'released' flag on the copy stream, i.e. after the copy completed.

Flags, windows, epochs, barriers and timeouts are ``slots.SlotWindows``'s (flag pages are small
shared-memory segments registered with CUDA), exactly as for the ``host`` transport.
"""
from __future__ import annotations

import torch

from .base import Topology, register_transport
from .cuda_ops import CopyHandle, Worker, driver_available, keep_alive
from ..groups import resolve_device
from .slots import SlotWindows
from .flags import encode_flag



class IpcTransport(SlotWindows):
    """Peer copies over NVLink/PCIe P2P from slots exported with CUDA IPC (GPU only)."""

    name = "ipc"
    fabric = "nvlink"

    def __init__(self, group=None, *, timeout_s: float = 60.0, device=None, **options) -> None:
        self._window: torch.Tensor | None = None
        self._peer_ptrs: dict[int, int] = {}  # the peer's window in our context
        self._opened: list[int] = []  # bases to cuIpcCloseMemHandle
        self._copy: torch.cuda.Stream | None = None
        if resolve_device(device, group).type != "cuda":
            raise ValueError("the ipc transport moves CUDA tensors; use host or nccl on CPU")
        if not driver_available():
            raise ValueError("the ipc transport needs cuda-python (pip install 'sparsp[cuda]'); "
                             "use host or nccl without it")
        super().__init__(group, timeout_s=timeout_s, device=device, **options)

    def _slot_area_bytes(self, slot_bytes: int) -> int:
        return 0  # the slots are on the GPU; the segment is the flag page only

    def _offset(self, producer: int, consumer: int, slot: int) -> int:
        return ((consumer - (consumer > producer)) * self.window + slot) * self.slot_bytes

    def _export_slots(self) -> None:
        assert self._ops is not None

        def allocate() -> None:
            size = (self.world_size - 1) * self.window * self.slot_bytes
            self._window = torch.empty(max(size, 1), dtype=torch.uint8, device=self.device)

        self._agree("allocating the slot window", allocate)
        handles = self._agree("exporting the slot window",
                              lambda: self._ops.ipc_handle(self._window.data_ptr()))
        for p in self.peers:
            handle, offset = handles[p]
            base = self._ops.ipc_open(handle)
            self._opened.append(base)
            self._peer_ptrs[p] = base + offset

    def _unexport_slots(self) -> None:
        if self._peer_ptrs:
            for stream in self._streams:
                stream.synchronize()
            assert self._ops is not None
            for base in self._opened:
                self._ops.ipc_close(base)
            self._opened.clear()
            self._peer_ptrs.clear()
            # let every consumer drop its mapping before the owners free their windows
            if self._flags:
                timeout, self.timeout_s = self.timeout_s, min(self.timeout_s, 5.0)
                try:
                    self._barrier("unmapping the peers' windows")
                except TimeoutError:
                    pass
                finally:
                    self.timeout_s = timeout
        self._window = None

    def _copies(self) -> str:
        return "pull: cuMemcpyDtoDAsync by this GPU's copy engine"

    def _start_threads(self) -> None:
        super()._start_threads()
        self._copy = torch.cuda.Stream(self.device)
        self._streams = [self._copy]
        self._worker = Worker("sparsp-ipc-fetch", self.device)

    def _send_view(self, peer: int, slot: int, nbytes: int) -> torch.Tensor:
        assert self._window is not None
        offset = self._offset(self.rank, peer, slot)
        return self._window[offset : offset + nbytes]

    def _publish(self, peer: int, slot: int, use: int, src: torch.Tensor) -> None:
        dst = self._send_view(peer, slot, src.numel())
        if src.data_ptr() != dst.data_ptr():  # packed elsewhere: copy it into the slot
            dst.copy_(src)
        stream = torch.cuda.current_stream(self.device)
        self._write_flag(self.rank, self._layout.published(peer, slot),
                         encode_flag(self.epoch, use, 1), stream)
        done = torch.cuda.Event()
        done.record(stream)
        self._track(done, f"publish to peer {peer}, slot {slot} (epoch {self.epoch})")

    def _copy_from(self, peer: int, slot: int, dst: torch.Tensor, flag=None) -> None:
        """Queue (after ``flag`` = (address, value), if given) the copy of the peer's slot into
        ``dst`` on the caller's current stream (the copy stream)."""
        assert self._ops is not None
        offset, n = self._offset(peer, self.rank, slot), dst.numel()
        copy = torch.cuda.current_stream(self.device)
        if flag is not None:
            self._ops.wait(copy, *flag)
        self._ops.copy(copy, dst.data_ptr(), self._peer_ptrs[peer] + offset, n)

    def _fetch(self, peer: int, slot: int, use: int, dst: torch.Tensor):
        assert self._copy is not None and self._worker is not None
        epoch, copy = self.epoch, self._copy
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        keep_alive(dst, copy)
        done = torch.cuda.Event()
        self._track(done, f"fetch from peer {peer}, slot {slot} (epoch {epoch})")

        def issue(flag=None) -> None:
            with torch.cuda.stream(copy):
                copy.wait_event(ready)  # ``dst`` is free on the caller's stream
                self._copy_from(peer, slot, dst, flag)
                done.record(copy)

        if self._ops is not None and self._ops.wait_ops:
            # queue wait-for-flag and the copy now; the GPU starts it when the flag lands, and
            # settle() checks the flag on the host with the timeout
            flag = self._devflags[peer] + 4 * self._layout.published(self.rank, slot)
            issue((flag, encode_flag(epoch, use, 1)))
            self._await_on_gpu(peer, slot, use, 1, epoch)
            return CopyHandle(self.device, done)

        def host_issue() -> None:  # a worker thread polls the flag, then issues
            self._wait_published(peer, slot, use, 1, epoch)
            issue()

        return CopyHandle(self.device, done, self._worker.submit(host_issue))

    def _release(self, peer: int, slot: int, use: int) -> None:
        assert self._worker is not None
        index = self._layout.released(self.rank, slot)
        value = encode_flag(self.epoch, use, 1)
        copy = self._copy
        if self._ops is not None and self._ops.wait_ops:  # copies were queued directly
            self._write_flag(peer, index, value, copy)
            return
        # FIFO after the fetch task that issued this slot's copy; on the copy stream, so
        # after the copy itself
        self._worker.submit(lambda: self._write_flag(peer, index, value, copy))


def _auto(topo: Topology) -> str | None:
    if (topo.device_type == "cuda" and topo.one_host and topo.same_gpus and topo.peer_access
            and topo.world_size > 1):
        return f"peer access between GPUs {list(topo.gpus)}"
    return None


@register_transport("ipc", devices=("cuda",), auto=_auto, priority=20)
def _make_ipc(group=None, *, timeout_s: float = 60.0, device=None, **options):
    return IpcTransport(group, timeout_s=timeout_s, device=device, **options)
