"""Transports: how payloads move between ranks (see ``base`` for the protocol)."""

from . import base, host, ipc, nccl, peers  # noqa: F401  (each registers its name)
from .base import (AutoRule, DoneHandle, Handle, Topology, Transport,  # noqa: F401  (base.__all__)
                   TransportName, TransportSpec, register_transport, transport_factory,
                   transport_names, transport_spec)
from .select import choose_auto, make_transport

__all__ = [*base.__all__, "choose_auto", "make_transport"]
