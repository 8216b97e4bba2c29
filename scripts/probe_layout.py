#!/usr/bin/env python3
"""The payload layout of the plan stage, torch ops against the Triton kernels (one GPU).

A `sparsp` call at G = 2 lays out two payloads before its host read (`packing.prepare`: the
canonical block ids, starts, lengths and counts, and for the payload it packs the token rows),
inside the plan stage that replays as a CUDA graph. This times that work alone at a preset's
G = 2 shard, both ways, each captured in a CUDA graph and replayed (CUDA events, median of
`--iters` replays after warm-up), and checks that both give the same layout:

    python scripts/probe_layout.py --model ltx-2 wan2.1-14b --units 1 4

`--units U` lays out U head-group units at once (a drain cut into U chunks). Prints a table
and writes JSON rows {model, units, blocks, torch_us, triton_us, torch_kernels,
triton_kernels} to `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import torch


def _selection(heads: int, n: int, units: int, density: float, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    whole = torch.rand(heads, n, device="cuda", generator=g) < density
    if units == 1:
        return whole
    from sparsp.strategies import chunks

    stacked = torch.zeros(units, heads, n, dtype=torch.bool, device="cuda")
    for u, (h0, h1) in enumerate(chunks.head_groups(heads, units)):
        stacked[u, h0:h1] = whole[h0:h1]
    return stacked


def _time(fn, iters: int) -> tuple[float, int]:
    """Median µs of one replay of ``fn`` captured in a CUDA graph, and its kernel count."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: compiles, allocator pools
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return statistics.median(times), kernels


def main(argv: list[str] | None = None) -> int:
    from sparsp.geometry import PRESETS, preset
    from sparsp.packing import prepare

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=["ltx-video", "ltx-2", "wan2.1-14b", "hunyuan-video"],
                   choices=PRESETS, help="presets (their G = 2 shard; default: all four)")
    p.add_argument("--units", nargs="+", type=int, default=[1, 4], help="head-group units laid out at once")
    p.add_argument("--density", type=float, default=0.5, help="fraction of blocks selected (default 0.5)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("results/probe_layout.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.iters < 10 or not 0 < args.density <= 1 or min(args.units) < 1:
        p.error("--iters >= 10, 0 < --density <= 1, --units >= 1")
    rows = []
    for name in args.model:
        geom = preset(name)
        shard = geom.num_tokens // 2
        bs = 128
        n = math.ceil(shard / bs)
        for units in args.units:
            sel = _selection(geom.heads, n, units, args.density, seed=units)

            def run(switch: str):
                os.environ["SPARSP_TRITON_LAYOUT"] = switch
                return lambda: (prepare(sel, shard, bs, heads=geom.heads), prepare(sel, shard, bs))

            torch_fn, triton_fn = run("0"), run("1")
            os.environ["SPARSP_TRITON_LAYOUT"] = "0"
            want = torch_fn()[0]
            os.environ["SPARSP_TRITON_LAYOUT"] = "1"
            got = triton_fn()[0]
            parts = list(zip(want.unbind(), got.unbind())) if units > 1 else [(want, got)]
            for w, o in parts:
                counts = (int(w.num_selected), int(w.num_short))
                assert (int(o.num_selected), int(o.num_short)) == counts, name
                a, b = w.finish(*counts), o.finish(*counts)
                assert torch.equal(a.block_ids, b.block_ids) and torch.equal(a.rows, b.rows), name
            os.environ["SPARSP_TRITON_LAYOUT"] = "0"
            t_torch, k_torch = _time(torch_fn, args.iters)
            os.environ["SPARSP_TRITON_LAYOUT"] = "1"
            t_triton, k_triton = _time(triton_fn, args.iters)
            rows.append({"model": name, "units": units, "blocks": geom.heads * n, "shard": shard,
                         "torch_us": round(t_torch, 1), "triton_us": round(t_triton, 1),
                         "torch_kernels": k_torch, "triton_kernels": k_triton})
            print(f"{name:14s} units {units:2d}  {geom.heads * n:6d} blocks  torch {t_torch:7.1f} µs "
                  f"({k_torch} kernels)  triton {t_triton:7.1f} µs ({k_triton} kernels)  same layout")
    os.environ.pop("SPARSP_TRITON_LAYOUT", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "probe_layout", "device": torch.cuda.get_device_name(),
                                    "density": args.density, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
