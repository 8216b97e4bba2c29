"""Count the eager PyTorch ops one ``sp_attention`` call issues, in program order (CPU, gloo).

The cost model charges the host's issue time of a call's ops (``Profile.op_ms`` each) where the
device waits for them, and no kernel starts before the host launched it. Where each op falls
depends on the call's order (``SparspConfig.local_first``, ``StrategySpec.local_first``; the
automatic setting, None, takes one of the two per call — on the CPU always local first — so
the counts are made with False and True):

* in order (``local_first`` off, and a strategy not registered ``local_first``): the mask phase up to the start of the host
  read (``ops.MASK_OPS``), the read, its finish (header checks, layouts:
  ``ops.FINISH_OPS``), then the run's ops up to its first fetch and up to each kernel call
  (``ops.RUN_OPS``);
* local first: the mask phase up to the read's start (the same ``MASK_OPS``), the local
  kernel's own ops and launch, the ops issued after that launch before the host waits for the
  read (``ops.EARLY_OPS``), the finish (``FINISH_OPS``), then the run's ops up to its first
  fetch (the first round's pack and transfer, on the side stream) and up to each remote kernel
  call (``ops.LOCAL_FIRST_RUN_OPS``).

This module counts them on the code as it is, so the constants can be recounted whenever it
changes:

    sparsp simulate --count-ops                  # G = 2, 3, 4, 6; prints every constant above,
                                                 # GRAPHED_MASK_OPS and the drain units' ops

Every ``__torch_dispatch__`` call is one op (views included: each costs the host a dispatch;
the call's profiler ranges, ``groups.marker``, issue none unless a profiler records, and none
records here). Points in the call are marked with the number of ops issued so far
(the kernel's own excepted: on the CPU the ``torch`` reference, counted apart as ``kernel``; a
GPU runs one FA4 launch, ``Profile.launch_ms``): the host read's start
(``Metadata.start_read``), the finish's entry (the read's wait: ``Metadata.finish``), the run's
start (``Call.set_resolved``), every kernel call, every fetch. The mask phase is CPU-faithful
(but for the read's copy into pinned memory, two ops more on CUDA); after the read so is all but
the kernel and the merge (23 eager ops here; on CUDA one compiled kernel, whose launch a profile
put at ≈ 0.2 ms of host time, docs/performance.md: about the same). The ops of the plan stage,
which ``strategies/captured.py`` replays as one CUDA graph on the GPU (the whole mask and
``captured.stage``), are counted apart as ``stage``. Per phase of the benchmark's
``PhaseTimer`` the ops are tallied too (printed: ``mask`` ends before the early local kernel in
a local-first call, after the finish otherwise). Each call is counted after a warm-up call of
the same geometry (per-geometry caches filled, as in a denoising loop).
"""

from __future__ import annotations

import datetime
import queue
import socket
import time
from collections.abc import Iterator
from fractions import Fraction

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from ..cost.model import kind_of
from ..cost.ops import MASK_OPS, RUN_OPS


def _first_of_each(kind, table: dict) -> dict[str, str]:
    """``kind(spec)`` → the first registered strategy of that kind, in ``table``'s order (a kind
    ``table`` has no row for is not counted)."""
    from ..strategies.registry import strategy_names, strategy_spec

    out: dict[str, str] = {}
    for name in strategy_names():
        out.setdefault(kind(strategy_spec(name)), name)
    return {k: out[k] for k in table if k in out}


def mask_kinds() -> dict[str, str]:
    """A strategy of each kind ``ops.MASK_OPS`` and ``FINISH_OPS`` distinguish: ``dense``, the
    byte rules with a row of their own, and ``sparse`` for every other sparse byte rule."""
    return _first_of_each(lambda s: "dense" if not s.sparse
                          else s.byte_rule if s.byte_rule in MASK_OPS else "sparse", MASK_OPS)


def run_kinds() -> dict[str, str]:
    """A strategy of each kind ``ops.RUN_OPS`` distinguishes (``dense``, or a sparse strategy's
    byte rule); those registered ``local_first`` are counted in that order too
    (``LOCAL_FIRST_RUN_OPS``)."""
    return _first_of_each(kind_of, RUN_OPS)
