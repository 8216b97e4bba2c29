"""Per-peer transports: one composite ``Transport`` whose peers each go through the transport
of their pair.

A group that spans two hosts with several GPUs each has no single good transport: ``nccl`` is
the only one that crosses hosts, but inside a host the copy-engine paths beat it (``ipc`` over
NVLink / PCIe P2P, ``host`` through pinned host memory: 34.3 against 21.5 GB/s without P2P on
the 2×H200 box, docs/transport.md). So the choice is made per pair of ranks, by the same
registered ``auto`` rules as for a whole group, applied to the pair's own two-rank topology
(``Topology.pair``): ``ipc`` between GPUs of one host with peer access, ``host`` between GPUs
of one host without it, ``nccl`` between hosts.

``PeerTransport`` holds one sub-transport per (transport, connected set of ranks whose pairs it
serves) and delegates every protocol step for peer p to the sub-transport of the pair (me, p):

- transports that keep shared state per group (``ipc``, ``host``: slot windows, flag pages,
  barriers) get a process group of their own ranks (``dist.new_group`` with local
  synchronisation: only the members take part), made once per set of ranks and reused; a
  peer's rank there is its index in the sorted member list, and every error they raise is
  re-raised naming the peer's rank in the caller's group;
- ``nccl`` addresses any rank of the caller's group and sets nothing up, so one ``nccl``
  sub-transport on the caller's group serves all of its pairs.

One call may use several transports at once (``host`` inside each host and ``nccl`` between
them, in the same round). The ``nccl`` transport holds a round's sends back until the round's
fetch (base.py); when that fetch goes through another sub-transport, ``fetch`` first calls
``flush`` on the others, so the send leaves before this rank waits on the other path. Every
guarantee holds per pair, because each pair has exactly one transport: a silent peer raises
``TimeoutError`` naming it, ``close`` frees every sub-transport's segments, and the byte
counters are the sub-transports' own, summed per peer of the caller's group.

``auto`` picks ``peers`` (rule below, priority 30, above ``ipc``) when the pairs of a group want
different transports. ``SparspConfig.local_transport`` makes every pair on one host use that
transport instead of its own rule's choice (``select.py``: tests run ``host`` on CPU this way,
whose rule declines CPU tensors; a GPU box can measure ``host`` beside ``nccl`` with it); pairs
between hosts keep their rule's choice. ``topology.py`` gathers the group's topology and holds
the per-pair rules (``pair_plan``), which ``select.py`` uses too.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..groups import global_rank, resolve_device
from .base import Handle, Topology, Transport, register_transport, transport_spec
from .topology import PEERS as NAME, Plan, describe_plan, pair_plan, plan_names, topology

# Transports that address every rank of the caller's group and set up nothing collectively:
# one instance on the caller's group serves all their pairs (no process group of their own).
GROUP_FREE = ("nccl",)


def components(plan: Plan, name: str) -> list[tuple[int, ...]]:
    """The connected sets of ranks joined by pairs that ``name`` serves, in order of their
    lowest rank (the same list on every rank)."""
    G = len(plan)
    parent = list(range(G))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    used = set()
    for a in range(G):
        for b in range(a + 1, G):
            if plan[a][b] == name:
                parent[root(a)] = root(b)
                used.update((a, b))
    sets: dict[int, list[int]] = defaultdict(list)
    for r in sorted(used):
        sets[root(r)].append(r)
    return sorted((tuple(s) for s in sets.values()), key=lambda s: s[0])


_SUBGROUPS: dict[tuple, object] = {}


def subgroup(group, ranks: tuple[int, ...]):
    """A process group of ``group``'s ranks ``ranks`` (only they call this), made once per
    process and set of ranks; ``group`` itself when it has no other rank."""
    if len(ranks) == dist.get_world_size(group):
        return group
    members = tuple(global_rank(group, r) for r in ranks)
    backend = dist.get_backend(group)
    key = (id(dist.group.WORLD), members, backend)
    pg = _SUBGROUPS.get(key)
    if pg is None:
        # local synchronisation: the other ranks of ``group`` make their own sub-groups meanwhile
        pg = dist.new_group(list(members), backend=backend, use_local_synchronization=True)
        _SUBGROUPS[key] = pg
    return pg


@dataclass
class _Sub:
    """One sub-transport and where its ranks are in the caller's group."""

    name: str
    ranks: tuple[int, ...]  # caller's group ranks, in sub-group rank order
    transport: Transport

    def local(self, rank: int) -> int:
        return self.ranks.index(rank)

    def where(self, me: int, peer: int | None = None) -> str:
        """The sub-transport, and how its messages number ranks when that differs."""
        if self.name in GROUP_FREE:
            return self.name
        there = f"this is rank {self.local(me)}" + (
            "" if peer is None else f" and peer {peer} is rank {self.local(peer)}")
        return f"{self.name} (sub-group of ranks {list(self.ranks)}, where {there})"


