"""The transport protocol every strategy talks to (paper §6.1), and the transport registry.

A strategy never issues copies or collectives for payloads itself; it asks a ``Transport``,
once per attention call and then once per peer and round:

    reserve(nbytes)              COLLECTIVE, same ``nbytes`` on every rank: each slot holds at
                                 least ``nbytes`` payload bytes per peer (e.g. the worst case, a
                                 full shard). Implies a fence when it has to grow the slots.
    fence()                      once per attention call: every transfer of the last call is
                                 complete and its slots are free; the epoch advances
    buf = send_buffer(peer, n)   where the producer packs n elements for ``peer`` (may wait
                                 until the peer released the slot it used last time)
    publish(peer, buf)           ``buf`` is packed (ordered after the pack on the current
                                 stream); the peer may now fetch it
    h = fetch(peer, out)         the consumer copies ``out.numel()`` elements published by
                                 ``peer`` into ``out``; sizes are derived locally on both ends,
                                 nothing but the payload crosses the wire
    h.wait()                     ``out`` is valid on the current stream
    release(peer)                the consumer no longer needs the producer's slot
    settle()                     once per call, after it is queued: the host checks, with the
                                 timeout, the transfers whose ``wait()`` only ordered a stream

Rules a strategy follows so that every transport works:

- every round that sends to ``dst`` and receives from ``src`` calls ``send_buffer``/``publish``
  for ``dst`` and then ``fetch`` from ``src`` — also when a size is 0 (both ends derive the
  same size, so an empty transfer moves nothing, but the call marks the end of the round:
  the ``nccl`` transport issues the round's sends together with its receive there, which two
  ranks need to avoid a send/send deadlock);
- every ``fetch`` is matched by one ``release`` of the same peer, in order, once the payload
  is no longer needed (also for 0 elements);
- each peer's sends and fetches happen in the same order on both ends (the k-th fetch from p
  gets p's k-th publish to us).

Errors: a peer that is dead or silent makes the waiting call (or, for a wait left to the
GPU, ``settle``) raise ``TimeoutError`` naming the peer after ``timeout_s``; nothing hangs. Bad arguments raise ``ValueError``.

Every transport counts the payload bytes it moves per peer (``bytes_sent``/
``bytes_received``), so tests hold the bytes actually moved against ``sparsp.demand``.

Registry: ``register_transport(name, factory, devices=..., auto=...)`` adds a transport under
any name; ``auto`` is an ordered rule: among the registered transports whose ``auto`` rule
accepts the group's ``Topology`` (device type, hosts, peer access), the one with the highest
``priority`` wins (``sparsp.transport.select``).
"""

from __future__ import annotations

import abc
import enum
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

__all__ = [
    "AutoRule",
    "DoneHandle",
    "Handle",
    "Topology",
    "Transport",
    "TransportName",
    "TransportSpec",
    "register_transport",
    "transport_factory",
    "transport_names",
    "transport_spec",
]


class TransportName(str, enum.Enum):
    """The built-in transports (any other registered name is accepted too)."""

    AUTO = "auto"
    NCCL = "nccl"  # torch.distributed p2p: NCCL on GPU, gloo on CPU
    IPC = "ipc"  # CUDA IPC peer copies on copy engines
    HOST = "host"  # pinned shared host memory (no peer access), plain shm on CPU


@runtime_checkable
class Handle(Protocol):
    def wait(self) -> None: ...


class DoneHandle:
    """A handle for a transfer that already completed (or moved nothing)."""

    def wait(self) -> None:
        return None


