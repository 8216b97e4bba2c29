"""The cost model's timeline: a ``Work`` scheduled on a machine ``Profile`` as the strategies
issue it, by the schedule their byte rule implies (``model.SCHEDULES``):

* ``relay-ring`` (byte rules ``full-shards`` and ``relay``): local shard first; hop k (from
  r−1) lands in the buffer freed by step k−2 (double buffering) once the sender holds the
  shard; step k computes it. A dense strategy runs the same kernel on every block (thresholds
  ignored).
* ``direct``: round k fetches D[r, ·, r−k] directly from its owner; fetches run
  ``prefetch`` rounds ahead; the local shard is computed while round 1 is in flight (§5, §6.3).
* ``all-to-all``: Q, K, V of my heads in, the kernel over the whole sequence
  (one call per (query slice, key slice)), the output back; each all-to-all is G−1 sequential
  rounds; nothing overlaps.

Transfers are fluid flows: every flow in flight shares each resource on its path (links,
duplex caps, host memory, switch uplinks, the sockets' interconnect) max-min fairly, and rates
are recomputed whenever a flow or a kernel step starts or ends: while a kernel step runs at
either end, a transport reaches its share under load (``TransportFigure.loaded_efficiency``).
A message first pays the transport's latency and the sender's pack (bytes / device memory
bandwidth), then its bytes flow.

Kernel steps run at the measured rate of their shape, layout and density
(``Profile.kernel_rate``). None starts before the host launched it, and no first-round
transfer before both ends' hosts issued it (``_HostIssue``): every call's mask phase ends in the start
of its one host read, which lands when the device's mask path is done. In order
(``Work.local_first`` false, the all-to-all), the host then finishes the read and issues the run's
counted ops (``Work.finish_ops``, ``Work.issue_ops``, ``Work.run_ops``) and a launch per kernel
call, the local kernel among them. Local first, the host launches the local kernel before it
waits for the read (``Work.early_ops``), so the kernel starts when the device's mask path is
done; the host's finish and the run's ops up to the first remote kernel run beside it, and so
does the first round's pack and transfer (a side stream, not the compute stream); the remote
step waits for its transfer, the local step and its launch. A call whose device work is short
(LTX sizes, the all-to-all's per-slice copies and merges) waits for its host.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from .model import SYNCS_PER_CALL, Work
from .profiles import Profile, TransportFigure


def capacities(profile: Profile, ranks: int) -> dict[str, float]:
    """Every shared resource of a ``ranks``-GPU job on ``profile`` → capacity in GB/s."""
    caps: dict[str, float] = {}
    for g in range(ranks):
        caps[f"tx{g}"] = caps[f"rx{g}"] = profile.link_gbps
        if profile.duplex_gbps is not None:
            caps[f"duplex{g}"] = profile.duplex_gbps
    sockets = sorted({profile.socket_of(g) for g in range(ranks)})
    if profile.host_gbps is not None and not profile.peer_access:
        for s in sockets:
            caps[f"host{s}"] = profile.host_gbps
    if profile.inter_socket_gbps is not None:
        for a in sockets:
            for b in sockets:
                if a != b:
                    caps[f"socket{a}->{b}"] = profile.inter_socket_gbps
    if profile.switch_uplink_gbps is not None and profile.gpus_per_switch > 1:
        for sw in sorted({profile.switch_of(g) for g in range(ranks)}):
            caps[f"up{sw}"] = caps[f"down{sw}"] = profile.switch_uplink_gbps
    return caps


def route(profile: Profile, src: int, dst: int, caps: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """Resources a src→dst payload uses and the capacity it takes per payload byte.

    Host-staged payloads are written into host memory on the sender's socket and read from it
    by the receiver's H2D copy (2 bytes of host traffic per payload byte; the read crosses the
    sockets' link if the receiver sits on the other socket). Peer copies cross a switch uplink
    only between switches, and the sockets' link only between sockets."""
    hops: list[tuple[str, float]] = [(f"tx{src}", 1.0), (f"rx{dst}", 1.0), (f"duplex{src}", 1.0),
                                     (f"duplex{dst}", 1.0)]
    s_src, s_dst = profile.socket_of(src), profile.socket_of(dst)
    sw_src, sw_dst = profile.switch_of(src), profile.switch_of(dst)
    if not profile.peer_access or sw_src != sw_dst:
        hops += [(f"up{sw_src}", 1.0), (f"down{sw_dst}", 1.0)]
    if not profile.peer_access:
        hops.append((f"host{s_src}", 2.0))
    if s_src != s_dst:
        hops.append((f"socket{s_src}->{s_dst}", 1.0))
    return tuple(h for h in hops if h[0] in caps)


