"""Time the metadata's summing kernel (``masks._sums``) at other tiles, on one GPU.

Every sparse call starts with one pass over its q, k and v shard (``masks.summaries_into``:
q's and k's block sums, v's non-finite check) before the metadata all-gather, on the critical
path of every row. It reads 3 · S · H · D bf16 values; this probe times the kernel as the
library launches it and at other (tokens per step ``TOK``, features per program ``FCH``, warps)
tiles, at each preset's shard for G = 2 (B = 1), with CUDA events (median of ``--iters``
after warm-up), and prints µs, the effective read bandwidth and the largest difference of each
tile's q and k block sums from the library's (float32 sums in another order: a few ulps):

    python scripts/probe_sums_tiles.py [--models ltx-video ltx-2] [--iters 50] [--out FILE]

``TOK`` = 128 with a 128-token block loads the whole block at once. A measurement to decide
what to change, not a benchmark.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sparsp import masks
from sparsp._triton import triton
from sparsp.geometry import MODELS, preset

TILES = ((16, 256, 1), (4, 256, 1), (128, 32, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8),
         (64, 64, 4), (64, 128, 4), (32, 128, 4), (32, 256, 8), (16, 512, 4))
"""(TOK, FCH, warps) candidates; the first is the library's launch at the time of writing."""


def _time_us(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    spans = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        spans.append(a.elapsed_time(b) * 1e3)
    return statistics.median(spans)


def _launch(q, k, v, out, tok: int, fch: int, warps: int, block: int) -> None:
    B, S, H, D = q.shape
    n, F = -(-S // block), H * D
    masks._sums[(B * n, triton.cdiv(F, fch))](
        q, k, v, out, out, S, n, F, B * n * F, *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], BS=block,
        TOK=min(tok, block), FCH=fch, HAS_B=True, HAS_C=True, OFFSETS=False, ALIGN=8, num_warps=warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["hunyuan-video", "wan2.1-14b", "ltx-video", "ltx-2"],
                    choices=sorted(MODELS))
    ap.add_argument("--ranks", type=int, default=2, help="the shard is the sequence over this many ranks")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        ap.error("needs a CUDA GPU and Triton")
    rows = []
    for name in args.models:
        geom = preset(name)
        S, H, D, block = geom.num_tokens // args.ranks, geom.heads, geom.head_dim, geom.block_size
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        n, F = -(-S // block), H * D
        plane = n * F
        ref = torch.empty(2 * plane + masks.check_parts(1, n, F), device="cuda")
        masks.summaries_into(ref, block, q, k, v)
        library = _time_us(lambda: masks.summaries_into(ref, block, q, k, v), args.iters)
        nbytes = 3 * q.numel() * q.element_size()
        print(f"{name}: S {S}, {H}x{D}, {nbytes / 2**20:.0f} MiB read; summaries_into {library:.1f} µs "
              f"({nbytes / library / 1e3:.0f} GB/s)")
        rows.append({"model": name, "tile": "summaries_into", "us": round(library, 1),
                     "gbps": round(nbytes / library / 1e3)})
        for tok, fch, warps in TILES:
            out = torch.empty(2 * plane + n * triton.cdiv(F, fch), device="cuda")
            try:
                _launch(q, k, v, out, tok, fch, warps, block)
                us = _time_us(lambda: _launch(q, k, v, out, tok, fch, warps, block), args.iters)
            except Exception as e:  # a tile Triton cannot build: say so, go on
                print(f"  TOK {tok:3d} FCH {fch:3d} warps {warps}: {type(e).__name__}: {str(e)[:80]}")
                continue
            diff = (out[: 2 * plane] - ref[: 2 * plane]).abs().max().item()
            scale = ref[: 2 * plane].abs().max().item()
            check = out[2 * plane:].sum().item() - ref[2 * plane:].sum().item()
            print(f"  TOK {tok:3d} FCH {fch:3d} warps {warps}: {us:7.1f} µs ({nbytes / us / 1e3:5.0f} GB/s), "
                  f"sums differ by {diff:.2e} (of {scale:.1f}), v check {check:+.2e}")
            rows.append({"model": name, "tile": [tok, fch, warps], "us": round(us, 1),
                         "gbps": round(nbytes / us / 1e3), "max_diff": diff, "max_abs": scale})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
