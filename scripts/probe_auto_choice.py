"""Host time of ``strategy="auto"``'s choice in a call (CPU, two gloo processes).

``auto`` chooses on the host between the call's one host read and its first transfer
(``strategies/auto.py``, ``choose_from``), so whatever that choice costs is on the critical path
of a host-bound call. This probe runs ``sp_attention(strategy="auto")`` on a small geometry with
the torch kernel, times every ``choose_from`` with ``time.perf_counter`` and prints the median
per rank (the first call, which decides and predicts, apart), then the last call's choice again
1,000 times in a loop (the warm cost, without the call's own work around it):

    python scripts/probe_auto_choice.py [--heads 32] [--tokens 1024] [--calls 30]

A measurement to decide what to change, not a benchmark (``sparsp bench attention`` times calls
on GPUs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dist_utils import run_distributed  # noqa: E402


def _worker(rank: int, world: int, heads: int, tokens: int, calls: int, fresh: bool = False) -> tuple[float, float]:
    import sparsp.strategies as strategies
    from sparsp import SparspConfig, sp_attention

    times = []
    choose = strategies.choose_from
    last = {}

    def timed(*a, **kw):
        last["args"] = (a, kw)
        t = time.perf_counter()
        out = choose(*a, **kw)
        times.append(time.perf_counter() - t)
        return out

    strategies.choose_from = timed
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, tokens, heads, 64, generator=g) for _ in range(3))
    cfg = SparspConfig(cdf_threshold=0.9, block_size=64, transport="nccl", kernel="torch")
    for call in range(calls):
        if fresh:  # new inputs every call, as the layers and steps of a denoising loop give
            g = torch.Generator().manual_seed(1000 * call + rank)
            q, k, v = (torch.randn(1, tokens, heads, 64, generator=g) for _ in range(3))
        sp_attention(q, k, v, strategy="auto", config=cfg)
    a, kw = last["args"]  # the last call's choice again, in a loop: the warm cost alone
    t = time.perf_counter()
    for _ in range(1000):
        choose(*a, **kw)
    loop = (time.perf_counter() - t) / 1000
    return times[0] * 1e6, statistics.median(times[1:]) * 1e6, loop * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--new-inputs", action="store_true",
                    help="new random q, k, v every call (masks and figures change: no repeat)")
    args = ap.parse_args()
    if args.calls < 2:
        raise SystemExit("--calls must be at least 2 (the first call decides, the rest repeat)")
    for rank, (first, rest, loop) in enumerate(run_distributed(_worker, 2, args.heads, args.tokens, args.calls,
                                                                   args.new_inputs)):
        print(f"rank {rank}: choose_from first call {first:.0f} µs, later calls median {rest:.1f} µs, "
              f"the last call's again in a loop {loop:.1f} µs")


if __name__ == "__main__":
    main()
