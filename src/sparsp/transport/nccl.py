"""torch.distributed point-to-point transport: NCCL on GPU, gloo on CPU.

This is the baseline data path: payloads move through the communication library (on GPU,
NCCL's copy kernels, which compete with attention for SMs: docs/transport.md).
``publish`` only queues the send; ``fetch`` (called once per round, also for 0 elements: the
protocol's rule) issues every queued send together with the receive in one
``batch_isend_irecv``, because two ranks that each issue a blocking-order NCCL send before their
receive to the same peer would deadlock.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from .. import env
from ..groups import global_rank
from .base import DoneHandle, Topology, Transport, register_transport


class _Works:
    """The works of one ``batch_isend_irecv``; a failure names the op (and peer) that failed.

    A batch carries the sends queued for other peers too, so "fetch from peer p" alone would
    blame p for a send to a dead or silent peer q. gloo returns one work per op, in order;
    NCCL coalesces the batch into one work, which is then named by every op in it.
    """

    def __init__(self, works, timeout_s: float, what: str, ops: list[str], stream_wait: bool = False) -> None:
        self._works = list(works)
        # NCCL: a wait with a timeout blocks the host until the transfer completes (one host
        # sync per fetch); without one the current stream waits on the GPU and the host goes on.
        # NCCL's watchdog (the process group's timeout) then bounds a dead peer instead.
        self._stream_wait = stream_wait
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._what = what
        if len(ops) == len(self._works):
            self._names = ops
        else:
            self._names = [", ".join(ops)] * len(self._works)

    def wait(self) -> None:
        for w, name in zip(self._works, self._names):
            try:
                ok = w.wait() if self._stream_wait else w.wait(timeout=self._timeout)
            except RuntimeError as e:  # gloo raises on timeout or on a dead peer
                raise TimeoutError(f"{self._what}: {name}: {e}") from e
            if ok is False:
                raise TimeoutError(f"{self._what}: {name}: no answer within {self._timeout}")
        self._works = []


def _issue(ops: list, what: str, names: list[str]) -> list:
    """``batch_isend_irecv``; gloo refuses to start ops on a pair a dead peer has closed."""
    try:
        return dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise TimeoutError(f"{what}: {', '.join(names)}: {e}") from e


def peer_fabric(device) -> str:
    """The fabric NCCL copies this rank's payloads on: ``nvlink`` where this process's GPU has
    peer access to every other GPU it sees (NCCL then copies GPU to GPU), ``host`` where one
    lacks it (NCCL stages through host memory) and on the CPU (gloo). A process that sees one
    GPU cannot tell and says ``nvlink``: the chunk rules then err towards fewer chunks (the
    unchunked call), never towards chunks a fast link does not need. ``NCCL_P2P_DISABLE=1``
    makes NCCL stage through host memory whatever the GPUs could do: ``host``. Resolved once
    per transport (``P2PTransport.fabric``)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda" or env.nccl_p2p_disabled():
        return "host"
    me = device.index if device.index is not None else torch.cuda.current_device()
    others = [g for g in range(torch.cuda.device_count()) if g != me]
    return "nvlink" if all(torch.cuda.can_device_access_peer(me, g) for g in others) else "host"


class P2PTransport(Transport):
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
        self._pending_names: list[str] = []  # "send to peer p" for each queued op
        self._inflight: list[_Works] = []
        self._stream_wait = dist.get_backend(group) == "nccl"
        self.fabric = peer_fabric(self.device)

    def _global(self, peer: int) -> int:
        return global_rank(self.group, peer)

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
        self._pending_names.append(f"send to peer {peer}")

    def fetch(self, peer: int, out: torch.Tensor):
        ops, names = self._pending, self._pending_names
        self._pending, self._pending_names = [], []
        if out.numel():
            self._count_recv(peer, out)
            ops.append(dist.P2POp(dist.irecv, out, self._global(peer), self.group))
            names.append(f"receive from peer {peer}")
        if not ops:
            return DoneHandle()
        what = f"rank {self.rank}: fetch from peer {peer} (epoch {self.epoch})"
        handle = _Works(_issue(ops, what, names), self.timeout_s, what, names, self._stream_wait)
        self._inflight.append(handle)
        return handle

    def flush(self) -> None:
        """Issue queued sends that no fetch has carried yet (at the fence)."""
        if self._pending:
            ops, names = self._pending, self._pending_names
            self._pending, self._pending_names = [], []
            what = f"rank {self.rank}: send (epoch {self.epoch})"
            self._inflight.append(_Works(_issue(ops, what, names), self.timeout_s, what, names,
                                         self._stream_wait))

    def release(self, peer: int) -> None:
        return None

    def close(self) -> None:
        self.fence()


def _auto(topo: Topology) -> str | None:
    if topo.device_type != "cuda":
        return "CPU tensors: torch.distributed (gloo)"
    if topo.world_size == 1:
        return "a single rank moves nothing"
    return "ranks on several hosts" if not topo.one_host else "no copy-engine transport applies"


@register_transport("nccl", auto=_auto, priority=0)
def _make_p2p(group=None, *, timeout_s: float = 60.0, device=None):
    return P2PTransport(group, timeout_s=timeout_s, device=device)
