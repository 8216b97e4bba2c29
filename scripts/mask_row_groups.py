"""How alike neighbouring query-block rows of a mask are: the case for taller query tiles at d64.

FA4's sm90 block-sparse kernel runs 128 × 128 tiles under 128-token query blocks, while its
dense kernel at head dim 64 runs 192 × 128 tiles, 1.17–1.24× faster per block
(docs/kernels.md, "Head dim 64"). A kernel over 384-token query blocks (three mask rows) could
use the taller tile, but it computes, for each group of three rows, every key block any of them
keeps. This CPU analysis measures what that costs on the synthetic masks of
``sparsp.workloads`` (the benchmark's own), per cdf, for the query blocks of one rank in the
order a placement gives them:

* ``union work``: (3 × key blocks kept by any row of a group) / (key blocks kept), the work a
  union tile computes per kept block (1 = no waste);
* ``full share``: the share of kept (row, key block) pairs whose key block every row of the
  group keeps — what a 384-row launch of full blocks alone covers, the rest left to a 128-row
  pass.

    python scripts/mask_row_groups.py [--model ltx-video] [--group 3] [--ranks 2] [--layers 2]
    python scripts/mask_row_groups.py --trace masks.pt      # recorded masks (``sparsp trace``)

A measurement to decide what to build, not a code path of the library.
"""

from __future__ import annotations

import argparse
import json

import torch

from sparsp.geometry import MODELS, preset
from sparsp.placement import make_placement
from sparsp.traces import load_trace
from sparsp.workloads import synthetic_masks


def row_groups(mask: torch.Tensor, rows: torch.Tensor, group: int) -> dict:
    """``mask`` bool [heads, nB, nB]; ``rows``: the query blocks in kernel order."""
    picked = mask[:, rows]
    n = picked.shape[1] // group * group
    tiles = picked[:, :n].reshape(picked.shape[0], -1, group, picked.shape[2])
    kept = int(tiles.sum())
    return {"density": kept / tiles.numel(),
            "union_work": group * int(tiles.any(2).sum()) / max(kept, 1),
            "full_share": group * int(tiles.all(2).sum()) / max(kept, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ltx-video", choices=sorted(MODELS))
    ap.add_argument("--group", type=int, default=3, help="query-block rows per tall tile")
    ap.add_argument("--ranks", type=int, default=2, help="the placement's group size (rank 0's rows)")
    ap.add_argument("--placements", nargs="+", default=["periodic", "contiguous"])
    ap.add_argument("--cdf", type=float, nargs="+", default=[0.85, 0.9, 0.95])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--trace", help="a mask trace (sparsp.traces) instead of the synthetic masks")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    if args.group < 2:
        raise SystemExit("--group must be at least 2")
    if args.trace:
        trace = load_trace(args.trace)
        geom, masks = trace.geometry, {trace.cdf_threshold: trace.masks}
        args.model = geom.name
    else:
        geom = preset(args.model)
        masks = synthetic_masks(geom, args.cdf, layers=args.layers, seed=0)
    out = []
    for name in args.placements:
        pl = make_placement(name, geom, args.ranks)
        rows = torch.unique_consecutive(pl.perm[pl.token_slice(0)] // geom.block_size)
        for cdf, m in masks.items():
            r = row_groups(m.reshape(-1, *m.shape[-2:]), rows, args.group)
            out.append({"model": args.model, "placement": name, "ranks": args.ranks, "cdf": cdf,
                        "group": args.group, **r})
            print(f"{args.model} {name:10s} G={args.ranks} cdf {cdf}: density {r['density']:.3f}, "
                  f"union work {r['union_work']:.3f}, full share {r['full_share']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
