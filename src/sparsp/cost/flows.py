"""The fabric as shared resources, and transfers as fluid flows over them.

A payload from GPU ``src`` to GPU ``dst`` uses a path of resources (``route``: the GPUs' links,
their duplex caps, the host memory a host-staged payload passes through, switch uplinks, the
sockets' link, and between hosts the NICs); every flow in flight gets its max-min fair share of
each resource on its path (``fair_rates``), recomputed whenever a flow or a kernel step starts
or ends (``run``). Capacities are GB/s (10⁹ bytes/s) per direction unless a docstring says
otherwise; times are milliseconds.

``cost.timeline`` builds the tasks of one call or of several calls at once (a mesh's groups,
whose transfers share the machine) and runs them here.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable

from .machine import Profile

__all__ = ["capacities", "collective_gbps", "exchange_gbps", "fair_rates", "gather_gbps", "route", "run"]


def capacities(profile: Profile, gpus: int | Iterable[int]) -> dict[str, float]:
    """Every shared resource of a job on ``gpus`` (a count: GPUs 0 … n−1; or the GPUs
    themselves) of ``profile`` → capacity in GB/s."""
    gpus = sorted(range(gpus) if isinstance(gpus, int) else set(gpus))
    caps: dict[str, float] = {}
    for g in gpus:
        caps[f"tx{g}"] = caps[f"rx{g}"] = profile.link_gbps
        if profile.duplex_gbps is not None:
            caps[f"duplex{g}"] = profile.duplex_gbps
    sockets = sorted({profile.socket_of(g) for g in gpus})
    if profile.host_gbps is not None and not profile.peer_access:
        for s in sockets:
            caps[f"host{s}"] = profile.host_gbps
    if profile.inter_socket_gbps is not None:
        for a in sockets:
            for b in sockets:
                if a != b and profile.same_host_sockets(a, b):
                    caps[f"socket{a}->{b}"] = profile.inter_socket_gbps
    if profile.switch_uplink_gbps is not None and profile.gpus_per_switch > 1:
        for sw in sorted({profile.switch_of(g) for g in gpus}):
            caps[f"up{sw}"] = caps[f"down{sw}"] = profile.switch_uplink_gbps
    if profile.network_gbps is not None and len({profile.host_of(g) for g in gpus}) > 1:
        for n in sorted({profile.nic_of(g) for g in gpus}):
            caps[f"nictx{n}"] = caps[f"nicrx{n}"] = profile.network_gbps
    return caps


def route(profile: Profile, src: int, dst: int, caps: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """Resources a src→dst payload uses and the capacity it takes per payload byte.

    Inside a host: host-staged payloads are written into host memory on the sender's socket and
    read from it by the receiver's H2D copy (2 bytes of host traffic per payload byte; the read
    crosses the sockets' link if the receiver sits on the other socket); peer copies cross a
    switch uplink only between switches, and the sockets' link only between sockets. Between
    hosts: the sender's NIC and the receiver's, and, on a box without peer access (no GPUDirect
    RDMA either), the host memory of both ends twice each (the GPU's copy and the NIC's)."""
    hops: list[tuple[str, float]] = [(f"tx{src}", 1.0), (f"rx{dst}", 1.0), (f"duplex{src}", 1.0),
                                     (f"duplex{dst}", 1.0)]
    s_src, s_dst = profile.socket_of(src), profile.socket_of(dst)
    sw_src, sw_dst = profile.switch_of(src), profile.switch_of(dst)
    if profile.host_of(src) != profile.host_of(dst):
        hops += [(f"nictx{profile.nic_of(src)}", 1.0), (f"nicrx{profile.nic_of(dst)}", 1.0)]
        if not profile.peer_access:
            hops += [(f"up{sw_src}", 1.0), (f"down{sw_dst}", 1.0), (f"host{s_src}", 2.0), (f"host{s_dst}", 2.0)]
        return tuple(h for h in hops if h[0] in caps)
    if not profile.peer_access or sw_src != sw_dst:
        hops += [(f"up{sw_src}", 1.0), (f"down{sw_dst}", 1.0)]
    if not profile.peer_access:
        hops.append((f"host{s_src}", 2.0))
    if s_src != s_dst:
        hops.append((f"socket{s_src}->{s_dst}", 1.0))
    return tuple(h for h in hops if h[0] in caps)


def fair_rates(flows: dict[int, tuple[tuple[str, float], ...]], caps: dict[str, float]) -> dict[int, float]:
    """Max-min fair rates (GB/s) by progressive filling: raise every unfrozen flow's rate
    together until a resource saturates, freeze the flows through it, repeat. Each round sums
    a resource's load over its unfrozen users only, in the flows' order."""
    rate = {f: 0.0 for f in flows}
    users: dict[str, list[tuple[int, float]]] = {}
    for f, path in flows.items():
        for res, w in path:
            users.setdefault(res, []).append((f, w))
    active = {f for f, path in flows.items() if path}
    for f in set(flows) - active:  # nothing on its path limits it: not a real case, but finite
        rate[f] = math.inf
    live = users  # each resource's unfrozen users (a resource without any drops out)
    used = dict.fromkeys(users, 0.0)
    while active:
        step, tight, loads = math.inf, [], []
        for res, us in live.items():
            load = sum(w for _, w in us)
            loads.append((res, load))
            if load > 0:
                d = (caps[res] - used[res]) / load
                if d < step - 1e-12:
                    step, tight = d, [res]
                elif abs(d - step) <= 1e-12:
                    tight.append(res)
        step = max(step, 0.0)
        for f in active:
            rate[f] += step
        for res, load in loads:
            used[res] += step * load
        active -= {f for res in tight for f, _ in users[res]}
        live = {res: kept for res, us in live.items() if (kept := [(f, w) for f, w in us if f in active])}
    return rate


@functools.lru_cache(maxsize=64)
def exchange_gbps(profile: Profile) -> float:
    """What the model gives two GPUs exchanging at once (the ``bench transport`` setup), GB/s
    per direction, at efficiency 1. Cached per profile (a frozen, hashable value): every
    ``timeline`` asks for it, and ``strategy="auto"`` runs one per candidate per new demand."""
    caps = capacities(profile, 2)
    rates = fair_rates({0: route(profile, 0, 1, caps), 1: route(profile, 1, 0, caps)}, caps)
    return min(rates.values())


def collective_gbps(profile: Profile) -> float:
    """Per-rank rate of the metadata all-gather, GB/s: the two-GPU exchange at NCCL's efficiency
    (the process group's backend; the default transport's where the profile has no ``nccl``)."""
    names = {t.name for t in profile.transports}
    return exchange_gbps(profile) * profile.transport("nccl" if "nccl" in names else None).efficiency


def gather_gbps(profile: Profile, gpus: Iterable[int]) -> float:
    """The metadata all-gather's per-rank rate for a group on ``gpus``: ``collective_gbps``
    inside one host; across hosts, no more than one NIC at the network transport's efficiency."""
    rate = collective_gbps(profile)
    if len({profile.host_of(g) for g in gpus}) > 1:
        rate = min(rate, profile.network_gbps * profile.network_figure.efficiency)
    return rate


