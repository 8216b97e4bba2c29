"""Transports: how payloads move between ranks (see ``base`` for the protocol)."""

from .base import ByteCounter, DoneHandle, Handle, Transport, TransportName, register_transport, transport_factory
from . import host, ipc, nccl  # noqa: F401  (each registers its name)

__all__ = [
    "ByteCounter",
    "DoneHandle",
    "Handle",
    "Transport",
    "TransportName",
    "register_transport",
    "transport_factory",
]
