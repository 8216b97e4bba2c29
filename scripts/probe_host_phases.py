"""Host time of each phase of ``sp_attention``, from the call's own annotations.

``sp_attention`` marks its phases with ``groups.marker`` (``sparsp.metadata``,
``sparsp.plan``, ``sparsp.resolve``, ``sparsp.run``; inside the resolve step the host read's
``sparsp.host_read`` and ``sparsp.host_wait``). This probe replaces those markers with
``time.perf_counter`` stamps — no profiler, so no profiler overhead — and times calls that each
start on an idle device (a synchronize before every call: how a call is timed by ``bench
attention``, and how the first attention of a DiT layer finds the device after the host read
of the previous one). Per phase: the median host µs over ``--calls``; ``setup`` is the time
from the call's start to its first phase, ``tail`` from its last phase to its return,
``host_wait`` the part of ``resolve`` spent waiting for the device's stage.

    torchrun --nproc-per-node 1 scripts/probe_host_phases.py --model ltx-video [--calls 50]
    torchrun --nproc-per-node 2 scripts/probe_host_phases.py --model ltx-video --transport ipc

Rank 0 prints the table and writes JSON to ``--out``. A measurement to decide what to change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import defaultdict

import torch

import sparsp.groups as groups
import sparsp.strategies as strategies
from profile_host import add_call_arguments, warm_call  # scripts/: the same calls

PHASES = ("setup", "sparsp.metadata", "sparsp.plan", "sparsp.resolve", "sparsp.host_read",
          "sparsp.host_wait", "sparsp.run", "tail", "call")


class Stamps:
    """Stands in for ``record_function``: the host time of every marked region, per call."""

    def __init__(self) -> None:
        self.spans: dict[str, float] = defaultdict(float)
        self.first: float | None = None
        self.last: float | None = None

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        if self.first is None:
            self.first = t0
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.spans[name] += t1 - t0
            self.last = t1


def stamped_calls(call, calls: int) -> dict[str, list[float]]:
    """Host seconds of each marked phase of ``calls`` calls, each started with the ranks met at a
    barrier on an idle device; also ``setup``, ``tail``, the whole ``call`` and ``finish`` (the
    resolve step less its read and wait: the read's finish and the transport's fence)."""
    per_call: dict[str, list[float]] = defaultdict(list)
    original = (strategies.record_function, groups.marker)
    try:
        for _ in range(calls):
            torch.cuda.synchronize()
            torch.distributed.barrier()
            stamps = Stamps()
            strategies.record_function = groups.marker = stamps
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            strategies.record_function, groups.marker = original
            spans = stamps.spans
            for name, span in spans.items():
                per_call[name].append(span)
            per_call["setup"].append((stamps.first or t1) - t0)
            per_call["tail"].append(t1 - (stamps.last or t1))
            per_call["call"].append(t1 - t0)
            per_call["finish"].append(spans.get("sparsp.resolve", 0.0) - spans.get("sparsp.host_read", 0.0)
                                      - spans.get("sparsp.host_wait", 0.0))
    finally:
        strategies.record_function, groups.marker = original
    torch.cuda.synchronize()
    return per_call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_call_arguments(ap)
    ap.add_argument("--out", help="JSON file to write (rank 0)")
    args = ap.parse_args()
    rank, world, device, call, _ = warm_call(args, "probe_host_phases.py")
    per_call = stamped_calls(call, args.calls)
    medians = {name: statistics.median(per_call[name]) * 1e6 for name in PHASES if per_call.get(name)}
    if rank == 0:
        print(f"{args.model}, {world} rank(s), {args.strategy}/{args.transport}: host µs per call "
              f"(median of {args.calls}, each call on an idle device)")
        for name, us in medians.items():
            print(f"  {name:18s} {us:8.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "ranks": world, "strategy": args.strategy,
                           "transport": args.transport, "calls": args.calls,
                           "device": torch.cuda.get_device_name(), "host_us": medians}, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