def _changed_rates(flows: dict[int, tuple], caps: dict[str, float], before: dict[int, tuple],
                   rates: dict[int, float]) -> dict[int, float]:
    """``fair_rates`` of ``flows``, given the rates of the flows ``before``: a max-min fair
    share depends only on the flows linked to a flow through shared resources, so only the
    flows linked to one that started, ended or changed its path are solved again (a kernel
    starting or ending alone changes none; a round of 64 pairs, each on its own links, one
    pair at a time)."""
    changed = {i for i in flows.keys() | before.keys() if flows.get(i) != before.get(i)}
    if not changed:
        return rates
    users: dict[str, list[int]] = {}
    for i, path in flows.items():
        for res, _ in path:
            users.setdefault(res, []).append(i)
    todo = [res for i in changed for path in (flows.get(i, ()), before.get(i, ())) for res, _ in path]
    linked, seen = set(changed) & flows.keys(), set()
    while todo:
        res = todo.pop()
        if res in seen:
            continue
        seen.add(res)
        for i in users.get(res, ()):
            if i not in linked:
                linked.add(i)
                todo.extend(r for r, _ in flows[i])
    out = {i: rates[i] for i in flows if i not in linked}
    out.update(fair_rates({i: p for i, p in flows.items() if i in linked}, caps))
    return {i: out[i] for i in flows}


