"""One profiled call as a timeline: the host's ranges, then each GPU stream's work in order.

`sparsp bench attention --torch-profile DIR` leaves a gzipped Chrome trace of one call per row and
rank. The op tables beside it sum time per op; what they cannot show is *when* each thing ran
on which stream: whether the local kernel started while the payload was in flight, when each
chunk landed, when its kernel ran. This prints, in ms from the start of `bench.call`:

- the host's user ranges (`sparsp.metadata`, `sparsp.plan`, `sparsp.resolve`, `sparsp.run`, ...);
- per GPU stream: how many ops, their busy time and span, and every op at least `--min-us`
  long (kernels, copies, memsets; the `sparsp.*` ranges as the GPU saw them last).

    python -m sparsp.bench.timeline DIR/*-r1.json.gz

Read host durations with care: the first Triton launch after a profiler starts costs
milliseconds of host time (`bench attention` therefore traces a second call after a discarded
one), and a collective carries the profiler's own `record_param_comms`, so the host gap after
the metadata all-gather is partly the profiler's. The benchmark's unprofiled split (`mask_ms`,
...) has the true phases; the traces have the order of events.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def timeline(events: list[dict], min_us: float) -> list[str]:
    starts = [e["ts"] for e in events if e.get("name") == "bench.call"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not starts and not gpu:
        raise ValueError("no bench.call range and no GPU events: not a profiled call's trace")
    t0 = min(starts) if starts else min(e["ts"] for e in gpu)

    def at(e: dict) -> str:
        return f"{(e['ts'] - t0) / 1e3:9.3f} +{e['dur'] / 1e3:8.3f}  {e['name'][:80]}"

    lines = ["host ranges (ms from bench.call):"]
    lines += ["  " + at(e) for e in sorted(events, key=lambda e: e["ts"]) if e.get("cat") == "user_annotation"]
    streams: dict = defaultdict(list)
    for e in gpu:
        streams[(str(e.get("args", {}).get("stream")), e["cat"] == "gpu_user_annotation")].append(e)
    for (stream, ranges), ops in sorted(streams.items()):
        ops.sort(key=lambda e: e["ts"])
        busy = sum(e["dur"] for e in ops) / 1e3
        span = f"{(ops[0]['ts'] - t0) / 1e3:.3f}..{(ops[-1]['ts'] + ops[-1]['dur'] - t0) / 1e3:.3f}"
        what = "ranges on the GPU" if ranges else f"stream {stream}"
        lines.append(f"{what}: {len(ops)} ops, busy {busy:.3f} ms, span {span} ms")
        lines += ["  " + at(e) for e in ops if ranges or e["dur"] >= min_us]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Traces: sparsp bench attention --torch-profile DIR (one per row and rank).")
    p.add_argument("traces", nargs="+", type=Path, help="Chrome traces (.json or .json.gz)")
    p.add_argument("--min-us", type=float, default=20.0,
                   help="list GPU ops at least this long (µs; shorter ones are only counted; default 20)")
    args = p.parse_args(argv)
    if args.min_us < 0:
        p.error("--min-us must be >= 0")
    for path in args.traces:
        if not path.is_file():
            p.error(f"{path}: no such file")
        print(f"== {path}")
        try:
            print("\n".join(timeline(load(path), args.min_us)))
        except (ValueError, json.JSONDecodeError, OSError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
