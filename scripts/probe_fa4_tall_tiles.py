"""FA4 at head dim 64 over 384-token query blocks: the kept blocks of query-block triples.

At d64 FA4's sm90 block-sparse kernel runs 128 × 128 tiles under 128-token query blocks, 0.80
of its dense kernel's 192 × 128 tiles (docs/kernels.md, "Head dim 64"). At LTX-Video 95.6 % of
the kept pairs lie in key blocks that all three rows of a query-block triple keep
(``scripts/mask_row_groups.py``). This probe splits a mask into those blocks, at
``block_size=(384, 128)``, and the rest, at (128, 128), runs both with FA4, merges the two
partial results (``kernels.merge.merge_final``) and compares output and time with today's one
launch at (128, 128):

    python scripts/probe_fa4_tall_tiles.py [--model ltx-video] [--cdf 0.9] [--iters 20]

On rank 0's query blocks of the benchmark's synthetic mask at G = 2 (periodic placement; random
q, k, v of the shard's shape). Calls FA4's internal ``_flash_attn_fwd`` for ``tile_mn``: a
measurement to decide what to build, not a code path of the library.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparsp.bench.kernel import time_ms
from sparsp.geometry import MODELS, preset
from sparsp.placement import make_placement
from sparsp.workloads import synthetic_masks

GROUP = 3


def split(keep: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``keep`` bool [H, nQ, nK] (nQ a multiple of ``group``) → (tall [H, nQ / group, nK]: the
    key blocks every row of a group keeps, rest [H, nQ, nK]: the others), disjoint and together
    ``keep``."""
    H, nQ, nK = keep.shape
    tall = keep.view(H, nQ // group, group, nK).all(2)
    rest = keep & ~tall.repeat_interleave(group, dim=1)
    assert torch.equal(rest | tall.repeat_interleave(group, dim=1), keep)
    return tall, rest


def lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FA4's full-block lists of ``keep`` bool [H, n, nK]: counts [1, H, n], ids [1, H, n, nK]."""
    nK = keep.shape[-1]
    ids = torch.arange(nK, device=keep.device, dtype=torch.int32)
    idx = torch.where(keep, ids, nK).sort(-1).values
    idx = torch.where(idx == nK, 0, idx).to(torch.int32)
    return keep.sum(-1, dtype=torch.int32)[None].contiguous(), idx[None].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ltx-video", choices=sorted(MODELS))
    ap.add_argument("--cdf", type=float, default=0.9)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_fa4_tall_tiles needs a CUDA device and FA4")
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    from flash_attn.cute.interface import _flash_attn_fwd

    from sparsp.kernels.merge import merge_final

    geom = preset(args.model)
    bs = geom.block_size
    pl = make_placement("periodic", geom, args.ranks)
    rows = torch.unique_consecutive(pl.perm[pl.token_slice(0)] // bs)
    rows = rows[: rows.numel() // GROUP * GROUP]
    dev = torch.device("cuda")
    keep = synthetic_masks(geom, args.cdf, seed=0)[args.cdf][0][:, rows].to(dev)  # [H, nQ, nK]
    H, nQ, nK = keep.shape
    D = geom.head_dim
    Sq, Sk = nQ * bs, nK * bs
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device=dev, generator=g, dtype=torch.bfloat16) for S in (Sq, Sk, Sk))
    tall, rest = split(keep)
    kept = float(keep.sum())
    print(f"{args.model} cdf {args.cdf}: {H} heads, {nQ} x {nK} blocks, density {kept / keep.numel():.3f}; "
          f"{GROUP * float(tall.sum()) / kept:.3f} of the kept pairs in tall blocks")

    def sparse(mask: torch.Tensor, q_block: int):
        cnt, idx = lists(mask)
        return BlockSparseTensorsTorch(
            mask_block_cnt=torch.zeros_like(cnt), mask_block_idx=torch.zeros(*cnt.shape, 1, dtype=torch.int32, device=dev),
            full_block_cnt=cnt, full_block_idx=idx, block_size=(q_block, bs))

    one, tall_bs, rest_bs = sparse(keep, bs), sparse(tall, GROUP * bs), sparse(rest, bs)

    def fa4(blocks, tile=None):
        return _flash_attn_fwd(q, k, v, softmax_scale=D**-0.5, block_sparse_tensors=blocks, return_lse=True,
                               pack_gqa=False, tile_mn=tile)

    def two(tile=None):
        o1, l1 = fa4(tall_bs, tile)[:2]
        o2, l2 = fa4(rest_bs)[:2]
        return merge_final(o1.permute(0, 2, 1, 3), l1, o2.permute(0, 2, 1, 3), l2, torch.bfloat16)

    want = fa4(one)[0]
    time = lambda fn: statistics.median(time_ms(fn, warmup=3, iters=args.iters, device=dev))  # noqa: E731
    flops = 4 * kept * bs * bs * D
    base = time(lambda: fa4(one))
    print(f"one launch, 128-row blocks: {base:.3f} ms, {flops / base / 1e9:.1f} TFLOP/s per kept block")
    for tile in (None, (192, 128), (128, 128)):
        try:
            got = two(tile)
            err = float((got.float() - want.float()).abs().max())
            t_tall = time(lambda tile=tile: fa4(tall_bs, tile))
            t_all = time(lambda tile=tile: two(tile))
        except Exception as exc:  # FA4 refusing a block size or tile is a result too
            print(f"tall tile {tile or 'auto'}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        print(f"tall tile {tile or 'auto'}: tall launch {t_tall:.3f} ms; tall + rest + merge {t_all:.3f} ms "
              f"({t_all / base:.3f} of one launch, {flops / t_all / 1e9:.1f} TFLOP/s per kept block); "
              f"max |difference| {err:.4f}")


if __name__ == "__main__":
    main()
