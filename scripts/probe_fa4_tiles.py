"""FA4's block-sparse forward at one shape under its sm90 tile options, against FA4 dense.

FA4 picks a 192 × 128 tile for dense attention at head dim ≤ 64 but 128 × 128 under 128-token
sparse blocks, with register-held P (``mma_pv_is_rs``) and intra-warpgroup overlap on; this
probe times the block-sparse kernel with each combination of those two flags (and the dense
kernel at both tiles) on random per-head block masks, to see whether the d64 gap to dense
(0.84 of FA4 dense per kept block on the benchmark's own masks, 2026-12-01) is a tile choice:

    python scripts/probe_fa4_tiles.py [--shape 9216x18432x32x64] [--density 0.6] [--iters 20]

Calls FA4's internal ``_flash_attn_fwd`` (the options are not in ``flash_attn_func``'s
signature): a measurement, not a code path of the library.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from sparsp.bench.kernel import time_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9216x18432x32x64", help="SQxSKxHxD")
    ap.add_argument("--density", type=float, nargs="+", default=[0.6])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _flash_attn_fwd

    Sq, Sk, H, D = (int(x) for x in args.shape.split("x"))
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(1, Sq, H, D, device=dev, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, Sk, H, D, device=dev, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, Sk, H, D, device=dev, generator=g, dtype=torch.bfloat16)
    bs, nq, nk = 128, Sq // 128, Sk // 128
    time = lambda fn: statistics.median(time_ms(fn, warmup=3, iters=args.iters, device=dev))  # noqa: E731
    dense = {}
    for tile in ((192, 128), (128, 128)):
        dense[tile] = time(lambda tile=tile: _flash_attn_fwd(q, k, v, softmax_scale=D**-0.5, tile_mn=tile,
                                                              return_lse=True))
        flops = 4 * Sq * Sk * H * D
        print(f"dense tile {tile}: {dense[tile]:.3f} ms, {flops / dense[tile] / 1e9:.1f} TFLOP/s")
    best_dense = flops / min(dense.values()) / 1e9
    for density in args.density:
        keep = torch.rand(1, H, nq, nk, device=dev, generator=g) < density
        keep[..., 0] = True
        cnt = keep.sum(-1, dtype=torch.int32)
        idx = torch.where(keep, torch.arange(nk, device=dev, dtype=torch.int32), nk).sort(-1).values
        idx = torch.where(idx == nk, 0, idx).to(torch.int32).contiguous()
        sparse = BlockSparseTensorsTorch(
            mask_block_cnt=torch.zeros_like(cnt), mask_block_idx=torch.zeros(1, H, nq, 1, dtype=torch.int32, device=dev),
            full_block_cnt=cnt, full_block_idx=idx, block_size=(bs, bs))
        kept = 4 * float(keep.sum()) * bs * bs * D
        for tile, rs, overlap in itertools.product((None, (64, 128)), (True, False), (True, False)):
            try:
                ms = time(lambda tile=tile, rs=rs, overlap=overlap: _flash_attn_fwd(
                    q, k, v, softmax_scale=D**-0.5, block_sparse_tensors=sparse, return_lse=True,
                    pack_gqa=False, tile_mn=tile, mma_pv_is_rs=rs, intra_wg_overlap=overlap))
            except Exception as exc:  # an option FA4 refuses here is reported, not fatal
                print(f"density {density} tile={tile} rs={rs} overlap={overlap}: {type(exc).__name__}: "
                      f"{str(exc)[:100]}")
                continue
            rate = kept / ms / 1e9
            print(f"density {density:.2f} (kept {float(keep.float().mean()):.3f}) tile={tile or 'auto'} rs={rs} "
                  f"overlap={overlap}: {ms:.3f} ms, {rate:.1f} TFLOP/s, {rate / best_dense:.3f} of the best dense")


if __name__ == "__main__":
    main()
