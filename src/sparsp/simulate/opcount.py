"""Count the eager PyTorch ops one ``sp_attention`` call issues, phase by phase (CPU, gloo).

The cost model charges the host's issue time of the ops before the call's one host sync
(``model.MASK_OPS`` × ``Profile.op_ms``): the device waits for them; and of those after it up
to each kernel call (``model.RUN_OPS``): no kernel starts before the host issued it. This
module counts them on the code as it is, so the constants can be recounted whenever it changes:

    python -m sparsp.simulate.opcount            # G = 2, 3, 4, 6; prints MASK_OPS, GRAPHED_MASK_OPS,
                                                 # the drain units' ops (MASK_UNIT_OPS) and RUN_OPS

Every ``__torch_dispatch__`` call is one op (views included: each costs the host a dispatch).
Phases are the benchmark's (``strategies.base.PhaseTimer``): ``mask`` = the metadata
all-gather, the whole mask, the strategy's plan and ``Metadata.stage`` / ``finish`` up to its host read;
``pack``, ``compute``, ``merge``; ``other`` = the rest (transport calls, the output cast). ``mask``
is CPU-faithful; after the sync, so is all but the kernel (on the CPU the ``torch`` reference,
counted apart as ``kernel``: a GPU runs one FA4 launch, ``Profile.launch_ms``) and the merge (23
eager ops here; on CUDA one compiled kernel, whose launch a profile put at ≈ 0.2 ms of host time,
docs/performance.md: about the same). Each call is counted after a warm-up call of the same
geometry (per-geometry caches filled, as in a denoising loop).
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import socket
import time
from fractions import Fraction

import torch
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = {"dense": "ring", "sparse": "ring-sparse", "direct": "sparsp", "relay": "ring-relay"}
"""A strategy of each kind ``model.MASK_OPS`` distinguishes (``ulysses`` counts as ``sparse``)."""
RUN_KINDS = {"dense": "ring", "full-shards": "ring-sparse", "direct": "sparsp", "relay": "ring-relay",
             "all-to-all": "ulysses"}
"""A strategy of each kind ``model.RUN_OPS`` distinguishes (a sparse strategy's byte rule)."""
HEADS, HEAD_DIM, BLOCK, BLOCKS_PER_RANK = 12, 16, 16, 4
"""The counting geometry: 12 heads (divisible by G = 2, 3, 4, 6), whole blocks on every rank."""


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.label = "other"
        self.counts: dict[str, int] = {}
        self.run = 0  # ops after the mask phase (its host sync), the kernel's own excepted
        self.after_sync = False
        self.marks: list[int] = []  # ``run`` when each kernel call was issued

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.label] = self.counts.get(self.label, 0) + 1
        if self.after_sync and self.label != "kernel":
            self.run += 1
        return func(*args, **(kwargs or {}))


class _Phases:
    """Duck-typed ``PhaseTimer``: labels the counter with the phase the call is in."""

    def __init__(self, counter: _Counter) -> None:
        self.counter = counter

    class _Phase:
        def __init__(self, counter: _Counter, name: str) -> None:
            self.counter, self.name = counter, name

        def __enter__(self):
            self.saved, self.counter.label = self.counter.label, self.name

        def __exit__(self, *exc):
            self.counter.label = self.saved
            if self.name == "mask":  # the call's host sync: the run phase begins
                self.counter.after_sync = True
            return False

    def phase(self, name: str):
        return _Phases._Phase(self.counter, name)

    def fetch_issued(self, key: int) -> None:
        return None

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


def _kernel(counter: _Counter, get_kernel):
    """``strategies.base.get_kernel`` whose kernels mark when they were issued and count their
    own ops as ``kernel`` (the CPU's ``torch`` reference; a GPU runs one FA4 launch instead)."""
    def make(*args, **kwargs):
        counted = _labelled(counter, "kernel", get_kernel(*args, **kwargs))

        def kernel(*a, **kw):
            counter.marks.append(counter.run)
            return counted(*a, **kw)
        return kernel
    return make


def count_call(q, k, v, *, strategy: str, config, group=None) -> dict:
    """Ops per phase of one ``sp_attention`` call on this rank (after one warm-up call). The
    mask phase's ops that ``strategies/captured.py`` replays as one CUDA graph on the GPU (the
    whole mask and ``captured.stage``) are counted apart, as ``stage``; the kernel's own, as
    ``kernel``. ``"run"``: the ops after the host sync but the kernel's; ``"marks"``: how many
    of them came before each kernel call."""
    from .. import plan, sp_attention
    from ..strategies import base, captured

    sp_attention(q, k, v, group=group, strategy=strategy, config=config)
    counter = _Counter()
    saved = plan.Metadata.block_mask, captured.stage, base.get_kernel
    plan.Metadata.block_mask = _staged(counter, saved[0])
    captured.stage = _staged(counter, saved[1])
    base.get_kernel = _kernel(counter, saved[2])
    try:
        with counter:
            sp_attention(q, k, v, group=group, strategy=strategy, config=config, _timer=_Phases(counter))
    finally:
        plan.Metadata.block_mask, captured.stage, base.get_kernel = saved
    return {**counter.counts, "run": counter.run, "marks": list(counter.marks)}