class Transport(abc.ABC):
    """Moves packed payloads between the ranks of one group; see the module docstring.

    Subclasses set ``name``, ``rank``, ``world_size`` and ``epoch`` and implement the five
    protocol steps; ``window``, ``fabric``, ``reserve``, ``describe``, ``settle`` and ``flush``
    have honest defaults, and the byte counters are kept here (subclasses call
    ``_count_send``/``_count_recv``).
    """

    name: str = "transport"
    rank: int
    world_size: int
    epoch: int = 0
    window: int | None = None
    """Messages a producer may have published to one peer before ``send_buffer`` waits on the
    host for that peer's ``release`` of the oldest (the slot transports' slots per peer). None:
    no bound, a send never waits for a release (payloads travel from the caller's own buffers)."""
    fabric: str = "host"
    """The path payloads take between GPUs (docs/design.md, "Words"): ``nvlink`` (peer copies,
    NVLink or PCIe P2P) or ``host`` (staged through host memory). The chunk rules estimate a
    transfer on it (``cost.chunks.fabric``). Default ``host``: a transport that does not say is
    estimated on the slower path."""

    def __init__(self) -> None:
        self.bytes_sent: dict[int, int] = defaultdict(int)
        self.bytes_received: dict[int, int] = defaultdict(int)

    # -- the protocol ---------------------------------------------------------------------

    @abc.abstractmethod
    def fence(self) -> None:
        """Once per attention call (see the module docstring)."""

    @abc.abstractmethod
    def send_buffer(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous buffer of ``numel`` ``dtype`` elements to pack for ``peer``."""

    @abc.abstractmethod
    def publish(self, peer: int, buf: torch.Tensor) -> None:
        """``buf`` (from ``send_buffer``) is packed; ``peer`` may fetch it."""

    @abc.abstractmethod
    def fetch(self, peer: int, out: torch.Tensor) -> Handle:
        """Copy ``out.numel()`` elements of ``peer``'s next publish to us into ``out``."""

    @abc.abstractmethod
    def release(self, peer: int) -> None:
        """Hand back the oldest slot fetched from ``peer``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free everything (shared memory, IPC handles); safe to call twice."""

    def reserve(self, nbytes: int) -> None:
        """Collective: slots hold at least ``nbytes`` per peer. Default: no slots, nothing to do
        (payloads travel from the caller's own buffers, any size)."""
        return None

    def describe(self) -> str:
        """One line for the log: what moves the bytes."""
        return self.name

    def settle(self) -> None:
        """Check on the host, with the timeout, every wait this rank left to the GPU (once per
        attention call, after the call is queued). Default: there are none, every ``wait()``
        checked its own transfer."""
        return None

    def flush(self) -> None:
        """Issue now any send queued for a later ``fetch`` (default: none is ever queued).

        A composite transport (``peers.py``) calls it when a round's fetch goes through another
        of its transports, so that a send held back for the round's end still leaves."""
        return None

    # -- byte counters --------------------------------------------------------------------

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


# --- registry ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """What ``auto`` knows of a group (gathered once per group, equal on every rank)."""

    device_type: str  # "cpu" or "cuda"
    world_size: int
    one_host: bool  # every rank on the same host (same hostname and boot)
    same_gpus: bool  # every rank sees the same GPU list (CUDA IPC handles can be opened)
    peer_access: bool  # every pair of the group's GPUs has peer access
    gpus: tuple[int, ...] = ()  # the group's GPU indices
    # Per rank, for per-pair choices (``peers.py``); empty when not gathered (one host, CPU):
    hosts: tuple[int, ...] = ()  # host index of each rank (rank order)
    rank_gpus: tuple[int, ...] = ()  # GPU index of each rank (its own numbering)
    peer: tuple[tuple[bool, ...], ...] = ()  # peer[a][b]: ranks a and b can use CUDA IPC
    # (one host, the same GPU list, peer access between their GPUs or one GPU)

    def pair(self, a: int, b: int) -> "Topology":
        """The two-rank topology of ranks ``a`` and ``b`` (what a transport serving only that
        pair sees), for the per-pair choice of ``peers.py``."""
        one_host = not self.hosts or self.hosts[a] == self.hosts[b]
        access = bool(self.peer[a][b]) if self.peer else (self.peer_access and one_host)
        gpus = tuple(sorted({self.rank_gpus[a], self.rank_gpus[b]})) if self.rank_gpus else self.gpus
        return Topology(self.device_type, 2, one_host, one_host and (self.same_gpus or access),
                        access, gpus)


AutoRule = Callable[[Topology], "str | None"]
"""Returns the reason this transport suits the topology, or None when it does not."""


@dataclass(frozen=True)
class TransportSpec:
    name: str
    factory: Callable[..., Transport]
    """``factory(group, *, timeout_s, device, **options) -> Transport``."""
    devices: tuple[str, ...]
    """Device types the transport moves tensors of."""
    auto: AutoRule | None
    """When ``auto`` may pick it (None: only by name)."""
    priority: int
    """Among transports whose ``auto`` rule accepts a group, the highest wins."""


_REGISTRY: dict[str, TransportSpec] = {}


def register_transport(name: str, *, devices: tuple[str, ...] = ("cpu", "cuda"),
                       auto: AutoRule | None = None, priority: int = 0):
    """Decorator registering ``factory(group, *, timeout_s, device, **options)`` as ``name``."""
    if not isinstance(name, str) or not name or name == TransportName.AUTO.value:
        raise ValueError(f"a transport name must be a non-empty str other than 'auto', got {name!r}")

    def deco(factory):
        _REGISTRY[name] = TransportSpec(name, factory, tuple(devices), auto, priority)
        return factory

    return deco


def transport_spec(name: str) -> TransportSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"transport={name!r} is not available; registered: "
                         f"{', '.join(transport_names())}") from None


def transport_names(*, with_auto: bool = False) -> tuple[str, ...]:
    """Registered transport names (sorted), optionally with ``auto`` first."""
    names = tuple(sorted(_REGISTRY))
    return ((TransportName.AUTO.value,) + names) if with_auto else names


def transport_factory(name: str) -> Callable[..., Transport]:
    return transport_spec(name).factory
