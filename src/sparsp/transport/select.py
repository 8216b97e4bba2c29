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

The same rules also decide per pair of ranks (``Topology.pair``): when the pairs of a group
want different transports — two hosts with several GPUs each (``ipc`` or ``host`` inside a
host, ``nccl`` between hosts), or one host where only some GPUs reach each other — the
``peers`` rule (priority 30, ``peers.py``) accepts the group and one composite transport
serves every peer through the transport of its pair. A group whose pairs all agree gets that
one transport, as before.

``SPARSP_HOST_ID=<name>`` replaces the host identity (hostname and boot id) in the topology,
so that tests can emulate several hosts on one machine (e.g. ``host0`` for ranks 0–1 and
``host1`` for ranks 2–3); set it on every rank of the group or on none (on CPU the topology is
gathered only when it is set). ``SPARSP_LOCAL_TRANSPORT=<name>`` (``peers.py``) forces the
transport of the pairs on one host, e.g. ``host`` on CPU, whose own rule declines CPU tensors.

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


def host_id() -> str:
    """This process's host identity: ``SPARSP_HOST_ID`` if set (tests emulate several hosts on
    one machine with it), else hostname and boot id."""
    override = os.environ.get("SPARSP_HOST_ID", "").strip()
    return f"id:{override}" if override else f"{socket.gethostname()}/{_boot_id()}"


def _host_indices(keys: list) -> tuple[int, ...]:
    """Host index of each rank: hosts numbered in order of their first rank."""
    first: dict = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def topology(group=None, device=None) -> Topology:
    """The group's ``Topology``; collective over ``group`` for CUDA devices (and on CPU when
    ``SPARSP_HOST_ID`` is set)."""
    device = resolve_device(device, group)
    world = dist.get_world_size(group)
    if world == 1:
        return Topology(device.type, world, True, True, device.type == "cuda")
    if device.type != "cuda":
        if not os.environ.get("SPARSP_HOST_ID", "").strip():
            return Topology(device.type, world, True, True, False)
        hosts = _host_indices(gather_objects(host_id(), group))
        return Topology("cpu", world, len(set(hosts)) == 1, True, False, hosts=hosts)
    with torch.cuda.device(device):
        uuids = [str(getattr(torch.cuda.get_device_properties(i), "uuid", i))
                 for i in range(torch.cuda.device_count())]
        infos = gather_objects((host_id(), uuids, device.index), group)
        hosts = _host_indices([i[0] for i in infos])
        one_host = len(set(hosts)) == 1
        same_gpus = all(i[1] == infos[0][1] for i in infos)
        indices = tuple(sorted({i[2] for i in infos}))
        me = dist.get_rank(group)
        # my row of the IPC matrix: ranks on my host with my GPU list whose GPU mine reaches
        row = [b != me and infos[b][:2] == infos[me][:2] and (
            infos[b][2] == device.index or torch.cuda.can_device_access_peer(device.index, infos[b][2]))
            for b in range(world)]
        rows = gather_objects(row, group)
    peer = tuple(tuple(bool(rows[a][b] and rows[b][a]) for b in range(world)) for a in range(world))
    access = one_host and same_gpus and all(peer[a][b] for a in range(world) for b in range(world)
                                            if a != b)
    return Topology("cuda", world, one_host, same_gpus, access, indices, hosts=hosts,
                    rank_gpus=tuple(i[2] for i in infos), peer=peer)


def choose_by_rules(topo: Topology, *, exclude: tuple[str, ...] = ()) -> tuple[str, str]:
    """(transport name, reason): among the registered transports (but ``exclude``) whose
    ``auto`` rule accepts ``topo``, the one with the highest priority."""
    for spec in sorted(_REGISTRY.values(), key=lambda s: -s.priority):
        if spec.name in exclude or spec.auto is None or topo.device_type not in spec.devices:
            continue
        reason = spec.auto(topo)
        if reason is not None:
            return spec.name, reason
    raise ValueError(f"no registered transport accepts {topo}")


def choose_auto(group=None, device=None) -> tuple[str, str]:
    """(transport name, reason) for ``auto``; collective over ``group`` for CUDA devices."""
    return choose_by_rules(topology(group, device))


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


from . import peers  # noqa: E402,F401  (registers "peers"; it builds on this module's rules)
