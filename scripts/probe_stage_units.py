"""What a drain cut into head-group units costs before and after the host read, on one GPU.

On 2×H200 the rows whose drain ran in 4 units had a mask phase 0.8–1.0 ms longer than the same
model's unchunked rows (docs/performance.md, owed item 4): the units' selections, layouts and
block lists live in the captured plan stage (one CUDA graph per geometry), and their layouts are
sliced from the read in its finish. This probe splits that cost at a preset's G = 2 shard, with
two ranks sharing one GPU (gloo, the ``host`` transport: the CUDA paths of a 2-GPU call) and
``drain_chunks`` 1 against ``--units``:

- ``stage_ms``: the device time of one replay of the rank's captured plan stage (CUDA events,
  median of ``--iters``), measured one rank at a time (the other waits at a barrier), so the
  two ranks never share the GPU while it is timed; ``stage_kernels`` and ``stage_busy_ms``:
  the kernels of one replay and their summed durations, from a torch.profiler trace;
- ``replay_us``: the host's time to launch that replay;
- host µs of the call's phases (``probe_host_phases.py``'s stamps, median of ``--calls``, each
  call started with both ranks synchronised on an idle device): ``sparsp.plan`` (the replay's
  launch in the call), ``sparsp.resolve`` (the read, its wait and its finish, where the units'
  layouts are sliced), ``finish`` = resolve − host_read − host_wait (the finish and the
  transport's fence), ``sparsp.run`` and the whole call. Both ranks use the GPU in these
  calls: their device waits are not a 2-GPU figure, their host work is.

    torchrun --nproc-per-node 2 scripts/probe_stage_units.py [--models ltx-2 wan2.1-14b]
        [--units 4] [--iters 20] [--calls 20] [--out FILE]

Rank 0 prints a table and writes JSON to ``--out``. A measurement to decide what to change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from dataclasses import replace

import torch
import torch.distributed as dist

from probe_host_phases import stamped_calls  # scripts/: the same host stamps
from sparsp import SparspConfig, sp_attention
from sparsp.bench.attention import make_inputs
from sparsp.bench.common import init_distributed
from sparsp.geometry import MODELS, preset
from sparsp.placement import make_placement
from sparsp.strategies import captured, close_transports



def stage_times(stage, iters: int) -> dict:
    """Device ms of one replay of ``stage`` (median), the host's µs to launch it, and the
    kernels of one replay with their summed duration (profiler)."""
    for _ in range(3):
        stage.graph.replay()
    torch.cuda.synchronize()
    device, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        stage.graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        stage.graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    busy = sum(sum(v) for v in by_name.values()) / 1e3
    top = sorted(((name, len(v), round(sum(v), 1)) for name, v in by_name.items()), key=lambda t: -t[2])
    return {"stage_ms": round(statistics.median(device), 4), "replay_us": round(statistics.median(host), 1),
            "stage_kernels": len(kernels), "stage_busy_ms": round(busy, 4),
            "stage_by_kernel": [{"name": n[:160], "count": c, "us": us} for n, c, us in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["ltx-2", "wan2.1-14b"], choices=sorted(MODELS))
    ap.add_argument("--units", nargs="*", type=int, default=[4], help="drain units to compare with 1")
    ap.add_argument("--cdf", type=float, default=0.9)
    ap.add_argument("--iters", type=int, default=20, help="timed replays of each stage")
    ap.add_argument("--calls", type=int, default=20, help="timed calls for the host phases")
    ap.add_argument("--top", type=int, default=25, help="kernels of the stage to list per model")
    ap.add_argument("--out", help="JSON file to write (rank 0)")
    args = ap.parse_args()
    rank, world, device = init_distributed("gloo")  # every rank on the one GPU
    if device.type != "cuda":
        raise SystemExit("probe_stage_units.py times the CUDA path: run it on a GPU machine")
    rows = []
    for model in args.models:
        geom = replace(preset(model), text_tokens=0)
        q, k, v = make_inputs(geom, make_placement("periodic", geom, world), rank, device,
                              torch.bfloat16, seed=0)
        for units in [1, *args.units]:
            cfg = SparspConfig(cdf_threshold=args.cdf, block_size=geom.block_size, transport="host",
                               drain_chunks=units)
            call = lambda: sp_attention(q, k, v, strategy="sparsp", config=cfg)  # noqa: E731
            before = set(captured._STAGES)
            for _ in range(4):  # eager, capture, replays
                call()
            torch.cuda.synchronize()
            new = [key for key in captured._STAGES if key not in before]
            stage = captured._STAGES[new[-1]] if new else None
            row = {"model": model, "drain_units": units, "rank": rank}
            for r in range(world):  # one rank at a time on the GPU
                dist.barrier()
                if r == rank and isinstance(stage, captured._Stage):
                    row.update(stage_times(stage, args.iters))
                torch.cuda.synchronize()
            dist.barrier()
            row.update({f"host_us_{name.removeprefix('sparsp.')}": round(statistics.median(v) * 1e6, 1)
                        for name, v in stamped_calls(call, args.calls).items()})
            rows.append(row)
        del q, k, v
        close_transports()
        torch.cuda.empty_cache()
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        every = [r for part in gathered for r in part]
        keys = ["stage_ms", "stage_busy_ms", "stage_kernels", "replay_us", "host_us_plan",
                "host_us_finish", "host_us_resolve", "host_us_run", "host_us_call"]
        print("model        units rank " + " ".join(f"{k.removeprefix('host_us_'):>13s}" for k in keys))
        for r in sorted(every, key=lambda r: (r["model"], r["drain_units"], r["rank"])):
            print(f"{r['model']:12s} {r['drain_units']:5d} {r['rank']:4d} "
                  + " ".join(f"{r.get(k, float('nan')):13.4g}" for k in keys))
        for r in every:  # what the stage's time is made of (rank 0, one replay)
            if r["rank"] == 0 and r.get("stage_by_kernel") and r["drain_units"] == 1:
                print(f"{r['model']}: the stage's kernels by device time (count, µs, name)")
                for k in r["stage_by_kernel"][:args.top]:
                    print(f"  {k['count']:3d} {k['us']:8.1f}  {k['name'][:110]}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"ranks": world, "cdf": args.cdf, "device": torch.cuda.get_device_name(),
                           "note": "two ranks sharing one GPU; stage timed one rank at a time",
                           "rows": every}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