HEADS, HEAD_DIM, BLOCK, BLOCKS_PER_RANK = 12, 16, 16, 4
"""The counting geometry: 12 heads (divisible by G = 2, 3, 4, 6), whole blocks on every rank."""


class _Counter(TorchDispatchMode):
    """Every op, labelled with the phase the call is in; ``n`` counts all but the kernel's."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "other"
        self.counts: dict[str, int] = {}
        self.n = 0
        self.points: dict[str, int] = {}  # first time each point was reached: ``n`` then
        self.kernels: list[int] = []  # ``n`` when each kernel call was issued
        self.fetches: list[int] = []  # ``n`` once each fetch was issued
        self.names: list[str] = []  # every op counted, as "label:op" (tests, diagnosis)
        self.active = False  # inside ``with counter``

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.label] = self.counts.get(self.label, 0) + 1
        if self.label not in ("kernel", "triton"):
            self.n += 1
            self.names.append(f"{self.label}:{func}")
        return func(*args, **(kwargs or {}))

    def mark(self, point: str) -> None:
        self.points.setdefault(point, self.n)


class _Phases:
    """Duck-typed ``PhaseTimer``: labels the counter with the phase the call is in and marks
    each fetch."""

    def __init__(self, counter: _Counter) -> None:
        self.counter = counter

    class _Phase:
        def __init__(self, counter: _Counter, name: str) -> None:
            self.counter, self.name = counter, name

        def __enter__(self):
            self.saved, self.counter.label = self.counter.label, self.name

        def __exit__(self, *exc):
            self.counter.label = self.saved
            return False

    def phase(self, name: str):
        return _Phases._Phase(self.counter, name)

    def fetch_issued(self, key: int) -> None:
        self.counter.fetches.append(self.counter.n)

    def fetch_landed(self, key: int) -> None:
        return None


def _labelled(counter: _Counter, label: str, fn):
    """``fn`` with its ops counted under ``label``."""
    def wrapped(*args, **kwargs):
        saved, counter.label = counter.label, label
        try:
            return fn(*args, **kwargs)
        finally:
            counter.label = saved
    return wrapped


def _staged(counter: _Counter, fn):
    """``fn`` with its ops counted as ``stage`` (what a CUDA graph replays on the GPU)."""
    return _labelled(counter, "stage", fn)


def _marked(counter: _Counter, point: str, fn, after: bool = False):
    """``fn`` marking ``point`` when it is entered (``after``: when it returns)."""
    def wrapped(*args, **kwargs):
        if not after:
            counter.mark(point)
        out = fn(*args, **kwargs)
        if after:
            counter.mark(point)
        return out
    return wrapped


def _kernel(counter: _Counter, get_kernel):
    """``strategies.call.get_kernel`` whose kernels mark when they were issued and count their
    own ops as ``kernel`` (the CPU's ``torch`` reference; a GPU runs one FA4 launch instead)."""
    def make(*args, **kwargs):
        counted = _labelled(counter, "kernel", get_kernel(*args, **kwargs))

        def kernel(*a, **kw):
            counter.kernels.append(counter.n)
            return counted(*a, **kw)
        return kernel
    return make


def _triton_launch(counter: _Counter, fn):
    """A Triton kernel of the CUDA path (``fn``: its torch form, run uncounted) as the one op
    its launch is."""
    def wrapped(*args, **kwargs):
        saved, counter.label = counter.label, "triton"
        try:
            out = fn(*args, **kwargs)
        finally:
            counter.label = saved
        if counter.active:
            counter.counts[saved] = counter.counts.get(saved, 0) + 1
            counter.n += 1
        return out
    return wrapped


def _summaries_like_cuda(out, block_size, a, b=None, c=None) -> None:
    """``masks.summaries_into``'s values made with torch ops: the block sums, and v's sum in
    each of the check's slots (finite exactly when v is)."""
    from ..masks import block_sums

    plane = a.numel() // a.shape[1] * -(-a.shape[1] // block_size)
    out[:plane] = block_sums(a, block_size).reshape(-1)
    if b is not None:
        out[plane: 2 * plane] = block_sums(b, block_size).reshape(-1)
    if c is not None:
        out[2 * plane:] = c.sum(dtype=torch.float32)


def count_call(q, k, v, *, strategy: str, config, group=None) -> dict:
    """Ops of one ``sp_attention`` call on this rank (after one warm-up call), per phase label
    (``mask``, ``stage``, ``pack``, ``compute``, ``merge``, ``other``, ``kernel``) and at the
    points of its program order: ``"read"``: ops before the host read was started (its copy
    queued); ``"wait"``: before the host waited for it; ``"resolved"``: before the strategy's
    run (after the finish); ``"kernels"`` and ``"fetches"``: before each kernel call and once
    each fetch was issued; ``"total"``: every op but the kernel's."""
    from .. import plan, sp_attention, summaries

    counter = _Counter()
    sums = (plan.fused_sums, summaries.summaries_into)  # the metadata's summaries as on CUDA: one launch
    plan.fused_sums, summaries.summaries_into = (lambda *xs: True), _triton_launch(counter, _summaries_like_cuda)
    try:
        sp_attention(q, k, v, group=group, strategy=strategy, config=config)
        return _count_warm(counter, q, k, v, strategy, config, group)
    finally:
        plan.fused_sums, summaries.summaries_into = sums


def _count_warm(counter: _Counter, q, k, v, strategy: str, config, group) -> dict:
    from .. import plan, sp_attention
    from ..strategies import call as base, captured

    saved = (plan.Metadata.block_mask, captured.stage, base.get_kernel, plan.Metadata.start_read,
             plan.Metadata.finish, base.Call.set_resolved)
    plan.Metadata.block_mask = _staged(counter, saved[0])
    captured.stage = _staged(counter, saved[1])
    base.get_kernel = _kernel(counter, saved[2])
    plan.Metadata.start_read = _marked(counter, "read", saved[3], after=True)
    plan.Metadata.finish = _marked(counter, "wait", saved[4])
    base.Call.set_resolved = _marked(counter, "resolved", saved[5])
    try:
        with counter:
            sp_attention(q, k, v, group=group, strategy=strategy, config=config, _timer=_Phases(counter))
    finally:
        (plan.Metadata.block_mask, captured.stage, base.get_kernel, plan.Metadata.start_read,
         plan.Metadata.finish, base.Call.set_resolved) = saved
    return {**counter.counts, **counter.points, "kernels": list(counter.kernels),
            "fetches": list(counter.fetches), "total": counter.n, "names": list(counter.names)}


def eager_ops(kind: str, counts: dict) -> int:
    """Ops before the host read is started (``ops.MASK_OPS``) of a call whose stage runs
    eagerly (``cuda_graphs=False``, the CPU)."""
    return counts["read"]


def graphed_ops(kind: str, counts: dict) -> int:
    """The same on CUDA with the stage replayed as a graph (``captured.py``): its ops become one
    graph launch, which reads the gathered rows where the metadata all-gather left them
    (``summaries.gathered_rows``); dense strategies have no graph."""
    return counts["read"] if kind == "dense" else counts["read"] - counts.get("stage", 0) + 1


def early_ops(counts: dict) -> tuple[int, int] | None:
    """A local-first call's ops after the read's start before the local kernel's launch, and
    after that launch before the host waits for the read (``ops.EARLY_OPS``); None when no
    kernel was issued before the wait (the call ran in order)."""
    early = [n for n in counts["kernels"] if n <= counts["wait"]]
    if not early:
        return None
    assert len(early) == 1, f"{len(early)} kernel calls before the host read's wait"
    return early[0] - counts["read"], counts["wait"] - early[0]


def finish_ops(counts: dict) -> int:
    """Ops from the host read's wait to the strategy's run (``ops.FINISH_OPS``: the read's
    header checks and layouts)."""
    return counts["resolved"] - counts["wait"]


def run_ops(counts: dict) -> tuple[int, int, int]:
    """Ops after the run's start before its first kernel call, before its last, after its last
    (``ops.RUN_OPS``; of a local-first call, its remote kernel calls). A run without kernel
    calls (a local-first call on a group of one): (0, 0, all)."""
    start = counts["resolved"]
    marks = [n - start for n in counts["kernels"] if n >= start]
    run = counts["total"] - start
    if not marks:
        return 0, 0, run
    return marks[0], marks[-1], run - marks[-1]


def issue_ops(counts: dict) -> int:
    """Ops after the run's start up to its first fetch issued (the first round's pack and
    publish come before it; a local-first call issues them on the side stream); 0 without a
    fetch."""
    start = counts["resolved"]
    fetches = [n - start for n in counts["fetches"] if n >= start]
    return fetches[0] if fetches else 0


def _rank(rank: int, world: int, port: int, jobs: list, out) -> None:
    import torch.distributed as dist

    from .. import SparspConfig
    from ..strategies import close_transports

    torch.set_num_threads(1)  # a counting rank needs no intra-op threads: G of them share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        S = BLOCKS_PER_RANK * BLOCK
        # a direction shared by every rank plus noise and a drift along the sequence: a mask
        # that keeps some remote blocks and drops others (tests/dist_utils.structured_inputs)
        c = torch.randn(1, 1, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(1 + rank)
        drift = torch.linspace(-2, 2, world * S)[rank * S:(rank + 1) * S].view(1, S, 1, 1)
        q = c * 2 + torch.randn(1, S, HEADS, HEAD_DIM, generator=g)
        k = c * 2 + torch.randn(1, S, HEADS, HEAD_DIM, generator=g) + drift
        v = torch.randn(1, S, HEADS, HEAD_DIM, generator=g)
        results = []
        for strategy, drain, local_first in jobs:
            cfg = SparspConfig(cdf_threshold=0.9, block_size=BLOCK, transport="nccl", chunks=1,
                               drain_chunks=drain, local_first=local_first)
            results.append(count_call(q, k, v, strategy=strategy, config=cfg))
        out.put((rank, results))
    finally:
        close_transports()
        dist.destroy_process_group()


def count(world: int, jobs: list[tuple[str, int, bool]], timeout_s: float = 300.0) -> list[dict]:
    """Rank 0's counts (``count_call``) of each (strategy, drain_chunks, local_first) job on a
    gloo group of ``world``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, name=f"rank{r}", args=(r, world, port, jobs, out))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"opcount: no count from every rank within {timeout_s:g} s")
            try:
                rank, value = out.get(timeout=1.0)
                got[rank] = value
            except queue.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"opcount: {', '.join(dead)} exited without a count") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return got[0]


def fit(points: dict[int, int]) -> tuple[int, int, int]:
    """(a, b, c) with ops = a + b·(G−1) + c·(G−1)², exact on the first three G; the rest check it."""
    (g1, y1), (g2, y2), (g3, y3) = sorted(points.items())[:3]
    x1, x2, x3 = g1 - 1, g2 - 1, g3 - 1
    # the quadratic through three points, in exact fractions
    F = Fraction
    c = F(y1, (x1 - x2) * (x1 - x3)) + F(y2, (x2 - x1) * (x2 - x3)) + F(y3, (x3 - x1) * (x3 - x2))
    b = F(y2 - y1, x2 - x1) - c * (x1 + x2)
    a = y1 - b * x1 - c * x1 * x1
    return int(a), int(b), int(c)


RANKS = (2, 3, 4, 6)
"""The G ``report`` counts at by default: enough to fit (constant, per peer, per peer²) and
check it; every one divides ``HEADS``."""
UNITS = (2, 4, HEADS)
"""Drain units counted for ``ops.MASK_CUT_OPS`` / ``MASK_UNIT_OPS`` (``drain_chunks``)."""


def _fitted(name: str, points: dict[int, int]) -> str:
    """``name`` = (constant, per peer, per peer²), or the points when fewer than three G."""
    if len(points) < 3:
        return f"{name}: {points} (three G or more to fit)"
    a, b, c = fit(points)
    exact = all(a + b * (G - 1) + c * (G - 1) ** 2 == y for G, y in points.items())
    return f"{name} = ({a}, {b}, {c})" + ("" if exact else f"  (NOT exact for every G: {points})")


def jobs() -> list[tuple[str, int, bool]]:
    """What ``report`` counts: a strategy of each kind in order, the local-first ones local
    first too, the ``direct`` strategy's drain cut into each of ``UNITS`` (both orders), the
    ``all-to-all`` one. A dense call first: its padding to a capacity a sparse call grew is one
    cached tensor, so its count does not depend on the calls before it."""
    runs = run_kinds()
    out = [(s, 1, lf) for s in mask_kinds().values() for lf in (False, True)]
    out += [(runs["direct"], u, lf) for lf in (False, True) for u in UNITS]
    return out + [(s, 1, False) for s in runs.values() if (s, 1, False) not in out]


def report(ranks=RANKS) -> Iterator[str]:
    """``sparsp simulate --count-ops``: every job of ``jobs()`` counted on gloo groups of each
    G in ``ranks``, as lines: the ops per phase and at each point of every call, then each
    constant of ``cost.ops`` fitted to them (``_fitted``), to compare with the module's."""
    from ..strategies.registry import strategy_spec

    todo = jobs()
    kinds, runs = mask_kinds(), run_kinds()
    chunked = runs["direct"]
    table = {G: dict(zip(todo, count(G, todo))) for G in ranks}
    phases = ("mask", "stage", "pack", "compute", "merge", "other")
    yield (f"ops per phase ({' / '.join(phases)}), rank 0; stage = the mask phase's ops a CUDA "
           "graph replays on the GPU; then the points of the program order")
    for G, rows in table.items():
        for (s, u, lf), r in rows.items():
            order = "local first" if lf else "in order"
            yield (f"G={G} {s:12s} {order:11s} drain units {u:2d}: "
                   + " / ".join(str(r.get(k, 0)) for k in phases)
                   + f"; before the read {r['read']}, early {early_ops(r)}, finish {finish_ops(r)}, "
                     f"run {run_ops(r)}, first fetch {issue_ops(r)}")
    for lf in (False, True):  # the same before the read in both orders
        for name, ops in (("MASK_OPS", eager_ops), ("GRAPHED_MASK_OPS", graphed_ops)):
            for kind, s in kinds.items():
                pts = {G: ops(kind, rows[(s, 1, lf)]) for G, rows in table.items()}
                yield _fitted(f"{name}[{kind!r}] ({'local first' if lf else 'in order'})", pts)
        for kind, s in kinds.items():
            pts = {G: finish_ops(rows[(s, 1, lf)]) for G, rows in table.items()}
            yield _fitted(f"FINISH_OPS[{kind!r}] ({'local first' if lf else 'in order'})", pts)
    for G, rows in table.items():
        for lf in (False, True):
            base = rows[(chunked, 1, lf)]
            more = {u: (eager_ops("direct", rows[(chunked, u, lf)]) - eager_ops("direct", base),
                        graphed_ops("direct", rows[(chunked, u, lf)]) - graphed_ops("direct", base),
                        finish_ops(rows[(chunked, u, lf)]) - finish_ops(base)) for u in UNITS}
            yield (f"G={G} ({'local first' if lf else 'in order'}): {chunked} ops more with both drain "
                   f"payloads in u units (before the read eager, graphed; finish): {more}")
    for kind, s in kinds.items():
        early = {G: early_ops(rows[(s, 1, True)]) for G, rows in table.items()}
        if None in early.values():  # runs in order whatever the config (the all-to-all): no early ops
            continue
        for j, what in enumerate(("before the local launch", "after it, before the wait")):
            yield _fitted(f"EARLY_OPS[{kind!r}] {what}", {G: e[j] for G, e in early.items()})
    for name, lf in (("RUN_OPS", False), ("LOCAL_FIRST_RUN_OPS", True)):
        for kind, s in runs.items():
            if lf and not strategy_spec(s).local_first:
                continue
            got = {G: (issue_ops(rows[(s, 1, lf)]),) + run_ops(rows[(s, 1, lf)]) for G, rows in table.items()}
            parts = [_fitted(what, {G: v[j] for G, v in got.items()})
                     for j, what in enumerate(("first fetch", "first", "last", "tail"))]
            yield f"{name}[{kind!r}]: " + "; ".join(parts)
