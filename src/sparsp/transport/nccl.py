"""torch.distributed point-to-point transport: NCCL on GPU, gloo on CPU.

This is the baseline data path: payloads move through the communication library (on GPU,
NCCL's copy kernels, which compete with attention for SMs: DESIGN.md "Contention").
``publish`` only queues the send; ``fetch`` issues every queued send together with the receive
in one ``batch_isend_irecv``, because two ranks that each issue a blocking-order NCCL send
before their receive to the same peer would deadlock.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .base import ByteCounter, DoneHandle, register_transport


class _Works:
    def __init__(self, works, timeout_s: float, what: str) -> None:
        self._works = works
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._what = what

    def wait(self) -> None:
        for w in self._works:
            try:
                ok = w.wait(timeout=self._timeout)
            except RuntimeError as e:  # gloo raises on timeout or on a dead peer
                raise TimeoutError(f"{self._what}: {e}") from e
            if ok is False:
                raise TimeoutError(f"{self._what}: no answer within {self._timeout}")
        self._works = []


class P2PTransport(ByteCounter):
    """Payload exchange with ``torch.distributed`` isend/irecv on ``group``."""

    name = "nccl"

    def __init__(self, group=None, *, timeout_s: float = 60.0, device=None) -> None:
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else None
        self.epoch = 0
        self._pending: list[dist.P2POp] = []
        self._inflight: list[_Works] = []

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def fence(self) -> None:
        # Sends of the previous call must have completed before their buffers are reused.
        self.flush()
        for w in self._inflight:
            w.wait()
        self._inflight.clear()
        self.epoch += 1

    def send_buffer(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def publish(self, peer: int, buf: torch.Tensor) -> None:
        if buf.numel() == 0:
            return
        self._count_send(peer, buf)
        self._pending.append(dist.P2POp(dist.isend, buf, self._global(peer), self.group))

    def fetch(self, peer: int, out: torch.Tensor):
        ops = self._pending
        self._pending = []
        if out.numel():
            self._count_recv(peer, out)
            ops.append(dist.P2POp(dist.irecv, out, self._global(peer), self.group))
        if not ops:
            return DoneHandle()
        works = dist.batch_isend_irecv(ops)
        handle = _Works(works, self.timeout_s, f"rank {self.rank}: fetch from peer {peer} "
                                               f"(epoch {self.epoch})")
        self._inflight.append(handle)
        return handle

    def flush(self) -> None:
        """Issue queued sends that no fetch has carried yet."""
        if self._pending:
            works = dist.batch_isend_irecv(self._pending)
            self._pending = []
            self._inflight.append(_Works(works, self.timeout_s, f"rank {self.rank}: send"))

    def release(self, peer: int) -> None:
        return None

    def reserve(self, nbytes: int) -> None:
        """No slots here: payloads travel from the caller's own buffers, any size."""
        return None

    def close(self) -> None:
        self.fence()


@register_transport("nccl")
def _make_p2p(group=None, *, timeout_s: float = 60.0, device=None):
    return P2PTransport(group, timeout_s=timeout_s, device=device)
