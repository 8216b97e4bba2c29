"""What the transport choice knows of a group, and the rules that choose from it.

``topology(group, device)`` gathers the group's ``Topology`` once (device type, hosts, the GPU
lists, peer access between every pair of ranks); ``choose_by_rules`` applies the registered
``auto`` rules to it (the highest priority that accepts wins); ``pair_plan`` applies them to
every pair of ranks, for the per-pair transport of ``peers.py``. Both ``select.py`` and
``peers.py`` build on this module, which imports neither.

A process's host identity (``host_id``, read through ``sparsp.env``) is, in this order:
``SPARSP_HOST_ID`` where set — ranks with different ids are treated as on different hosts, so
that tests can emulate several hosts on one machine (e.g. ``host0`` for ranks 0–1 and ``host1``
for ranks 2–3); set it on every rank of the group or on none —; else the node ``torchrun``
names (``GROUP_RANK``: every process it starts on one node shares it); else the machine's
hostname and boot id. On CPU the topology is gathered only where one of the first two says
something (a single process without them is on one host).
"""

from __future__ import annotations

import socket
from collections import defaultdict

import torch
import torch.distributed as dist

from .. import env
from ..groups import gather_objects, resolve_device
from .base import Topology, _REGISTRY
from .cuda_ops import driver_available

PEERS = "peers"
"""The composite transport's name (``peers.py``): never the transport of a pair."""

Plan = tuple[tuple[str | None, ...], ...]
"""``plan[a][b]``: the transport of the pair of ranks (a, b); None on the diagonal."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_id() -> str:
    """This process's host identity: ``SPARSP_HOST_ID`` if set, else ``torchrun``'s node, else
    hostname and boot id (module docstring)."""
    override, node = env.host_id(), env.torchrun_node()
    if override:
        return f"id:{override}"
    if node is not None:
        return f"node:{node[0]}"
    return f"{socket.gethostname()}/{_boot_id()}"


def hosts_told() -> bool:
    """Whether the environment names this process's host (``SPARSP_HOST_ID`` or ``torchrun``):
    on CPU, ranks are then on the hosts it names, else on one."""
    return env.host_id() is not None or env.torchrun_node() is not None


def _host_indices(keys: list) -> tuple[int, ...]:
    """Host index of each rank: hosts numbered in order of their first rank."""
    first: dict = {}
    return tuple(first.setdefault(k, len(first)) for k in keys)


def topology(group=None, device=None) -> Topology:
    """The group's ``Topology``; collective over ``group`` for CUDA devices (and on CPU where
    the environment names hosts: ``hosts_told``).

    Two ranks count as having peer access (``Topology.peer``) when they are on one host, see the
    same GPU list, one GPU reaches the other's (or they share one), and both can import
    cuda-python, through which the ``ipc`` transport opens and copies peer memory."""
    device = resolve_device(device, group)
    world = dist.get_world_size(group)
    if world == 1:
        return Topology(device.type, world, True, True, device.type == "cuda")
    if device.type != "cuda":
        if not hosts_told():
            return Topology(device.type, world, True, True, False)
        hosts = _host_indices(gather_objects(host_id(), group))
        return Topology("cpu", world, len(set(hosts)) == 1, True, False, hosts=hosts)
    with torch.cuda.device(device):
        uuids = [str(getattr(torch.cuda.get_device_properties(i), "uuid", i))
                 for i in range(torch.cuda.device_count())]
        infos = gather_objects((host_id(), uuids, device.index, driver_available()), group)
        hosts = _host_indices([i[0] for i in infos])
        one_host = len(set(hosts)) == 1
        same_gpus = all(i[1] == infos[0][1] for i in infos)
        indices = tuple(sorted({i[2] for i in infos}))
        me = dist.get_rank(group)
        # my row of the IPC matrix: ranks on my host with my GPU list whose GPU mine reaches
        row = [b != me and infos[b][:2] == infos[me][:2] and infos[b][3] and infos[me][3] and (
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


def pair_plan(topo: Topology, *, local: str | None = None) -> Plan:
    """The transport of every pair of ranks: each registered ``auto`` rule but ``peers``', on
    the pair's two-rank topology; pairs on one host take ``local`` instead when given
    (``SparspConfig.local_transport``)."""
    G = topo.world_size
    plan = [[None] * G for _ in range(G)]
    for a in range(G):
        for b in range(a + 1, G):
            pair = topo.pair(a, b)
            name = local if local is not None and pair.one_host else \
                choose_by_rules(pair, exclude=(PEERS,))[0]
            plan[a][b] = plan[b][a] = name
    return tuple(tuple(row) for row in plan)


def plan_names(plan: Plan) -> set[str]:
    """The transports a plan uses."""
    return {n for row in plan for n in row if n is not None}


def describe_plan(plan: Plan) -> str:
    """``"host for 0-1, 2-3; nccl for 0-2, 0-3, 1-2, 1-3"``."""
    pairs: dict[str, list[str]] = defaultdict(list)
    for a in range(len(plan)):
        for b in range(a + 1, len(plan)):
            pairs[plan[a][b]].append(f"{a}-{b}")
    return "; ".join(f"{name} for {', '.join(p)}" for name, p in sorted(pairs.items()))


__all__ = ["PEERS", "Plan", "choose_by_rules", "describe_plan", "host_id", "hosts_told", "pair_plan",
           "plan_names", "topology"]
