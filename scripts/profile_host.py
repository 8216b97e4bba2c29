"""Where the host's time goes in ``sp_attention`` calls: a Python profile (cProfile) of a run
of calls after a warm-up, on the GPU the call would use, in one process per GPU.

At LTX sizes the device waits for the host for most of the mask phase (the profile of
2026-12-01: 0.93 ms of gaps before the first attention kernel against 0.19 ms of kernels), so
the host's Python is the path to shorten; this prints the functions that take it.

    torchrun --nproc-per-node 1 scripts/profile_host.py --model ltx-video [--calls 50] [--out FILE]
    torchrun --nproc-per-node 2 scripts/profile_host.py --model ltx-video --transport ipc

Rank 0 prints the top functions by own time and by cumulative time (and writes the raw
``pstats`` file to ``--out``); the device is synchronised once after the profiled calls, so
what is measured is what the host spends issuing them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from dataclasses import replace

import torch

from sparsp import SparspConfig, sp_attention
from sparsp.bench.attention import make_inputs
from sparsp.bench.common import init_distributed
from sparsp.geometry import MODELS, preset
from sparsp.placement import make_placement
from sparsp.strategies import get_transport


def add_call_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a probe that times ``sp_attention`` calls (this one, probe_host_phases.py)."""
    ap.add_argument("--model", default="ltx-video", choices=sorted(MODELS))
    ap.add_argument("--strategy", default="sparsp")
    ap.add_argument("--transport", default="auto", help="nccl, ipc, host or auto")
    ap.add_argument("--cdf", type=float, default=0.9)
    ap.add_argument("--calls", type=int, default=50)


def warm_call(args, script: str):
    """(rank, world, device, call): this rank's placed inputs of ``args.model`` and a call of
    ``args.strategy`` on them, already run five times (compiled, captured, warm)."""
    if args.calls < 1:
        raise SystemExit("--calls must be at least 1")
    rank, world, device = init_distributed()
    if device.type != "cuda":
        raise SystemExit(f"{script} times the CUDA path: run it on a GPU machine")
    geom = replace(preset(args.model), text_tokens=0)
    q, k, v = make_inputs(geom, make_placement("periodic", geom, world), rank, device,
                          torch.bfloat16, seed=0)
    cfg = SparspConfig(cdf_threshold=args.cdf, block_size=geom.block_size, transport=args.transport)
    call = lambda: sp_attention(q, k, v, strategy=args.strategy, config=cfg)  # noqa: E731
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    return rank, world, device, call, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_arguments(ap)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", help="write the pstats file here (rank 0)")
    args = ap.parse_args()
    rank, world, device, call, cfg = warm_call(args, "profile_host.py")
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    done = time.perf_counter() - start
    t = get_transport(args.transport, None, device, cfg.timeout_s)
    if rank == 0:
        print(f"{args.model}, {world} rank(s), {args.strategy}/{t.name}: {args.calls} calls issued in "
              f"{issued * 1e3:.1f} ms ({issued / args.calls * 1e3:.3f} ms per call, profiled), "
              f"done after {done * 1e3:.1f} ms")
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        if args.out:
            stats.dump_stats(args.out)


if __name__ == "__main__":
    main()
