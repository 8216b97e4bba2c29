"""The cost model: what each rank does per round (``Work``), and a timeline on a profile.

``build_work`` turns one layer's block masks and a placement into per-rank, per-round work —
kept-block FLOPs per compute step and bytes per round — with the exact rules of
``sparsp.demand`` (the bytes of every strategy sum to ``demand.comm_bytes`` per rank).
``timeline`` then schedules that work on a ``Profile`` as the strategies issue it
(``sparsp/strategies/*.py``):

* byte rules ``full-shards`` and ``relay`` (``ring``, ``ring-sparse``, ``ring-relay``): local
  shard first; hop k (from r−1) lands in the buffer freed by step k−2 (double buffering) once
  the sender holds the shard; step k computes it. A dense strategy (``ring``) runs the same
  kernel on every block (thresholds ignored).
* ``direct`` (``sparsp``): round k fetches D[r, ·, r−k] directly from its owner; fetches run
  ``prefetch`` rounds ahead; the local shard is computed while round 1 is in flight (§5, §6.3).
* ``all-to-all`` (``ulysses``): Q, K, V of my heads in, the kernel over the whole sequence
  (one call per (query slice, key slice)), the output back; each all-to-all is G−1 sequential
  rounds; nothing overlaps.

Which schedule a strategy follows comes from its registration (``sparsp.strategies.registry``:
``byte_rule``, ``sparse``), so a newly registered strategy with a known byte rule is simulated
without changes here.

Transfers are fluid flows: every flow in flight shares each resource on its path (links,
duplex caps, host memory, switch uplinks, the sockets' interconnect) max-min fairly, and rates
are recomputed whenever a flow starts or ends. A message first pays the transport's latency
and the sender's pack (bytes / device memory bandwidth), then its bytes flow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import demand
from ..placement import Placement
from ..strategies.registry import strategy_names, strategy_spec
from .profiles import Profile, TransportFigure

# Small collectives every call makes (plan.py): the metadata all-gather (pooled summaries, from
# which every rank derives the whole mask and every demand) and the fence; the one host sync
# is part of ``Profile.call_ms``.
SYNCS_PER_CALL = 2
# Passes over a float32 score per (head, q block, k block) to select a mask: scores, softmax,
# sort, cumulative sum (device-memory bound).
_MASK_BYTES_PER_SCORE = 16
SCHEDULES = {"full-shards": "relay-ring", "relay": "relay-ring", "direct": "direct", "all-to-all": "all-to-all"}


def schedule_of(strategy: str) -> str:
    """``relay-ring``, ``direct`` or ``all-to-all``: how ``strategy`` issues its rounds."""
    rule = strategy_spec(strategy).byte_rule
    if not isinstance(rule, str) or rule not in SCHEDULES:
        raise ValueError(f"strategy {strategy!r} has byte rule {rule!r}; simulate models "
                         f"{', '.join(SCHEDULES)}")
    return SCHEDULES[rule]


@dataclass(frozen=True)
class Work:
    """What one attention call asks of each rank, independent of the hardware.

    ``flops[r][i]``: FLOPs of rank r's compute step i (ring-like and ``sparsp``: step 0 is the
    local shard, step k the shard of round k; ``ulysses``: one step). ``launches[r][i]``: kernel
    calls in that step. ``recv[r][k-1]``: bytes rank r receives in round k (phase 1 for
    ``ulysses``), ``back[r][k-1]``: bytes of ``ulysses``'s output all-to-all (empty otherwise).
    ``mask_bytes[r]``: device bytes read to pool r's mask inputs.
    """

    strategy: str
    schedule: str
    ranks: int
    flops: tuple[tuple[float, ...], ...]
    launches: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    back: tuple[tuple[int, ...], ...] = ()
    mask_bytes: tuple[int, ...] = ()

    def sender(self, r: int, k: int) -> int:
        """Who sends rank r its round-k payload: the ring neighbour, or the owner (r−k)."""
        G = self.ranks
        return (r - 1) % G if self.schedule == "relay-ring" else (r - k) % G

    def origin(self, r: int, k: int) -> int:
        """Whose K/V rank r computes at step k (r itself at step 0)."""
        return (r - k) % self.ranks

    @property
    def bytes_per_rank(self) -> list[int]:
        return [sum(self.recv[r]) + (sum(self.back[r]) if self.back else 0) for r in range(self.ranks)]


def pair_flops(masks: torch.Tensor, placement: Placement, head_dim: int, dense: bool = False) -> torch.Tensor:
    """Float64 [G, G]: kept-block FLOPs of rank r's queries against origin p's keys, all heads
    (4 · q_len · k_len · head_dim per kept (head, q block, k block): QKᵀ and PV)."""
    L = placement.geometry.block_lengths().double()
    heads = masks.sum(dim=0, dtype=torch.float64) if not dense else torch.full_like(
        L[:, None] * L[None, :], float(masks.shape[0]))
    onehot = torch.nn.functional.one_hot(placement.owner, placement.ranks).double()
    return 4.0 * head_dim * onehot.T @ (heads * L[:, None] * L[None, :]) @ onehot


def build_work(masks: torch.Tensor, placement: Placement, strategy: str, *, head_dim: int,
               dtype_bytes: int = 2) -> Work:
    """Per-rank, per-round work of ``strategy`` for masks bool [heads, nB, nB] (original order)."""
    if strategy not in strategy_names():
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(strategy_names())}")
    spec = strategy_spec(strategy)
    schedule = schedule_of(strategy)
    G, H = placement.ranks, masks.shape[0]
    masks = masks.bool()
    owner = placement.owner
    tokens = placement.tokens_per_rank
    bb = demand.block_bytes(placement, head_dim=head_dim, dtype_bytes=dtype_bytes)  # per head
    n = placement.geometry.num_blocks
    # Pooling the local q and k, then selecting the whole mask on every rank (plan.py).
    mask_bytes = tuple(2 * t * H * head_dim * dtype_bytes + H * n * n * _MASK_BYTES_PER_SCORE
                       if spec.sparse else 0 for t in tokens)
    if schedule == "all-to-all":
        return _all_to_all_work(strategy, masks, placement, head_dim, dtype_bytes, mask_bytes)
    dense = not spec.sparse
    F = pair_flops(masks, placement, head_dim, dense=dense)
    flops = tuple(tuple(float(F[r, (r - k) % G]) for k in range(G)) for r in range(G))
    launches = tuple(tuple(1 if (dense or f > 0) else 0 for f in row) for row in flops)
    if spec.byte_rule == "full-shards":
        shard = torch.zeros(G, dtype=torch.long).index_add_(0, owner, bb) * H
        recv = tuple(tuple(int(shard[(r - k) % G]) for k in range(1, G)) for r in range(G))
    elif spec.byte_rule == "direct":
        need = demand.demand_sets(masks, placement)
        per_origin = torch.stack([(need[:, :, owner == p].long() * bb[owner == p]).sum(dim=(1, 2))
                                  for p in range(G)], dim=1)  # [r, p]
        recv = tuple(tuple(int(per_origin[r, (r - k) % G]) for k in range(1, G)) for r in range(G))
    else:  # ring-relay: hop k into r carries origin p = r−k's blocks any of r, r+1, …, p−1 needs
        need = demand.demand_sets(masks, placement)
        recv_l = [[0] * (G - 1) for _ in range(G)]
        for p in range(G):
            mine = (owner == p)[None, :]
            downstream = torch.zeros_like(need[0])
            for k in range(G - 1, 0, -1):  # from the far end of the ring back to p+1
                r = (p + k) % G
                downstream |= need[r] & mine
                recv_l[r][k - 1] = int((downstream.long() * bb).sum())
        recv = tuple(tuple(row) for row in recv_l)
    return Work(strategy, schedule, G, flops, launches, recv, (), mask_bytes)


def _all_to_all_work(strategy, masks, placement: Placement, head_dim: int, dtype_bytes: int,
                     mask_bytes) -> Work:
    G, H = placement.ranks, masks.shape[0]
    tokens = placement.tokens_per_rank
    split = demand.head_split(H, G)
    first = [sum(split[:r]) for r in range(G)]
    L = placement.geometry.block_lengths().double()
    per_head = 4.0 * head_dim * (masks.double() * (L[:, None] * L[None, :])).sum(dim=(1, 2))  # [H]
    row = head_dim * dtype_bytes
    flops, launches, recv, back = [], [], [], []
    for r in range(G):
        flops.append((float(per_head[first[r]:first[r] + split[r]].sum()),))
        launches.append((G * G,))  # one kernel call per (query slice, key slice)
        recv.append(tuple(3 * tokens[(r - k) % G] * split[r] * row for k in range(1, G)))
        back.append(tuple(tokens[r] * split[(r - k) % G] * row for k in range(1, G)))
    return Work(strategy, "all-to-all", G, tuple(flops), tuple(launches), tuple(recv), tuple(back),
                tuple(mask_bytes))


# --- contention: routes and max-min fair rates ---------------------------------------------------


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
    path: tuple[tuple[str, float], ...] = ()
    sender: int | None = None
    phase: int = 1  # ulysses: 1 = inputs in, 2 = outputs back
    start: float = math.nan
    end: float = math.nan


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


def timeline(work: Work, profile: Profile, *, transport: str | None = None, head_dim: int = 128,
             prefetch: int = 1, skip: frozenset = frozenset()) -> Timeline:
    """Schedule ``work`` on ``profile``. ``skip`` ⊆ {"compute", "transfer", "fixed"} makes those
    costs zero (what-if runs that name the bottleneck)."""
    G = work.ranks
    if G > profile.gpus:
        raise ValueError(f"{G} ranks exceed the {profile.gpus} GPUs of profile {profile.name}")
    if not isinstance(prefetch, int) or prefetch < 1:
        raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
    tf: TransportFigure = profile.transport(transport)
    kf = profile.kernel(head_dim)
    caps = capacities(profile, G)
    tasks: list[Task] = []

    def add(task: Task) -> int:
        tasks.append(task)
        return len(tasks) - 1

    def compute_ms(r: int, i: int) -> float:
        if "compute" in skip:
            return 0.0
        return work.flops[r][i] / (kf.sparse_tflops * 1e9) + work.launches[r][i] * profile.launch_ms

    def transfer(r: int, k: int, nbytes: int, after: list[int], phase: int = 1) -> int:
        s = work.sender(r, k)
        if nbytes == 0 or "transfer" in skip:  # nothing to send: no message at all
            return add(Task("transfer", r, k, after, sender=s, phase=phase))
        path = tuple((res, w / tf.efficiency) for res, w in route(profile, s, r, caps))
        pre = tf.latency_ms + _ms(nbytes, profile.hbm_gbps)  # handshake + the sender's pack
        return add(Task("transfer", r, k, after, pre, float(nbytes), path, s, phase))

    fixed = []
    for r in range(G):
        cost = profile.call_ms + SYNCS_PER_CALL * profile.sync_ms
        if work.mask_bytes:
            cost += _ms(work.mask_bytes[r], profile.hbm_gbps)
        fixed.append(add(Task("fixed", r, 0, [], 0.0 if "fixed" in skip else cost)))
    if work.schedule == "all-to-all":
        _ulysses(work, fixed, add, transfer, compute_ms)
    else:
        _overlapped(work, fixed, add, transfer, compute_ms, prefetch)
    _run(tasks, caps)
    finish = [max(t.end for t in tasks if t.rank == r) for r in range(G)]
    return Timeline(work, tasks, finish)


def _overlapped(work: Work, fixed, add, transfer, compute_ms, prefetch: int) -> None:
    """ring / ring-sparse / ring-relay (double-buffered relay) and sparsp (direct, prefetched)."""
    G = work.ranks
    T = [[None] * G for _ in range(G)]  # T[r][k]: transfer of round k into r
    C = [[None] * G for _ in range(G)]  # C[r][i]: compute step i of r
    ring = work.schedule == "relay-ring"
    ahead = 1 if ring else prefetch
    for r in range(G):
        C[r][0] = add(Task("compute", r, 0, [fixed[r]], compute_ms(r, 0)))
    for k in range(1, G):
        for r in range(G):
            s = work.sender(r, k)
            after = [fixed[r], fixed[s]]
            j = k - ahead  # the round whose landing lets this one be issued
            if j >= 1:
                # Issued after the wait on round j, on both ends; the sender's pack/publish is
                # queued on its compute stream behind step j−1; the receive buffer is the one
                # step j−1 read (ring-like: the local shard's buffer too; sparsp keeps its own).
                after += [T[r][j], T[s][j], C[s][j - 1]]
                if ring or j - 1 >= 1:
                    after.append(C[r][j - 1])
            T[r][k] = transfer(r, k, work.recv[r][k - 1], after)
        for r in range(G):
            C[r][k] = add(Task("compute", r, k, [C[r][k - 1], T[r][k]], compute_ms(r, k)))


def _ulysses(work: Work, fixed, add, transfer, compute_ms) -> None:
    """All-to-all in (G−1 sequential rounds), one compute step, all-to-all out; no overlap."""
    G = work.ranks
    prev = {r: [fixed[r]] for r in range(G)}
    for k in range(1, G):
        cur = {r: transfer(r, k, work.recv[r][k - 1], prev[r] + prev[work.sender(r, k)]) for r in range(G)}
        prev = {r: [cur[r]] for r in range(G)}
    C = {r: add(Task("compute", r, 0, prev[r], compute_ms(r, 0))) for r in range(G)}
    prev = {r: [C[r]] for r in range(G)}
    for k in range(1, G):
        cur = {r: transfer(r, k, work.back[r][k - 1], prev[r] + prev[work.sender(r, k)], phase=2)
               for r in range(G)}
        prev = {r: [cur[r]] for r in range(G)}


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
        progress = True
        while progress:  # start what is ready; finish zero-length tasks at once
            progress = False
            for i, t in enumerate(tasks):
                if started[i] or not all(done[a] for a in t.after):
                    continue
                started[i], t.start = True, now
                ready_at[i] = now + t.duration
                if t.duration <= 0 and (t.kind != "transfer" or left[i] <= 0):
                    t.end, done[i] = now, True
                    finished += 1
                    progress = True
        if finished == n:
            break
        flowing = {i: tasks[i].path for i in range(n)
                   if started[i] and not done[i] and tasks[i].kind == "transfer" and ready_at[i] <= now + eps
                   and left[i] > 0}
        rates = fair_rates(flowing, caps)
        events = [ready_at[i] for i in range(n) if started[i] and not done[i] and ready_at[i] > now + eps]
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
            if t.kind != "transfer" or left[i] <= max(1e-6, 1e-12 * t.nbytes):
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
