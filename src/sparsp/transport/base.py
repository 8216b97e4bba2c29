"""The transport protocol every strategy talks to (paper §6.1).

A strategy never issues copies or collectives for payloads itself; it asks a ``Transport`` for
five things, in this order, once per peer and round:

    fence()                      once per attention call; bumps the epoch (the coarse boundary)
    buf = send_buffer(peer, n)   where the producer packs n elements for ``peer``
    publish(peer, buf)           ``buf`` is packed (ordered after the pack on the current
                                 stream); the peer may now fetch it
    h = fetch(peer, out)         the consumer copies ``out.numel()`` elements published by
                                 ``peer`` into ``out``; sizes are derived locally on both ends,
                                 nothing but the payload crosses the wire
    h.wait()                     ``out`` is valid on the current stream
    release(peer)                the consumer no longer needs the producer's slot

Every transport counts the payload bytes it moves per peer (``bytes_sent``/``bytes_received``),
so tests can hold the bytes actually moved against ``sparsp.demand``'s prediction.

Optional method (every built-in transport has it; call it only where it exists):

    reserve(nbytes)              COLLECTIVE, same ``nbytes`` on every rank: make each slot hold
                                 at least ``nbytes`` payload bytes per peer (e.g. the worst
                                 case, a full shard). Slot transports re-export their windows
                                 when they grow (this implies a fence); ``nccl`` has no slots
                                 and does nothing.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from typing import Callable, Protocol, runtime_checkable

import torch


class TransportName(str, enum.Enum):
    """Names accepted by ``SparspConfig.transport``."""

    AUTO = "auto"
    NCCL = "nccl"  # torch.distributed p2p: NCCL on GPU, gloo on CPU
    IPC = "ipc"  # CUDA IPC peer copies on copy engines
    HOST = "host"  # pinned shared host memory (no peer access), plain shm on CPU


@runtime_checkable
class Handle(Protocol):
    def wait(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    name: str
    rank: int
    world_size: int
    epoch: int
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]

    def fence(self) -> None: ...

    def send_buffer(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def publish(self, peer: int, buf: torch.Tensor) -> None: ...

    def fetch(self, peer: int, out: torch.Tensor) -> Handle: ...

    def release(self, peer: int) -> None: ...

    def close(self) -> None: ...


class DoneHandle:
    """A handle for a transfer that already completed (or moved nothing)."""

    def wait(self) -> None:
        return None


class ByteCounter:
    """Per-peer payload byte counters shared by every transport implementation."""

    def __init__(self) -> None:
        self.bytes_sent: dict[int, int] = defaultdict(int)
        self.bytes_received: dict[int, int] = defaultdict(int)

    def reset_counters(self) -> None:
        self.bytes_sent.clear()
        self.bytes_received.clear()

    @property
    def total_received(self) -> int:
        return sum(self.bytes_received.values())

    def _count_send(self, peer: int, t: torch.Tensor) -> None:
        self.bytes_sent[peer] += t.numel() * t.element_size()

    def _count_recv(self, peer: int, t: torch.Tensor) -> None:
        self.bytes_received[peer] += t.numel() * t.element_size()


_REGISTRY: dict[str, Callable[..., Transport]] = {}


def register_transport(name: str):
    """Register a transport factory ``factory(group, *, timeout_s, device) -> Transport``."""

    def deco(factory):
        _REGISTRY[TransportName(name).value] = factory
        return factory

    return deco


def transport_factory(name: str) -> Callable[..., Transport]:
    try:
        return _REGISTRY[TransportName(name).value]
    except (KeyError, ValueError):
        raise ValueError(
            f"transport={name!r} is not available; registered: {sorted(_REGISTRY)}"
        ) from None