def fair_rates(flows: dict[int, tuple[tuple[str, float], ...]], caps: dict[str, float]) -> dict[int, float]:
    """Max-min fair rates (GB/s) by progressive filling: raise every unfrozen flow's rate
    together until a resource saturates, freeze the flows through it, repeat."""
    rate = {f: 0.0 for f in flows}
    used = {res: 0.0 for res in caps}
    users: dict[str, list[tuple[int, float]]] = {}
    for f, path in flows.items():
        for res, w in path:
            users.setdefault(res, []).append((f, w))
    active = {f for f, path in flows.items() if path}
    for f in set(flows) - active:  # nothing on its path limits it: not a real case, but finite
        rate[f] = math.inf
    while active:
        step, tight = math.inf, []
        for res, us in users.items():
            load = sum(w for f, w in us if f in active)
            if load > 0:
                d = (caps[res] - used[res]) / load
                if d < step - 1e-12:
                    step, tight = d, [res]
                elif abs(d - step) <= 1e-12:
                    tight.append(res)
        step = max(step, 0.0)
        for f in active:
            rate[f] += step
        for res, us in users.items():
            used[res] += step * sum(w for f, w in us if f in active)
        frozen = {f for res in tight for f, _ in users[res]}
        active -= frozen
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


# --- the timeline ------------------------------------------------------------------------------


@dataclass
class Task:
    """One thing a rank does: ``fixed`` (per-call cost), ``compute`` (a kernel step) or
    ``transfer`` (an incoming payload of round ``round``)."""

    kind: str
    rank: int
    round: int
    after: list[int]
    duration: float = 0.0  # ms; for a transfer: latency + pack before its bytes flow
    nbytes: float = 0.0
    path: tuple[tuple[str, float], ...] = ()  # capacity per payload byte at efficiency 1
    sender: int | None = None
    phase: int = 1  # all-to-all: 1 = inputs in, 2 = outputs back
    start: float = math.nan
    end: float = math.nan
    efficiency: float = 1.0  # a transfer: its transport's share of the path alone ...
    loaded: float = 1.0  # ... and while a compute step runs at either end
    not_before: float = 0.0  # ms: the host has issued it (its first kernel launch) ...
    end_not_before: float = 0.0  # ... and its last kernel, which then still runs (ms)


@dataclass
class Timeline:
    """A simulated call: every task with its start and end, per rank."""

    work: Work
    tasks: list[Task]
    finish: list[float] = field(default_factory=list)

    @property
    def latency_ms(self) -> float:
        """The call's latency: the slowest rank's finish."""
        return max(self.finish)

    @property
    def critical_rank(self) -> int:
        return max(range(len(self.finish)), key=lambda r: self.finish[r])

    def of(self, rank: int, kind: str) -> list[Task]:
        return [t for t in self.tasks if t.rank == rank and t.kind == kind]

    def busy(self, rank: int, kind: str) -> float:
        """Time rank spends in ``kind`` (transfers: the union of in-flight intervals)."""
        spans = sorted((t.start, t.end) for t in self.of(rank, kind) if t.end > t.start)
        total, cur_a, cur_b = 0.0, None, None
        for a, b in spans:
            if cur_b is None or a > cur_b:
                total += 0.0 if cur_b is None else cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        return total + (0.0 if cur_b is None else cur_b - cur_a)


def _ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e6)


