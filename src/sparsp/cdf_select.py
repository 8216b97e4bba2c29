"""The mask's CDF selection as one Triton kernel: softmax and top-mass selection per row.

``masks.select_blocks`` keeps, in each row of block scores, the top blocks whose cumulative
softmax mass is ≤ the head's ``cdf`` (at least one; every block when ``cdf`` ≥ 1). Written
with torch ops that is a softmax, a stable sort of every row, a prefix sum and a scatter:
at HunyuanVideo's 24 × 992 × 992 scores on an H200 the sort alone takes 0.80 ms of the
selection's 1.47 ms, and every rank runs it on every call before any byte moves.
This kernel holds one row in registers and finds the
kept set without sorting it:

- ``p = softmax(row)`` (a row of −inf — no similar key block — is all zero);
- the kept blocks are those whose probability is ≥ a cut ``T``: the smallest ``T`` such that
  the mass of ``{p ≥ T}`` is ≤ ``cdf``. Probabilities are non-negative floats, whose bit
  patterns order like the values, so ``T`` is found by bisection over the 31 bits: the search
  ends on one of the row's own values, the kept set is exact whatever their spacing;
- blocks *tied* with the largest excluded value ``v`` are taken in index order while the mass
  ``mass(p ≥ T) + rank · v`` stays ≤ ``cdf`` — the order of the stable sort, which puts equal
  values in index order;
- nothing kept (the largest block alone exceeds ``cdf``): the first largest block is.

The same set as the sort's up to float rounding: the mass is summed by a reduction tree here,
by a scan there, so a block whose cumulative mass is within float32 rounding of ``cdf`` may
fall on either side. Every rank runs the same kernel on the same gathered summaries (and
``split_mask`` does too), so the mask is the same bits everywhere, which is what the
distributed plan needs (docs/design.md "Mask semantics").

CUDA tensors run the compiled kernel; CPU tensors run it in Triton's interpreter when
``TRITON_INTERPRET=1`` was set before Triton was imported (the CPU suite checks the kernel's
logic against the sort that way). ``masks.select_blocks`` calls it on CUDA
where Triton is importable and a row fits (``MAX_COLS`` blocks); elsewhere the torch ops run
(and with ``SPARSP_TRITON=0``, ``_triton.runs``).
"""

from __future__ import annotations

import torch

from . import env
from ._triton import runs, tl, triton

MAX_COLS = 16384
"""Blocks per row the kernel holds in registers (one program per row); wider rows sort."""


def available(scores: torch.Tensor) -> bool:
    """Whether ``select_blocks`` runs this kernel on ``scores``: CUDA, Triton importable, rows
    of at most ``MAX_COLS`` blocks, Triton kernels not switched off (``_triton.runs``)."""
    return runs(scores) and 0 < scores.shape[-1] <= MAX_COLS


if triton is not None:
    @triton.jit
    def _select_rows(scores_ptr, cdf_ptr, out_ptr, n_cols, rows_per_head, heads, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cdf = tl.load(cdf_ptr + (row // rows_per_head) % heads)
        cols = tl.arange(0, BLOCK)
        inside = cols < n_cols
        x = tl.load(scores_ptr + row * n_cols + cols, mask=inside, other=float("-inf"))
        top_score = tl.max(x, 0)
        e = tl.exp(x - tl.where(top_score > float("-inf"), top_score, 0.0))
        total = tl.sum(e, 0)
        p = e / tl.where(total > 0, total, 1.0)
        bits = p.to(tl.int32, bitcast=True)  # p ≥ 0: the bit patterns order like the values
        top = tl.max(tl.where(inside, bits, 0), 0)
        lo = top * 0
        hi = top + 1  # mass(p ≥ hi) = 0 ≤ cdf
        for _ in range(31):  # smallest T with mass(p ≥ T) ≤ cdf (lower bound over [0, top + 1])
            mid = lo + (hi - lo) // 2
            mass = tl.sum(tl.where(inside & (bits >= mid), p, 0.0), 0)
            ok = mass <= cdf
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid + 1)
        above = inside & (bits >= hi)
        kept_mass = tl.sum(tl.where(above, p, 0.0), 0)
        v_bits = tl.max(tl.where(inside & (bits < hi), bits, -1), 0)  # largest excluded value
        v = v_bits.to(tl.float32, bitcast=True)
        tie = inside & (bits == v_bits)
        rank = tl.cumsum(tie.to(tl.int32), 0)  # 1, 2, … in index order among the ties
        keep = above | (tie & (kept_mass + rank.to(tl.float32) * v <= cdf))
        nothing = tl.sum(keep.to(tl.int32), 0) == 0
        keep = tl.where(nothing, tie & (rank == 1), keep)  # at least one: the first largest block
        keep = tl.where(cdf >= 1.0, inside, keep)
        tl.store(out_ptr + row * n_cols + cols, keep, mask=inside)


def _warps(block: int) -> int:
    # one warp per 1,024 blocks of a row: at 144 to 992 blocks one warp ran fastest on an H200
    # (0.04 / 0.25 ms at LTX / HunyuanVideo size against 0.07 / 0.28 with four; the reductions
    # of the bisection stay inside the warp), wider rows spread their registers over more
    return max(1, min(8, block // 1024))


def select(scores: torch.Tensor, cdf: torch.Tensor) -> torch.Tensor:
    """Bool mask [B, H, nQ, nK] of the blocks each row of ``scores`` (float32 [B, H, nQ, nK],
    −inf where a key block is excluded) keeps at the per-head thresholds ``cdf`` (float32 [H])."""
    if triton is None:
        raise RuntimeError("cdf_select needs Triton (pip install triton)")
    B, H, nQ, nK = scores.shape
    if nK > MAX_COLS:
        raise ValueError(f"rows of {nK} blocks exceed cdf_select.MAX_COLS = {MAX_COLS}")
    scores = scores.float().contiguous()
    cdf = cdf.to(device=scores.device, dtype=torch.float32).contiguous()
    if cdf.shape != (H,):
        raise ValueError(f"cdf must have one value per head ({H}), got shape {tuple(cdf.shape)}")
    out = torch.empty(scores.shape, dtype=torch.bool, device=scores.device)
    rows = B * H * nQ
    if rows == 0:
        return out
    if scores.device.type != "cuda" and not env.triton_interpret():
        raise RuntimeError("cdf_select runs CPU tensors in Triton's interpreter only: set "
                           "TRITON_INTERPRET=1 before Triton is imported")
    block = triton.next_power_of_2(nK)
    kwargs = {} if scores.device.type != "cuda" else {"num_warps": _warps(block)}
    _select_rows[(rows,)](scores, cdf, out, nK, nQ, H, BLOCK=block, **kwargs)
    return out


__all__ = ["MAX_COLS", "available", "select"]
