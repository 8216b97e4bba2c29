"""Choosing a transport: ``make_transport(name, group, *, device, timeout_s, local)``.

``name`` is a registered transport or ``auto`` (``SparspConfig.transport``). ``auto`` decides
once per group, the same way on every rank: the group's ``Topology`` (device type, one host or
several, the same GPU list everywhere, peer access between every pair of its GPUs;
``topology.py``) is gathered once, and among the registered transports whose ``auto`` rule
accepts it the one with the highest priority wins. The built-in rules (``nccl.py``,
``host.py``, ``ipc.py``):

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
one transport.

``local`` (``SparspConfig.local_transport``) forces the transport of the pairs on one host,
e.g. ``host`` on CPU, whose own rule declines CPU tensors; where ``auto`` then finds the pairs
wanting different transports, or the on-host pairs wanting another than the rules pick for the
group, it builds ``peers`` with that plan. The chosen transport is logged once per process on
the ``sparsp`` logger.
"""

from __future__ import annotations

import logging

from .base import Topology, Transport, TransportName, transport_names, transport_spec
from .topology import PEERS, Plan, choose_by_rules, describe_plan, host_id, pair_plan, plan_names, topology

log = logging.getLogger("sparsp")
_LOGGED: set[tuple[str, str]] = set()


def _name(value: str, source: str) -> str:
    name = value.strip().lower()
    if name not in transport_names(with_auto=True):
        raise ValueError(f"{source}={value!r} is not a transport; allowed: "
                         f"{list(transport_names(with_auto=True))}")
    return name


def check_local(local: str | None) -> str | None:
    """``local`` checked: None or a registered transport other than ``peers``."""
    if local is None:
        return None
    allowed = [n for n in transport_names() if n != PEERS]
    if local not in allowed:
        raise ValueError(f"local_transport={local!r} is not a transport; allowed: {allowed}")
    return local


def choose(topo: Topology, *, local: str | None = None) -> tuple[str, str, Plan | None]:
    """(transport name, reason, the pair plan ``peers`` is to use, else None) for ``auto``."""
    chosen, reason = choose_by_rules(topo)
    local = check_local(local)
    if local is None or topo.world_size < 2:
        return chosen, reason, None
    plan = pair_plan(topo, local=local)
    if chosen == PEERS or plan_names(plan) != {chosen}:
        return PEERS, f"local_transport={local}: {describe_plan(plan)}", plan
    return chosen, reason, None


def choose_auto(group=None, device=None, *, local: str | None = None) -> tuple[str, str]:
    """(transport name, reason) for ``auto``; collective over ``group`` for CUDA devices."""
    return choose(topology(group, device), local=local)[:2]


def make_transport(name: str = "auto", group=None, *, device=None, timeout_s: float = 60.0,
                   local: str | None = None, **options) -> Transport:
    """Build the transport ``name`` (or the ``auto`` choice) for ``group``.

    ``local``: the transport of the pairs on one host (``SparspConfig.local_transport``), for
    ``auto`` and ``peers``; another explicit ``name`` ignores it. ``options`` go to the slot
    transports (``window``, ``slot_bytes``, ``chunk_bytes``, ``tag``, ``stream_waits``);
    ``nccl`` takes none and ignores them.
    """
    chosen, reason = _name(name, "transport"), "requested"
    if chosen == TransportName.AUTO.value:
        chosen, reason, plan = choose(topology(group, device), local=local)
        if plan is not None:
            options = {**options, "plan": plan}
    elif chosen == PEERS and check_local(local) is not None:
        options = {**options, "plan": pair_plan(topology(group, device), local=local)}
    spec = transport_spec(chosen)
    if chosen == TransportName.NCCL.value:
        transport = spec.factory(group, timeout_s=timeout_s, device=device)
    else:
        transport = spec.factory(group, timeout_s=timeout_s, device=device, **options)
    if (chosen, reason) not in _LOGGED:
        _LOGGED.add((chosen, reason))
        log.info("sparsp transport: %s (%s)", transport.describe(), reason)
    return transport


__all__ = ["check_local", "choose", "choose_auto", "choose_by_rules", "host_id", "make_transport",
           "topology"]