def timeline(work: Work, profile: Profile, *, transport: TransportFigure | str | None = None, head_dim: int = 128,
             prefetch: int = 1, skip: frozenset = frozenset()) -> Timeline:
    """Schedule ``work`` on ``profile``. ``transport``: the call's, its figure in ``profile`` or a
    name (``Profile.transport``: None = the default; a name the profile lacks raises). ``skip`` ⊆
    {"compute", "transfer", "fixed"} makes those costs zero (what-if runs that name the
    bottleneck)."""
    G = work.ranks
    if G > profile.gpus:
        raise ValueError(f"{G} ranks exceed the {profile.gpus} GPUs of profile {profile.name}")
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    tf = profile.transport(transport)
    caps = capacities(profile, G)
    tasks: list[Task] = []

    def add(task: Task) -> int:
        tasks.append(task)
        return len(tasks) - 1

    def compute_ms(r: int, i: int) -> float:
        if "compute" in skip:
            return 0.0
        merge = _ms(work.merge_bytes[r][i], profile.hbm_gbps) if work.merge_bytes else 0.0
        rate = profile.kernel_rate(head_dim, heads=work.heads, tokens=work.tokens, layout=work.layout(i),
                                   density=work.density[r] if work.density else None)
        return work.flops[r][i] / (rate * 1e9) + merge

    def transfer(r: int, k: int, nbytes: int, after: list[int], phase: int = 1, not_before: float = 0.0) -> int:
        s = work.sender(r, k)
        if nbytes == 0 or "transfer" in skip:  # nothing to send: no message at all
            return add(Task("transfer", r, k, after, sender=s, phase=phase, not_before=not_before))
        pre = tf.latency_ms + _ms(nbytes, profile.hbm_gbps)  # handshake + the sender's pack
        return add(Task("transfer", r, k, after, pre, float(nbytes), route(profile, s, r, caps), s, phase,
                        efficiency=tf.efficiency, loaded=tf.under_load, not_before=not_before))

    gather_rate = collective_gbps(profile)
    fixed = []
    for r in range(G):
        # the mask phase ends in the start of the host read: the host issues its ops while the
        # device reads the inputs, waits for the metadata all-gather and selects the mask; the
        # read lands when both are done
        device = SYNCS_PER_CALL * profile.sync_ms if G > 1 else 0.0  # a group of one waits for no peer
        device += _ms(work.mask_bytes[r], profile.hbm_gbps) if work.mask_bytes else 0.0
        device += _ms(work.gather_bytes[r], gather_rate) if work.gather_bytes else 0.0
        host = work.host_ops[r] * profile.op_ms if work.host_ops else 0.0
        # the read lands when both are done; ``call_after_ms`` comes after its start (_HostIssue)
        cost = profile.call_ms - profile.call_after + max(device, host)
        fixed.append(add(Task("fixed", r, 0, [], 0.0 if "fixed" in skip else cost)))
    issue = _HostIssue(work, profile, [0.0 if "fixed" in skip else tasks[f].duration for f in fixed],
                       free="fixed" in skip)

    def compute(r: int, i: int, after: list[int]) -> int:
        first, last = issue.launched(r, i)
        dur = compute_ms(r, i)
        return add(Task("compute", r, i, after, dur, not_before=first,
                        end_not_before=last + dur / max(1, work.launches[r][i])))

    if work.schedule == "all-to-all":
        _all_to_all(work, fixed, add, transfer, compute, issue)
    else:
        _overlapped(work, fixed, add, transfer, compute, prefetch, issue)
    for r in range(G):  # the host's last op (the output) ends the call at the earliest
        add(Task("fixed", r, 1, [fixed[r]], not_before=issue.done(r)))
    _run(tasks, caps)
    finish = [max(t.end for t in tasks if t.rank == r) for r in range(G)]
    return Timeline(work, tasks, finish)