# --- the fluid simulation ------------------------------------------------------------------------


def run(tasks: list, caps: dict[str, float], paths) -> None:
    """Event-driven fluid simulation; fills every task's ``start`` and ``end`` (ms).

    ``tasks``: ``cost.timeline.Task``s (``after``: the tasks each waits for; ``not_before``:
    when its host has issued it; ``duration``: its lead time; a transfer's ``nbytes`` then flow
    at their fair rate). ``paths(task, busy)``: the task's path at its transport's share while
    the (call, rank) pairs in ``busy`` compute. Only the tasks in flight are visited per event, so a call of
    64 ranks (≈ 8,000 tasks) takes seconds, not minutes."""
    n = len(tasks)
    waiting = [len(t.after) for t in tasks]  # dependencies not yet done
    children: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for a in t.after:
            children[a].append(i)
    left = [t.nbytes for t in tasks]  # bytes still to flow
    ready_at = [math.nan] * n  # when a transfer's latency/pack ends and its bytes may flow
    now, finished, eps = 0.0, 0, 1e-9
    free = [i for i in range(n) if not waiting[i]]  # every dependency done, not started
    held: list[tuple[float, int]] = []  # (not_before, task): its host has not issued it yet
    active: set[int] = set()  # started, not done
    last: tuple[dict, dict] = ({}, {})  # the flows of the last event and their rates

    def finish(i: int) -> None:
        nonlocal finished
        tasks[i].end = now
        active.discard(i)
        finished += 1
        for c in children[i]:
            waiting[c] -= 1
            if not waiting[c]:
                free.append(c)

    while finished < n:
        while free or (held and held[0][0] <= now + eps):  # start what is ready
            while held and held[0][0] <= now + eps:
                free.append(heapq.heappop(held)[1])
            i = free.pop()
            t = tasks[i]
            if t.not_before > now + eps:
                heapq.heappush(held, (t.not_before, i))
                continue
            t.start = now
            ready_at[i] = max(now + t.duration, t.end_not_before)
            if ready_at[i] <= now + eps and (t.kind != "transfer" or left[i] <= 0):
                finish(i)  # zero-length: done at once
            else:
                active.add(i)
        if finished == n:
            break
        order = sorted(active)  # index order, as the rates' sums are taken
        busy = {(tasks[i].call, tasks[i].rank) for i in order
                if tasks[i].kind == "compute" and ready_at[i] > now + eps}
        flowing = {i: paths(tasks[i], busy) for i in order
                   if tasks[i].kind == "transfer" and ready_at[i] <= now + eps and left[i] > 0}
        rates = _changed_rates(flowing, caps, *last)
        last = (flowing, rates)
        events = [ready_at[i] for i in order if ready_at[i] > now + eps]
        if held:
            events.append(held[0][0])
        events += [now + left[i] / (rates[i] * 1e6) for i in flowing if rates[i] > 0]
        if not events:
            raise AssertionError("simulation stalled: a dependency cycle in the schedule")
        nxt = min(events)
        for i in flowing:
            left[i] = max(0.0, left[i] - rates[i] * 1e6 * (nxt - now))
        now = nxt
        for i in order:
            t = tasks[i]
            if ready_at[i] > now + eps:
                continue
            # done: no bytes left, or fewer than the clock can resolve at this rate (a fast link
            # late in a long call would otherwise never advance ``now``)
            if t.kind != "transfer" or left[i] <= max(1e-6, 1e-12 * t.nbytes) or (
                    i in flowing and rates[i] > 0 and left[i] / (rates[i] * 1e6) <= eps + 1e-15 * now):
                finish(i)
