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

Transfers are fluid flows (``cost.flows``): every flow in flight shares each resource on its
path (links, duplex caps, host memory, switch uplinks, the sockets' interconnect, NICs between
hosts) max-min fairly, and rates are recomputed whenever a flow or a kernel step starts or
ends: while a kernel step runs at either end, a transport reaches its share under load
(``TransportFigure.loaded_efficiency``). A message first pays its transport's latency (the
call's transport inside a host, ``Profile.network_figure`` between hosts) and the sender's pack
(bytes / device memory bandwidth), then its bytes flow. Several calls may run at once on one
machine (``timelines``: a mesh's sequence-parallel groups), their transfers sharing it.

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
(LTX sizes, the all-to-all's per-slice copies and merges) waits for its host. A call that
reuses a kept plan (``Work.mask_phase`` false) has no mask phase: no collective, no mask, no
host read and no finish; its run is the plan call's (``mask_phase_ms``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .flows import capacities, gather_gbps, route, run
from .machine import Profile, TransportFigure
from .model import SYNCS_PER_CALL, Work


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
    call: int = 0  # which of the calls run at once (``timelines``) it belongs to
    scaled: dict = field(default_factory=dict, repr=False)  # its path at each share (``_scaled``)


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
             prefetch: int = 1, skip: frozenset = frozenset(), gpus: Sequence[int] | None = None) -> Timeline:
    """Schedule ``work`` on ``profile``. ``transport``: the call's, its figure in ``profile`` or a
    name (``Profile.transport``: None = the default; a name the profile lacks raises). ``skip`` ⊆
    {"compute", "transfer", "fixed"} makes those costs zero (what-if runs that name the
    bottleneck). ``gpus``: the GPU of each rank (default: rank r on GPU r)."""
    return timelines([(work, gpus)], profile, transport=transport, head_dim=head_dim, prefetch=prefetch,
                     skip=skip)[0]


def timelines(calls: Sequence[tuple[Work, Sequence[int] | None]], profile: Profile, *,
              transport: TransportFigure | str | None = None, head_dim: int = 128, prefetch: int = 1,
              skip: frozenset = frozenset()) -> list[Timeline]:
    """Several calls at once on one machine, each ``(work, gpus)`` (``gpus``: the GPU of each of
    its ranks, None: 0 … G−1; no GPU in two calls): each scheduled as ``timeline`` does, their
    transfers sharing the machine's resources. One ``Timeline`` per call."""
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    placed = [(w, tuple(range(w.ranks)) if g is None else tuple(g)) for w, g in calls]
    every = [g for _, gpus in placed for g in gpus]
    for w, gpus in placed:
        if len(gpus) != w.ranks:
            raise ValueError(f"{len(gpus)} GPUs given for a call of {w.ranks} ranks")
    if len(set(every)) != len(every) or max(every) >= profile.gpus or min(every) < 0:
        raise ValueError(f"{len(every)} ranks on GPUs {sorted(every)} exceed the {profile.gpus} GPUs of profile "
                         f"{profile.name} or share one")
    tf = profile.transport(transport)
    caps = capacities(profile, every)
    tasks: list[Task] = []
    spans = [_build(w, i, gpus, profile, tf, caps, tasks, head_dim=head_dim, prefetch=prefetch, skip=skip)
             for i, (w, gpus) in enumerate(placed)]
    run(tasks, caps, _scaled)
    out = []
    for (w, _), (a, b) in zip(placed, spans):
        mine = tasks[a:b]
        out.append(Timeline(w, mine, [max(t.end for t in mine if t.rank == r) for r in range(w.ranks)]))
    return out


def mask_phase_ms(work: Work, profile: Profile, gpus: Sequence[int] | None = None) -> tuple[float, ...]:
    """Per rank, what the call's mask phase adds before its run (ms): the longer of the host
    issuing its counted ops (``Work.host_ops``) and the device's path — the metadata
    all-gather (``sync_ms`` and its bytes, not in a group of one), the input passes and the
    mask's selection — then the read's finish (``Work.finish_ops``). A call without a mask
    phase (``Work.mask_phase`` false: a reuse call) adds none. In order, the call's time is
    the time of the same call without its mask phase plus this (the slowest rank's, where the
    ranks' differ); local first, up to one launch and ``EARLY_OPS`` less, which the plan call
    hides behind a device-bound mask phase."""
    gpus = tuple(range(work.ranks)) if gpus is None else tuple(gpus)
    rate = gather_gbps(profile, gpus)
    return tuple(max(_mask_path(work, profile, r, rate)) + _ops(work.finish_ops, r) * profile.op_ms
                 for r in range(work.ranks))


def _ops(values: tuple, r: int, default=0):
    """Rank r's entry of a ``Work`` count (``default`` when the work models none)."""
    return values[r] if values else default


def _mask_path(work: Work, profile: Profile, r: int, gather_rate: float) -> tuple[float, float]:
    """Rank r's mask phase up to its host read (ms): (the device's path, the host's ops)."""
    if not work.mask_phase:
        return 0.0, 0.0
    device = SYNCS_PER_CALL * profile.sync_ms if work.ranks > 1 else 0.0  # a group of one waits for no peer
    device += _ms(work.mask_bytes[r], profile.hbm_gbps) if work.mask_bytes else 0.0
    device += _ms(work.gather_bytes[r], gather_rate) if work.gather_bytes else 0.0
    return device, _ops(work.host_ops, r) * profile.op_ms


def _build(work: Work, call: int, gpus: tuple[int, ...], profile: Profile, tf: TransportFigure,
           caps: dict[str, float], tasks: list[Task], *, head_dim: int, prefetch: int,
           skip: frozenset) -> tuple[int, int]:
    """Append the tasks of one call (its ranks on ``gpus``) to ``tasks``; their index range."""
    first = len(tasks)

    def add(task: Task) -> int:
        task.call = call
        task.after = [first + a for a in task.after]
        tasks.append(task)
        return len(tasks) - 1 - first

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
        fig = tf if profile.host_of(gpus[s]) == profile.host_of(gpus[r]) else profile.network_figure
        pre = fig.latency_ms + _ms(nbytes, profile.hbm_gbps)  # handshake + the sender's pack
        return add(Task("transfer", r, k, after, pre, float(nbytes), route(profile, gpus[s], gpus[r], caps), s,
                        phase, efficiency=fig.efficiency, loaded=fig.under_load, not_before=not_before))

    rate = gather_gbps(profile, gpus)
    # the mask phase ends in the start of the host read: the host issues its ops while the
    # device reads the inputs, waits for the metadata all-gather and selects the mask; the
    # read lands when both are done (``call_after_ms`` comes after its start: _HostIssue)
    fixed = [add(Task("fixed", r, 0, [], 0.0 if "fixed" in skip else
                      profile.call_ms - profile.call_after + max(_mask_path(work, profile, r, rate))))
             for r in range(work.ranks)]
    issue = _HostIssue(work, profile, [tasks[first + f].duration for f in fixed], free="fixed" in skip)

    def compute(r: int, i: int, after: list[int]) -> int:
        start, last = issue.launched(r, i)
        dur = compute_ms(r, i)
        return add(Task("compute", r, i, after, dur, not_before=start,
                        end_not_before=last + dur / max(1, work.launches[r][i])))

    if work.schedule == "all-to-all":
        _all_to_all(work, fixed, add, transfer, compute, issue)
    else:
        _overlapped(work, fixed, add, transfer, compute, prefetch, issue)
    for r in range(work.ranks):  # the host's last op (the output) ends the call at the earliest
        add(Task("fixed", r, 1, [fixed[r]], not_before=issue.done(r)))
    return first, len(tasks)


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

    def local_launch(self, r: int) -> float:
        """(ms) local first: when the host has launched the local kernel."""
        w, p = self.work, self.profile
        before, _ = _ops(w.early_ops, r, (0, 0))
        mask = _ops(w.host_ops, r, 0)
        return p.call_ms - p.call_after + (mask + before) * p.op_ms + p.launch_ms

    def run_start(self, r: int) -> float:
        """(ms) when the host has finished the read and begins the run's ops."""
        w, p = self.work, self.profile
        read = self.mask[r]
        if w.local_first:
            _, after = _ops(w.early_ops, r, (0, 0))
            read = max(read, self.local_launch(r) + after * p.op_ms)
        # the fence and the read's finish (``Profile.call_after_ms``), then the finish's ops
        return read + (0.0 if self.free else p.call_after) + _ops(w.finish_ops, r, 0) * p.op_ms

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
        first, last, _ = _ops(self.work.run_ops, r, (0, 0, 0))
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
        return self.run_start(r) + _ops(self.work.issue_ops, r, 0) * self.profile.op_ms

    def done(self, r: int) -> float:
        """(ms) when the host has issued the call's every op."""
        if self.free:
            return 0.0
        _, last, tail = _ops(self.work.run_ops, r, (0, 0, 0))
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


def _scaled(task: Task, busy: set[tuple[int, int]]) -> tuple[tuple[str, float], ...]:
    """A transfer's path at its transport's share now: 1/efficiency of capacity per byte
    (``busy``: the (call, rank) pairs computing now)."""
    loaded = (task.call, task.rank) in busy or (task.call, task.sender) in busy
    got = task.scaled.get(loaded)
    if got is None:
        eff = task.loaded if loaded else task.efficiency
        got = task.scaled[loaded] = tuple((res, w / eff) for res, w in task.path)
    return got


BOTTLENECKS = ("compute", "transfer", "fixed")


def bottleneck(work: Work, profile: Profile, base: Timeline, **kw) -> tuple[str, dict[str, float]]:
    """Which cost, made free, shortens the call most: ``compute``, ``transfer`` or ``fixed``;
    and the time each would save (ms)."""
    savings = {}
    for what in BOTTLENECKS:
        savings[what] = base.latency_ms - timeline(work, profile, skip=frozenset({what}), **kw).latency_ms
    return max(savings, key=lambda k: savings[k]), savings