class _HostIssue:
    """When the host has issued each kernel launch and the first round's transfers, from the
    counted ops in program order (``Profile.op_ms`` each; ``Work``'s ``*_ops``) and the
    launches (``Profile.launch_ms`` each: FA4's Python and the driver). The device waits for
    the host where it is ahead of it (LTX sizes); where it is behind (large shards), the host's
    issue is hidden.

    ``mask[r]``: when rank r's mask phase ends (``call_ms`` + the longer of its host ops and its
    device path): the host read's copy lands then. In order, the host's finish and the run
    start after that; local first, the host launches the local kernel as soon as it issued the
    mask phase and ``EARLY_OPS`` (``call_ms`` + its ops; the device starts it once the mask path
    is done), then waits for the read, and the finish and the run start when the read landed
    and the host reached its wait."""

    def __init__(self, work: Work, profile: Profile, mask: list[float], *, free: bool) -> None:
        self.work, self.profile, self.mask, self.free = work, profile, mask, free

    @staticmethod
    def _ops(values: tuple, r: int, default):
        """Rank r's entry of a ``Work`` count (``default`` when the work models none)."""
        return values[r] if values else default

    def local_launch(self, r: int) -> float:
        """(ms) local first: when the host has launched the local kernel."""
        w, p = self.work, self.profile
        before, _ = self._ops(w.early_ops, r, (0, 0))
        mask = self._ops(w.host_ops, r, 0)
        return p.call_ms - p.call_after + (mask + before) * p.op_ms + p.launch_ms

    def run_start(self, r: int) -> float:
        """(ms) when the host has finished the read and begins the run's ops."""
        w, p = self.work, self.profile
        read = self.mask[r]
        if w.local_first:
            _, after = self._ops(w.early_ops, r, (0, 0))
            read = max(read, self.local_launch(r) + after * p.op_ms)
        # the fence and the read's finish (``Profile.call_after_ms``), then the finish's ops
        return read + (0.0 if self.free else p.call_after) + self._ops(w.finish_ops, r, 0) * p.op_ms

    def _slots(self, r: int) -> int:
        # the run's kernel launches: one per step (relay ring, direct: a step without kept
        # blocks is walked all the same; local first, the local step's was before the read),
        # or the one step's many (all-to-all)
        w = self.work
        if w.schedule == "all-to-all":
            return w.launches[r][0]
        return len(w.flops[r]) - (1 if w.local_first else 0)

    def _at(self, r: int, j: int) -> float:
        """(ms) when the host has launched the run's j-th kernel call (from 0)."""
        first, last, _ = self._ops(self.work.run_ops, r, (0, 0, 0))
        n = self._slots(r)
        ops = first + (last - first) * j / (n - 1) if n > 1 else first
        return self.run_start(r) + ops * self.profile.op_ms + (j + 1) * self.profile.launch_ms

    def launched(self, r: int, step: int) -> tuple[float, float]:
        """(ms) when the host has launched compute step ``step``'s first kernel and its last."""
        if self.free:
            return 0.0, 0.0
        if self.work.schedule == "all-to-all":
            return self._at(r, 0), self._at(r, self._slots(r) - 1)
        if self.work.local_first:
            at = self.local_launch(r) if step == 0 else self._at(r, step - 1)
            return at, at
        return self._at(r, step), self._at(r, step)

    def issued(self, r: int) -> float:
        """(ms) when the host has issued the run's first fetch (and the first round's pack and
        publish before it; in either order no kernel launch comes first)."""
        if self.free:
            return 0.0
        return self.run_start(r) + self._ops(self.work.issue_ops, r, 0) * self.profile.op_ms

    def done(self, r: int) -> float:
        """(ms) when the host has issued the call's every op."""
        if self.free:
            return 0.0
        _, last, tail = self._ops(self.work.run_ops, r, (0, 0, 0))
        return self.run_start(r) + (last + tail) * self.profile.op_ms + self._slots(r) * self.profile.launch_ms


def _overlapped(work: Work, fixed, add, transfer, compute, prefetch: int, issue: _HostIssue) -> None:
    """The ``relay-ring`` schedule (double-buffered relay) and ``direct`` (prefetched)."""
    G = work.ranks
    T = [[None] * G for _ in range(G)]  # T[r][k]: transfer of round k into r
    C = [[None] * G for _ in range(G)]  # C[r][i]: compute step i of r
    ring = work.schedule == "relay-ring"
    ahead = 1 if ring else prefetch
    for r in range(G):
        # local first: launched before the host read, it starts once the mask path is done
        C[r][0] = compute(r, 0, [fixed[r]])
    for k in range(1, G):
        for r in range(G):
            s = work.sender(r, k)
            after = [fixed[r], fixed[s]]
            j = k - ahead  # the round whose landing lets this one be issued
            not_before = 0.0
            if j >= 1:
                # Issued after the wait on round j, on both ends; the sender's pack/publish is
                # queued on its compute stream behind step j−1; the receive buffer is the one
                # step j−1 read (ring-like: the local shard's buffer too; sparsp keeps its own).
                after += [T[r][j], T[s][j], C[s][j - 1]]
                if ring or j - 1 >= 1:
                    after.append(C[r][j - 1])
            else:
                # the first rounds start once both hosts issued them; local first, they are
                # packed and sent on a side stream beside the local kernel (the pack is the
                # transfer's own lead time in either order, never the compute stream's)
                not_before = max(issue.issued(r), issue.issued(s))
            T[r][k] = transfer(r, k, work.recv[r][k - 1], after, not_before=not_before)
        for r in range(G):
            C[r][k] = compute(r, k, [C[r][k - 1], T[r][k]])


