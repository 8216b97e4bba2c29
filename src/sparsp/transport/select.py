"""Choosing a transport: ``make_transport(name, group, *, device, timeout_s)``.

``name`` is a registered transport or ``auto``. ``auto`` decides once per group, the same way
on every rank: the group's ``Topology`` (device type, one host or several, the same GPU list
everywhere, peer access between every pair of its GPUs) is gathered once, and among the
registered transports whose ``auto`` rule accepts it the one with the highest priority wins.
The built-in rules (``nccl.py``, ``host.py``, ``ipc.py``):

- ``ipc`` (priority 20): CUDA tensors, one host, the same GPU list on every rank, and peer
  access between every pair (copy engines over NVLink / PCIe P2P);
- ``host`` (10): CUDA tensors on one host otherwise (copy engines through pinned shared host
  memory: what a PCIe box without P2P offers; 34.3 GB/s against NCCL's 21.5 without P2P on the
  2×H200 box, docs/transport.md). It runs on CPU too (the CI tests use it to exercise the slot
  protocol), but on CPU it buys nothing over gloo, whose path is the reference every other
  transport is checked against, so its rule declines CPU tensors;
- ``nccl`` (0): everything else — CPU tensors (gloo), a single rank, ranks on several hosts.

The choice is per group, not per pair of ranks: one transport object serves every peer.

``SPARSP_TRANSPORT=<name>`` in the environment replaces ``auto`` (an explicit ``name`` wins
over it), e.g. ``SPARSP_TRANSPORT=host`` to measure the host path on a box with NVLink.
The chosen transport is logged once per process on the ``sparsp`` logger.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist

from ..groups import gather_objects, resolve_device
from .base import Topology, Transport, TransportName, _REGISTRY, transport_names, transport_spec

log = logging.getLogger("sparsp")
_LOGGED: set[tuple[str, str]] = set()


def _name(value: str, source: str) -> str:
    name = value.strip().lower()
    if name not in transport_names(with_auto=True):
        raise ValueError(f"{source}={value!r} is not a transport; allowed: "
                         f"{list(transport_names(with_auto=True))}")
    return name


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def topology(group=None, device=None) -> Topology:
    """The group's ``Topology``; collective over ``group`` for CUDA devices."""
    device = resolve_device(device, group)
    world = dist.get_world_size(group)
    if device.type != "cuda" or world == 1:
        return Topology(device.type, world, True, True, device.type == "cuda")
    with torch.cuda.device(device):
        uuids = [str(getattr(torch.cuda.get_device_properties(i), "uuid", i))
                 for i in range(torch.cuda.device_count())]
        infos = gather_objects((socket.gethostname(), _boot_id(), uuids, device.index), group)
        one_host = all(i[:2] == infos[0][:2] for i in infos)
        same_gpus = all(i[2] == infos[0][2] for i in infos)
        indices = tuple(sorted({i[3] for i in infos}))
        ok = one_host and same_gpus and all(
            torch.cuda.can_device_access_peer(a, b) for a in indices for b in indices if a != b)
        peer = all(gather_objects(ok, group))
    return Topology("cuda", world, one_host, same_gpus, peer, indices)


def choose_auto(group=None, device=None) -> tuple[str, str]:
    """(transport name, reason) for ``auto``; collective over ``group`` for CUDA devices."""
    topo = topology(group, device)
    for spec in sorted(_REGISTRY.values(), key=lambda s: -s.priority):
        if spec.auto is None or topo.device_type not in spec.devices:
            continue
        reason = spec.auto(topo)
        if reason is not None:
            return spec.name, reason
    raise ValueError(f"no registered transport accepts {topo}")


def make_transport(name: str = "auto", group=None, *, device=None, timeout_s: float = 60.0,
                   **options) -> Transport:
    """Build the transport ``name`` (or the ``auto`` choice) for ``group``.

    ``options`` go to the slot transports (``window``, ``slot_bytes``, ``chunk_bytes``,
    ``tag``, ``stream_waits``, ``copy``); ``nccl`` takes none and ignores them.
    """
    chosen, reason = _name(name, "transport"), "requested"
    if chosen == TransportName.AUTO.value:
        env = os.environ.get("SPARSP_TRANSPORT", "").strip()
        if env and _name(env, "SPARSP_TRANSPORT") != TransportName.AUTO.value:
            chosen, reason = _name(env, "SPARSP_TRANSPORT"), "SPARSP_TRANSPORT"
        else:
            chosen, reason = choose_auto(group, device)
    spec = transport_spec(chosen)
    if chosen == TransportName.NCCL.value:
        transport = spec.factory(group, timeout_s=timeout_s, device=device)
    else:
        transport = spec.factory(group, timeout_s=timeout_s, device=device, **options)
    if (chosen, reason) not in _LOGGED:
        _LOGGED.add((chosen, reason))
        log.info("sparsp transport: %s (%s)", transport.describe(), reason)
    return transport