def run_ops(counts: dict) -> tuple[int, int, int]:
    """(ops after the host sync before the first kernel call, before the last, after the last)."""
    marks = counts["marks"]
    return marks[0], marks[-1], counts["run"] - marks[-1]


def _rank(rank: int, world: int, port: int, jobs: list, out) -> None:
    import torch.distributed as dist

    from .. import SparspConfig
    from ..strategies import close_transports

    torch.set_num_threads(1)
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
        for strategy, drain in jobs:
            cfg = SparspConfig(cdf_threshold=0.9, block_size=BLOCK, transport="nccl", chunks=1,
                               drain_chunks=drain)
            results.append(count_call(q, k, v, strategy=strategy, config=cfg))
        out.put((rank, results))
    finally:
        close_transports()
        dist.destroy_process_group()


def count(world: int, jobs: list[tuple[str, int]], timeout_s: float = 300.0) -> list[dict[str, int]]:
    """Rank 0's counts of each (strategy, drain_chunks) job on a gloo group of ``world``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
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


def eager_ops(kind: str, counts: dict[str, int]) -> int:
    """Mask-phase ops of a call whose stage runs eagerly (``cuda_graphs=False``, the CPU)."""
    return counts.get("mask", 0) + counts.get("stage", 0)


def graphed_ops(kind: str, counts: dict[str, int]) -> int:
    """The same on CUDA with the stage replayed as a graph (``captured.py``): its ops become a
    copy of the gathered rows and one graph launch; dense strategies have no graph."""
    return eager_ops(kind, counts) if kind == "dense" else counts.get("mask", 0) + 2


UNITS = (2, 4, HEADS)
"""Drain units counted for ``model.MASK_CUT_OPS`` / ``MASK_UNIT_OPS`` (``drain_chunks``)."""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4, 6])
    args = p.parse_args(argv)
    # a dense call first: once a sparse call has grown the group's summary capacity, a dense
    # one issues 2 ops more (the padded body of the all-gather)
    jobs = [(s, 1) for s in KINDS.values()] + [("sparsp", u) for u in UNITS] + [("ulysses", 1)]
    table = {G: count(G, jobs) for G in args.ranks}
    phases = ("mask", "stage", "pack", "compute", "merge", "other")
    print(f"ops per phase ({' / '.join(phases)}), rank 0; stage = the mask phase's ops a CUDA "
          "graph replays on the GPU")
    for G, rows in table.items():
        for (s, u), r in zip(jobs, rows):
            print(f"G={G} {s:12s} drain units {u:2d}: " + " / ".join(str(r.get(k, 0)) for k in phases))
    for name, ops in (("MASK_OPS", eager_ops), ("GRAPHED_MASK_OPS", graphed_ops)):
        for i, kind in enumerate(KINDS):
            pts = {G: ops(kind, rows[i]) for G, rows in table.items()}
            if len(pts) < 3:
                print(f"{name}[{kind!r}]: {pts} (three G or more to fit)")
                continue
            a, b, c = fit(pts)
            exact = all(a + b * (G - 1) + c * (G - 1) ** 2 == y for G, y in pts.items())
            print(f"{name}[{kind!r}] = ({a}, {b}, {c}){'' if exact else '  (NOT exact for every G)'}")
    base = list(KINDS).index("direct")
    for G, rows in table.items():
        more = {u: eager_ops("direct", rows[len(KINDS) + j]) - eager_ops("direct", rows[base])
                for j, u in enumerate(UNITS)}
        print(f"G={G}: sparsp mask ops more with both drain payloads in u units: {more}")
    names = [s for s, _ in jobs]
    for kind, strategy in RUN_KINDS.items():
        i = names.index(strategy)  # the unchunked job
        got = {G: run_ops(rows[i]) for G, rows in table.items()}
        parts = []
        for j, what in enumerate(("first", "last", "tail")):
            pts = {G: v[j] for G, v in got.items()}
            if len(pts) < 3:
                parts.append(f"{what} {pts}")
                continue
            a, b, c = fit(pts)
            exact = all(a + b * (G - 1) + c * (G - 1) ** 2 == y for G, y in pts.items())
            parts.append(f"{what} ({a}, {b}, {c}){'' if exact else f' NOT exact: {pts}'}")
        print(f"RUN_OPS[{kind!r}]: " + "; ".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