def _all_to_all(work: Work, fixed, add, transfer, compute, issue: _HostIssue) -> None:
    """All-to-all in (G−1 sequential rounds, the first once both hosts issued it), one compute
    step, all-to-all out; no overlap."""
    G = work.ranks
    prev = {r: [fixed[r]] for r in range(G)}
    for k in range(1, G):
        cur = {r: transfer(r, k, work.recv[r][k - 1], prev[r] + prev[work.sender(r, k)],
                           not_before=max(issue.issued(r), issue.issued(work.sender(r, k))) if k == 1 else 0.0)
               for r in range(G)}
        prev = {r: [cur[r]] for r in range(G)}
    C = {r: compute(r, 0, prev[r]) for r in range(G)}
    prev = {r: [C[r]] for r in range(G)}
    for k in range(1, G):
        cur = {r: transfer(r, k, work.back[r][k - 1], prev[r] + prev[work.sender(r, k)], phase=2)
               for r in range(G)}
        prev = {r: [cur[r]] for r in range(G)}


def _scaled(task: Task, busy: set[int]) -> tuple[tuple[str, float], ...]:
    """A transfer's path at its transport's share now: 1/efficiency of capacity per byte."""
    eff = task.loaded if task.rank in busy or task.sender in busy else task.efficiency
    return tuple((res, w / eff) for res, w in task.path)


def _run(tasks: list[Task], caps: dict[str, float]) -> None:
    """Event-driven fluid simulation; fills every task's start and end (ms)."""
    n = len(tasks)
    done = [False] * n
    started = [False] * n
    left = [t.nbytes for t in tasks]  # bytes still to flow
    ready_at = [math.nan] * n  # when a transfer's latency/pack ends and its bytes may flow
    now, finished = 0.0, 0
    eps = 1e-9
    while finished < n:
        progress, issued = True, []
        while progress:  # start what is ready; finish zero-length tasks at once
            progress, issued = False, []
            for i, t in enumerate(tasks):
                if started[i] or not all(done[a] for a in t.after):
                    continue
                if t.not_before > now + eps:  # the host has not issued it yet
                    issued.append(t.not_before)
                    continue
                started[i], t.start = True, now
                ready_at[i] = max(now + t.duration, t.end_not_before)
                if ready_at[i] <= now + eps and (t.kind != "transfer" or left[i] <= 0):
                    t.end, done[i] = now, True
                    finished += 1
                    progress = True
        if finished == n:
            break
        # a transfer flows at its transport's loaded share while a kernel step runs at either
        # end (``TransportFigure.loaded_efficiency``); compute steps start and end at events
        busy = {t.rank for i, t in enumerate(tasks) if t.kind == "compute" and started[i] and not done[i]
                and ready_at[i] > now + eps}
        flowing = {i: _scaled(tasks[i], busy) for i in range(n)
                   if started[i] and not done[i] and tasks[i].kind == "transfer" and ready_at[i] <= now + eps
                   and left[i] > 0}
        rates = fair_rates(flowing, caps)
        events = [ready_at[i] for i in range(n) if started[i] and not done[i] and ready_at[i] > now + eps]
        events += issued
        events += [now + left[i] / (rates[i] * 1e6) for i in flowing if rates[i] > 0]
        if not events:
            raise AssertionError("simulation stalled: a dependency cycle in the schedule")
        nxt = min(events)
        for i in flowing:
            left[i] = max(0.0, left[i] - rates[i] * 1e6 * (nxt - now))
        now = nxt
        for i, t in enumerate(tasks):
            if not started[i] or done[i] or ready_at[i] > now + eps:
                continue
            # done: no bytes left, or fewer than the clock can resolve at this rate (a fast link
            # late in a long call would otherwise never advance ``now``)
            if t.kind != "transfer" or left[i] <= max(1e-6, 1e-12 * t.nbytes) or (
                    i in flowing and rates[i] > 0 and left[i] / (rates[i] * 1e6) <= eps + 1e-15 * now):
                t.end, done[i] = now, True
                finished += 1


BOTTLENECKS = ("compute", "transfer", "fixed")


def bottleneck(work: Work, profile: Profile, base: Timeline, **kw) -> tuple[str, dict[str, float]]:
    """Which cost, made free, shortens the call most: ``compute``, ``transfer`` or ``fixed``;
    and the time each would save (ms)."""
    savings = {}
    for what in BOTTLENECKS:
        savings[what] = base.latency_ms - timeline(work, profile, skip=frozenset({what}), **kw).latency_ms
    return max(savings, key=lambda k: savings[k]), savings
