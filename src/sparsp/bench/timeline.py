"""One profiled call as a timeline: the host's ranges, then each GPU stream's work in order.

    sparsp bench timeline DIR/*-r1.json.gz

`sparsp bench attention --torch-profile DIR` leaves a gzipped Chrome trace of one call per row and
rank. The op tables beside it sum time per op; what they cannot show is *when* each thing ran
on which stream: whether the local kernel started while the payload was in flight, when each
chunk landed, when its kernel ran. This prints, in ms from the start of `bench.call`:

- the host's user ranges (`sparsp.metadata`, `sparsp.plan`, `sparsp.resolve`, `sparsp.run`, ...);
- per GPU stream: how many ops, their busy time and span, and every op at least `--min-us`
  long (kernels, copies, memsets; the `sparsp.*` ranges as the GPU saw them last).

Every trace is read before anything is printed: one line naming a file that is not a profiled
call's trace, exit status 2.

Read host durations with care: the first Triton launch after a profiler starts costs
milliseconds of host time (`bench attention` therefore traces a second call after a discarded
one), and a collective carries the profiler's own `record_param_comms`, so the host gap after
the metadata all-gather is partly the profiler's. The benchmark's unprofiled split (`mask_ms`,
...) has the true phases; the traces have the order of events.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from pathlib import Path

from .args import refuse

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def load(path: Path) -> list[dict]:
    """The complete events (``"ph": "X"``) of a Chrome trace (``.json``, or gzipped ``.json.gz``);
    ``ValueError`` saying why when the file is none."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            trace = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:  # gzip's errors are OSErrors
        raise ValueError(f"not a readable Chrome trace ({' '.join(str(e).split())})") from None
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents", []), list):
        raise ValueError("not a Chrome trace: expected a JSON object with traceEvents")
    return [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]


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


def main(args) -> int:
    """``sparsp bench timeline``: every trace read and checked first (``refuse``: one line, exit
    status 2), then each one's timeline."""
    if args.min_us < 0:
        refuse("timeline", f"--min-us must be >= 0, got {args.min_us:g}")
    lines = {}
    for path in args.traces:
        if not path.is_file():
            refuse("timeline", f"{path}: no such file")
        try:
            lines[path] = timeline(load(path), args.min_us)
        except ValueError as e:
            refuse("timeline", f"{path}: {e}")
    for path, text in lines.items():
        print(f"== {path}")
        print("\n".join(text))
    return 0
