"""Host µs of each step of a call's metadata step (``plan.gather_metadata``), one step at a time.

``probe_host_phases.py`` gives the metadata step's total (≈ 220 µs per LTX-size call on an H200
host, the largest phase); this probe times its pieces alone, on a preset's placed inputs, each
repeated ``--reps`` times back to back (median of ``--rounds`` rounds, the device synchronised
between rounds so no queue builds up):

    torchrun --nproc-per-node 1 scripts/probe_metadata_steps.py --model ltx-video

Rank 0 prints µs per step and writes JSON to ``--out``. A measurement to decide what to change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from sparsp import SparspConfig
from sparsp.bench.attention import make_inputs
from sparsp.bench.common import init_distributed
from sparsp.geometry import MODELS, preset
from sparsp.masks import check_parts, fused_sums, summaries_into
from sparsp.placement import make_placement
from sparsp.plan import _graphed_summaries, _header, _send_row, _summaries, gather_metadata


def _time_us(fn, reps: int, rounds: int) -> float:
    per_round = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        per_round.append((time.perf_counter() - t0) / reps * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per_round)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ltx-video", choices=sorted(MODELS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", help="JSON file to write (rank 0)")
    ap.add_argument("--cprofile", action="store_true",
                    help="also print a Python profile (cProfile, own time) of the whole step's calls")
    args = ap.parse_args()
    rank, world, device = init_distributed()
    if device.type != "cuda":
        raise SystemExit("probe_metadata_steps.py times the CUDA path: run it on a GPU machine")
    geom = replace(preset(args.model), text_tokens=0)
    q, k, v = make_inputs(geom, make_placement("periodic", geom, world), rank, device, torch.bfloat16, seed=0)
    cfg = SparspConfig(block_size=geom.block_size)
    group = dist.group.WORLD
    B, S, H, D = q.shape
    n = -(-S // cfg.block_size)
    size = 2 * B * n * H * D + check_parts(B, n, H * D)
    header = _header(q, cfg, "sparsp", size)
    row = _send_row(header, size)
    body = row[header.numel(): header.numel() + size]
    everyone = torch.empty(world * row.numel(), device=device)
    pg = dist.distributed_c10d._get_default_group()

    def all_gather():
        dist.all_gather_into_tensor(everyone, row, group=group, async_op=True).wait()

    def torch_form():
        os.environ["SPARSP_TRITON_SUMS"] = "0"
        try:
            _summaries(q, k, v, group, cfg, True)
        finally:
            os.environ.pop("SPARSP_TRITON_SUMS")

    def graphed():
        if not _graphed_summaries(body, cfg.block_size, q, k, v):
            raise SystemExit("the summing graph was not taken")

    for _ in range(2):  # the first sight of the key, then the capture
        _graphed_summaries(body, cfg.block_size, q, k, v)

    def record():
        with torch.profiler.record_function("probe"):
            pass

    steps = {
        "gather_metadata (the whole step)": lambda: gather_metadata(q, k, v, group, cfg, "sparsp", sparse=True),
        "  torch form of the summaries (SPARSP_TRITON_SUMS=0)": torch_form,
        "  fused_sums (the checks)": lambda: fused_sums(q, k, v),
        "  _header (cached)": lambda: _header(q, cfg, "sparsp", size),
        "  _send_row (cached)": lambda: _send_row(header, size),
        "  summaries_into (the launch)": lambda: summaries_into(body, cfg.block_size, q, k, v),
        "  the same replayed from a CUDA graph (SPARSP_SUMS_GRAPH)": graphed,
        "  torch.empty (the gathered rows)": lambda: torch.empty(world * row.numel(), device=device),
        "  all_gather_into_tensor + work.wait()": all_gather,
        "  ProcessGroup._allgather_base + work.wait()": lambda: pg._allgather_base(everyone, row).wait(),
        "  record_function enter + exit": record,
        "  torch.cuda.current_stream()": lambda: torch.cuda.current_stream(device),
        "  torch add (for scale)": lambda: q.add(k),
    }
    result = {}
    for name, fn in steps.items():
        fn()
        result[name.strip()] = _time_us(fn, args.reps, args.rounds)
    if args.cprofile and rank == 0:
        import cProfile
        import pstats

        whole = steps["gather_metadata (the whole step)"]
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.reps * args.rounds):
            whole()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    if rank == 0:
        print(f"{args.model}, {world} rank(s): host µs per step (median of {args.rounds} rounds of {args.reps})")
        for name in steps:
            print(f"  {name:55s} {result[name.strip()]:8.1f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "ranks": world, "device": torch.cuda.get_device_name(),
                           "host_us": result}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
