"""CUDA pieces the slot transports share: pinning, stream flag operations, copy handles,
the worker thread that issues copies.

See ``host`` for how they are used; ``ipc`` uses the same pieces.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from typing import Callable

import numpy as np
import torch

log = logging.getLogger("sparsp")

_IPC_HANDLE_BYTES = 64  # CU_IPC_HANDLE_SIZE


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    if not t.is_contiguous():
        raise ValueError("transport buffers must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def cuda_driver():
    """cuda-python's driver API module, or None where cuda-python is not installed."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:  # cuda-python before 12.6
            from cuda import cuda as driver
        except ImportError:
            driver = None
    return driver


def driver_available() -> bool:
    """Whether cuda-python's driver API imports here (the ``ipc`` transport needs it)."""
    return cuda_driver() is not None


class DeviceOps:
    """CUDA pieces the host and ipc transports share: pinning shared memory, stream flag ops."""

    def __init__(self, device: torch.device, stream_waits: bool) -> None:
        self.device = device
        self.driver = cuda_driver()
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

    # -- CUDA IPC through the driver API (``ipc`` transport) -------------------------------

    def ipc_handle(self, ptr: int) -> tuple[bytes, int]:
        """(IPC handle of the allocation holding ``ptr``, offset of ``ptr`` in it)."""
        d = self.driver
        err, base, _ = d.cuMemGetAddressRange(d.CUdeviceptr(ptr))
        self._check((err,), "cuMemGetAddressRange")
        handle = self._check(d.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
        return ctypes.string_at(handle.getPtr(), _IPC_HANDLE_BYTES), ptr - int(base)

    def ipc_open(self, handle: bytes) -> int:
        """Map a peer's allocation into the current context (peer access enabled as needed)."""
        d = self.driver
        h = d.CUipcMemHandle()
        ctypes.memmove(h.getPtr(), handle, _IPC_HANDLE_BYTES)
        flags = d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
        return int(self._check(d.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))

    def ipc_close(self, base: int) -> None:
        d = self.driver
        self._check(d.cuIpcCloseMemHandle(d.CUdeviceptr(base)), "cuIpcCloseMemHandle")

    def copy(self, stream: torch.cuda.Stream, dst: int, src: int, nbytes: int) -> None:
        """``cuMemcpyDtoDAsync`` on ``stream``: a copy-engine DMA, no kernel; ``src`` may be a
        peer's memory mapped with ``ipc_open`` (then the DMA reads it over NVLink/PCIe)."""
        d = self.driver
        self._check(d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes,
                                        d.CUstream(stream.cuda_stream)), "cuMemcpyDtoDAsync")

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


def keep_alive(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the caching allocator ``t`` is in use on ``stream`` (no-op for foreign memory)."""
    try:
        t.record_stream(stream)
    except RuntimeError:
        pass
