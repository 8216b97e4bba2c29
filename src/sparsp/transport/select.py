"""Choosing a transport: ``make_transport(name, group, *, device, timeout_s)``.

``name`` is one of ``TransportName``. ``auto`` decides once per group, the same way on every
rank (the inputs are gathered, so all ranks agree):

- CPU tensors → ``nccl`` (which is gloo on CPU). ``host`` runs on CPU too (the CI tests use it
  to exercise the slot protocol), but on CPU it buys nothing over gloo, whose path is the
  reference every other transport is checked against;
- CUDA tensors, every rank on one host seeing the same GPUs, and every pair of the group's
  GPUs with peer access (``torch.cuda.can_device_access_peer``) → ``ipc`` (copy engines over
  NVLink / PCIe P2P);
- CUDA tensors on one host without peer access somewhere → ``host`` (copy engines through
  pinned shared host memory: what a PCIe box without P2P offers; DESIGN measured it at ≈1.4×
  NCCL with ``NCCL_P2P_DISABLE=1`` and without NCCL's slowdown of concurrent attention);
- ranks on several hosts → ``nccl``.

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

from . import host, ipc  # noqa: F401  (register "host" and "ipc")
from .base import Transport, TransportName, transport_factory
from .slots import _resolve_device

log = logging.getLogger("sparsp")
_LOGGED: set[tuple[str, str]] = set()


def _name(value: str, source: str) -> str:
    try:
        return TransportName(value.strip().lower()).value
    except ValueError:
        allowed = [n.value for n in TransportName]
        raise ValueError(f"{source}={value!r} is not a transport; allowed: {allowed}") from None


def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def choose_auto(group=None, device=None) -> tuple[str, str]:
    """(transport name, reason) for ``auto``; collective over ``group`` for CUDA devices."""
    device = _resolve_device(device, group)
    if device.type != "cuda":
        return "nccl", "CPU tensors: torch.distributed (gloo)"
    if dist.get_world_size(group) == 1:
        return "nccl", "a single rank moves nothing"
    with torch.cuda.device(device):
        uuids = [str(getattr(torch.cuda.get_device_properties(i), "uuid", i))
                 for i in range(torch.cuda.device_count())]
        infos = _gather((socket.gethostname(), _boot_id(), uuids, device.index), group)
        if any(i[:2] != infos[0][:2] for i in infos):
            return "nccl", "ranks on several hosts"
        if any(i[2] != infos[0][2] for i in infos):
            return "host", "ranks see different GPU lists (CUDA_VISIBLE_DEVICES): no CUDA IPC"
        indices = sorted({i[3] for i in infos})
        ok = all(torch.cuda.can_device_access_peer(a, b)
                 for a in indices for b in indices if a != b)
        if all(_gather(ok, group)):
            return "ipc", f"peer access between GPUs {indices}"
        return "host", f"no peer access between some of GPUs {indices}"


def make_transport(name: str = "auto", group=None, *, device=None, timeout_s: float = 60.0,
                   **options) -> Transport:
    """Build the transport ``name`` (or the ``auto`` choice) for ``group``.

    ``options`` go to the slot transports (``window``, ``slot_bytes``, ``chunk_bytes``,
    ``tag``, ``stream_waits``); ``nccl`` takes none and ignores them.
    """
    chosen, reason = _name(name, "transport"), "requested"
    if chosen == TransportName.AUTO.value:
        env = os.environ.get("SPARSP_TRANSPORT", "").strip()
        if env and _name(env, "SPARSP_TRANSPORT") != TransportName.AUTO.value:
            chosen, reason = _name(env, "SPARSP_TRANSPORT"), "SPARSP_TRANSPORT"
        else:
            chosen, reason = choose_auto(group, device)
    factory = transport_factory(chosen)
    if chosen == TransportName.NCCL.value:
        transport = factory(group, timeout_s=timeout_s, device=device)
    else:
        transport = factory(group, timeout_s=timeout_s, device=device, **options)
    detail = transport.describe() if hasattr(transport, "describe") else chosen
    if (chosen, reason) not in _LOGGED:
        _LOGGED.add((chosen, reason))
        log.info("sparsp transport: %s (%s)", detail, reason)
    return transport