class _PeerHandle:
    """A sub-transport's handle whose failure names the peer in the caller's group."""

    def __init__(self, handle: Handle, owner: "PeerTransport", peer: int, what: str) -> None:
        self._handle, self._owner, self._peer, self._what = handle, owner, peer, what

    def wait(self) -> None:
        self._owner._guard(self._peer, self._what, self._handle.wait)


class PeerTransport(Transport):
    """Each peer through the transport of its pair (``plan``); see the module docstring."""

    name = NAME

    def __init__(self, group=None, *, timeout_s: float = 60.0, device=None, plan: Plan | None = None,
                 **options) -> None:
        # No Transport.__init__: the byte counters are the sub-transports' (properties below).
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.epoch = 0
        self.device = resolve_device(device, group)
        self._closed = False
        if plan is None:
            plan = pair_plan(topology(group, self.device))
        G = self.world_size
        if len(plan) != G or any(len(row) != G for row in plan) or any(
                plan[a][b] != plan[b][a] or (plan[a][b] is None) != (a == b)
                for a in range(G) for b in range(G)):
            raise ValueError(f"plan must be a symmetric {G}x{G} table of transport names with "
                             f"None on the diagonal, got {plan!r}")
        self.plan: Plan = tuple(tuple(row) for row in plan)
        self._subs: list[_Sub] = []
        self._route: dict[int, tuple[_Sub, int]] = {}
        try:
            for name in sorted({n for row in self.plan for n in row if n is not None}):
                self._build(name, timeout_s, options)
        except BaseException:
            self.close()
            raise

    def _build(self, name: str, timeout_s: float, options: dict) -> None:
        """Make the sub-transport(s) of ``name`` this rank takes part in (collective over each
        one's ranks, in the same order on every rank: names sorted, sets by lowest rank)."""
        if name == NAME:
            raise ValueError(f"a pair's transport cannot be {NAME!r} itself (plan {describe_plan(self.plan)})")
        spec = transport_spec(name)
        if self.device.type not in spec.devices:
            raise ValueError(f"transport {name!r} (pairs {describe_plan(self.plan)}) does not move "
                             f"{self.device.type} tensors")
        mine = [p for p in range(self.world_size) if self.plan[self.rank][p] == name]
        if name in GROUP_FREE:
            if not mine:
                return
            sub = _Sub(name, tuple(range(self.world_size)),
                       spec.factory(self.group, timeout_s=timeout_s, device=self.device))
            self._subs.append(sub)
            for p in mine:
                self._route[p] = (sub, p)
            return
        for ranks in components(self.plan, name):
            if self.rank not in ranks:
                continue
            pg = subgroup(self.group, ranks)
            sub = _Sub(name, ranks, spec.factory(pg, timeout_s=timeout_s, device=self.device, **options))
            self._subs.append(sub)
            for p in mine:
                self._route[p] = (sub, sub.local(p))

    # -- routing and errors -------------------------------------------------------------------

    def _to(self, peer: int) -> tuple[_Sub, int]:
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")
        try:
            return self._route[peer]
        except (KeyError, TypeError):
            raise ValueError(f"rank {self.rank}: peer {peer!r} is not another rank of a group of "
                             f"{self.world_size}") from None

    def _guard(self, peer: int | None, what: str, fn, *args):
        """``fn(*args)``; an error is re-raised (same kind) naming this rank, the peer in the
        caller's group and the sub-transport (the sub-transport's own message numbers ranks
        within its sub-group)."""
        try:
            return fn(*args)
        except (TimeoutError, ValueError, RuntimeError) as e:
            if peer is None:
                where = what
            else:
                sub, _ = self._route[peer]
                where = f"{what} peer {peer} over {sub.where(self.rank, peer)}"
            kind = type(e) if type(e) in (TimeoutError, ValueError, RuntimeError) else (
                TimeoutError if isinstance(e, TimeoutError) else RuntimeError)
            raise kind(f"rank {self.rank}: {where}: {e}") from e

    # -- the protocol ---------------------------------------------------------------------

    def send_buffer(self, peer: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        sub, lp = self._to(peer)
        return self._guard(peer, "send_buffer for", sub.transport.send_buffer, lp, numel, dtype)

    def publish(self, peer: int, buf: torch.Tensor) -> None:
        sub, lp = self._to(peer)
        self._guard(peer, "publish to", sub.transport.publish, lp, buf)

    def fetch(self, peer: int, out: torch.Tensor):
        sub, lp = self._to(peer)
        # the round ends here: sends the other transports hold back for their own fetch leave now
        for other in self._subs:
            if other is not sub:
                self._guard(None, f"flushing {other.name} before a fetch from peer {peer}",
                            other.transport.flush)
        handle = self._guard(peer, "fetch from", sub.transport.fetch, lp, out)
        return _PeerHandle(handle, self, peer, "fetch from")

    def release(self, peer: int) -> None:
        sub, lp = self._to(peer)
        self._guard(peer, "release of", sub.transport.release, lp)

    def settle(self) -> None:
        for sub in self._subs:
            self._guard(None, f"settle of {sub.where(self.rank)}", sub.transport.settle)

    def flush(self) -> None:
        for sub in self._subs:
            self._guard(None, f"flushing {sub.name}", sub.transport.flush)

    def fence(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} transport is closed")
        for sub in self._subs:
            self._guard(None, f"fence of {sub.where(self.rank)}", sub.transport.fence)
        self.epoch += 1

    def reserve(self, nbytes: int) -> None:
        for sub in self._subs:
            self._guard(None, f"reserve of {sub.where(self.rank)}", sub.transport.reserve, nbytes)

    def close(self) -> None:
        """Close every sub-transport (each frees its own segments), even when one fails."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for sub in self._subs:
            try:
                sub.transport.close()
            except Exception as e:  # noqa: BLE001 - the others must still be closed
                errors.append(f"{sub.name}: {e}")
        if errors:
            raise RuntimeError(f"rank {self.rank}: closing the peers transport: {'; '.join(errors)}")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what serves whom ---------------------------------------------------------------------

    def transport_of(self, peer: int) -> str:
        """The name of the transport that serves ``peer``."""
        return self._to(peer)[0].name

    def sub_transports(self) -> list[tuple[str, tuple[int, ...], Transport]]:
        """(name, ranks of the caller's group it spans, transport) of this rank's sub-transports."""
        return [(s.name, s.ranks, s.transport) for s in self._subs]

    def describe(self) -> str:
        subs = "; ".join(f"{s.name} over ranks {list(s.ranks)}: {s.transport.describe()}"
                         for s in self._subs)
        return f"peers ({describe_plan(self.plan)}) [rank {self.rank}: {subs}]"

    # -- byte counters: the sub-transports', per peer of the caller's group ---------------

    def _sum(self, attr: str) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for sub in self._subs:
            for lp, n in getattr(sub.transport, attr).items():
                out[sub.ranks[lp]] += n  # sub-group rank → the caller's group rank
        return out

    @property
    def bytes_sent(self) -> dict[int, int]:  # type: ignore[override]
        return self._sum("bytes_sent")

    @property
    def bytes_received(self) -> dict[int, int]:  # type: ignore[override]
        return self._sum("bytes_received")

    def reset_counters(self) -> None:
        for sub in self._subs:
            sub.transport.reset_counters()


def _auto(topo: Topology) -> str | None:
    """Accept a group whose pairs want different transports."""
    if topo.world_size < 2:
        return None
    plan = pair_plan(topo)
    if len(plan_names(plan)) > 1:
        return f"per pair: {describe_plan(plan)}"
    return None


@register_transport(NAME, auto=_auto, priority=30)
def _make_peers(group=None, *, timeout_s: float = 60.0, device=None, **options):
    return PeerTransport(group, timeout_s=timeout_s, device=device, **options)
