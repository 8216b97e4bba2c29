"""Transports: how payloads move between ranks (see ``base`` for the protocol)."""

from .base import ByteCounter, DoneHandle, Handle, Transport, TransportName, register_transport, transport_factory
from . import nccl  # noqa: F401  (registers "nccl")

__all__ = [
    "ByteCounter",
    "DoneHandle",
    "Handle",
    "Transport",
    "TransportName",
    "register_transport",
    "transport_factory",
]
