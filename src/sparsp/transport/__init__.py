"""Transports: how payloads move between ranks (see ``base`` for the protocol)."""

from . import host, ipc, nccl  # noqa: F401  (each registers its name)
from .base import (DoneHandle, Handle, Topology, Transport, TransportName, TransportSpec,
                   register_transport, transport_factory, transport_names, transport_spec)
from .select import choose_auto, make_transport

__all__ = [
    "DoneHandle",
    "Handle",
    "Topology",
    "Transport",
    "TransportName",
    "TransportSpec",
    "choose_auto",
    "make_transport",
    "register_transport",
    "transport_factory",
    "transport_names",
    "transport_spec",
]
