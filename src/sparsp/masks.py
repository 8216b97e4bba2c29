"""Block masks in SpargeAttn's CDF mode, in one piece and split for sequence parallelism.

Semantics (DESIGN.md, "Mask semantics"), per (batch, head):

1. keys are smoothed: k̃ = k − mean(k over the whole sequence);
2. each Q block and K block is pooled by the mean of its tokens (a short tail block is divided
   by its real length); its self-similarity is ‖mean of L2-normalised tokens‖² ∈ [0, 1], and it
   is *similar* when that exceeds ``sim_threshold`` (``None``: similarity off, all similar);
3. block scores = softmax over K blocks of pooled_q · pooled_kᵀ / √D with non-similar K columns
   at −inf; each row is sorted descending and the top blocks whose cumulative mass is
   ≤ ``cdf_threshold`` are kept (the block that crosses the threshold is not; at least one is);
4. non-similar K blocks become full columns, non-similar Q blocks full rows.

The split form serves sequence parallelism (paper §4.2): every rank pools its own blocks after
one all-reduce of the key sum, all-gathers the (tiny) pooled keys, and calls
``select_blocks`` for its local query blocks — bit-identical to the single-process mask because
both run the same arithmetic on the same pooled tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Threshold = float | torch.Tensor


@dataclass(frozen=True)
class PooledBlocks:
    """Block summaries. ``mean``: [B, H, n, D] float32; ``sim``: [B, H, n] float32;
    ``lengths``: LongTensor [n] real tokens per block."""

    mean: torch.Tensor
    sim: torch.Tensor
    lengths: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.mean.shape[2]

    @staticmethod
    def cat(parts: list["PooledBlocks"]) -> "PooledBlocks":
        """Concatenate summaries along the block dim (rank order = global order)."""
        return PooledBlocks(
            torch.cat([p.mean for p in parts], dim=2),
            torch.cat([p.sim for p in parts], dim=2),
            torch.cat([p.lengths for p in parts]),
        )


def key_sum(k: torch.Tensor) -> torch.Tensor:
    """Sum of k over the sequence, float32 [B, H, D] (all-reduced across ranks in SP)."""
    return k.float().sum(dim=1)


def pool_blocks(x: torch.Tensor, block_size: int, center: torch.Tensor | None = None) -> PooledBlocks:
    """Pool ``x`` (B, S, H, D) into blocks of ``block_size`` tokens; ``center`` (B, H, D) is
    subtracted from every token first (key smoothing)."""
    if x.dim() != 4:
        raise ValueError(f"expected (B, S, H, D), got shape {tuple(x.shape)}")
    _check_block("block_size", block_size)
    B, S, H, D = x.shape
    n = math.ceil(S / block_size)
    xf = x.float().permute(0, 2, 1, 3)  # (B, H, S, D)
    if center is not None:
        xf = xf - center.float()[:, :, None, :]
    pad = n * block_size - S
    lengths = torch.full((n,), block_size, dtype=torch.long)
    if pad:
        lengths[-1] = block_size - pad
        # Zero padding adds nothing to sums; dividing by the real length gives the mean.
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    blocks = xf.reshape(B, H, n, block_size, D)
    denom = lengths.to(x.device, torch.float32)[None, None, :, None]
    mean = blocks.sum(dim=3) / denom
    unit = torch.nn.functional.normalize(blocks, dim=-1)  # zero rows stay zero
    sim = (unit.sum(dim=3) / denom).square().sum(dim=-1)
    return PooledBlocks(mean, sim, lengths.to(x.device))


def _check_block(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int (tokens per block), got {value!r}")


def _per_head(value: Threshold, heads: int, name: str, device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float64, device=device)
    if t.dim() == 0:
        t = t.expand(heads)
    if t.shape != (heads,):
        raise ValueError(f"{name} must be a scalar or a tensor of {heads} per-head values, got shape {tuple(t.shape)}")
    if torch.isnan(t).any() or (t < 0).any() or (t > 1).any():
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    return t


def select_blocks(
    pq: PooledBlocks,
    pk: PooledBlocks,
    *,
    cdf_threshold: Threshold,
    sim_threshold: Threshold | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Bool mask [B, H, nQ, nK] of the K blocks each pooled Q block keeps."""
    B, H, _, D = pq.mean.shape
    device = pq.mean.device
    cdf = _per_head(cdf_threshold, H, "cdf_threshold", device)
    scale = D**-0.5 if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", pq.mean, pk.mean) * scale
    if sim_threshold is not None:
        sim = _per_head(sim_threshold, H, "sim_threshold", device)[None, :, None]
        k_similar = pk.sim.double() > sim  # [B, H, nK]
        q_similar = pq.sim.double() > sim
        scores = scores.masked_fill(~k_similar[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores.double(), dim=-1).nan_to_num_(0.0)  # a row of all −inf → 0
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = ordered.cumsum(dim=-1) <= cdf[None, :, None, None]
    keep_sorted[..., 0] = True  # at least one block per row
    # cdf = 1 keeps everything: a cumulative sum can round to 1 + ε before the last block.
    keep_sorted |= (cdf >= 1.0)[None, :, None, None]
    mask = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    if sim_threshold is not None:
        mask |= ~k_similar[:, :, None, :]
        mask |= ~q_similar[:, :, :, None]
    return mask


def block_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cdf_threshold: Threshold,
    sim_threshold: Threshold | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> torch.Tensor:
    """The block mask of ``q, k`` (B, S, H, D) → bool [B, H, nQ, nK] (single process)."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor (B, S, H, D), got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, S, H, D), got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, heads or head dim")
    if not (q.is_floating_point() and k.is_floating_point()):
        raise ValueError(f"q and k must be floating point, got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k need at least one token, got {tuple(q.shape)} and {tuple(k.shape)}")
    for name, t in (("q", q), ("k", k)):  # a NaN would silently pick arbitrary blocks
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(f"{name} has {bad} NaN/Inf values; block_mask needs finite inputs")
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    center = key_sum(k) / k.shape[1]
    pq = pool_blocks(q, block_q)
    pk = pool_blocks(k, block_k, center=center)
    return select_blocks(pq, pk, cdf_threshold=cdf_threshold, sim_threshold=sim_threshold)


# --- statistics -------------------------------------------------------------------------------


def density(mask: torch.Tensor) -> float:
    """Share of kept blocks (any leading dims)."""
    return mask.float().mean().item()


def head_density(mask: torch.Tensor) -> torch.Tensor:
    """Per-head share of kept blocks for a mask [..., H, nQ, nK] → [H] (averaged over the rest)."""
    m = mask.float()
    return m.reshape(-1, *m.shape[-3:]).mean(dim=(0, 2, 3))


PATTERNS = ("diagonal", "multi-diagonal", "column", "other")


def pattern_shares(mask: torch.Tensor, geom, *, column_share: float = 0.5) -> dict[str, float]:
    """Share of kept (q, k) block pairs in each video pattern, for masks [..., nB, nB] over
    ``geom``'s blocks in original order.

    A kept pair is *column* when its K block is kept by ≥ ``column_share`` of all rows (a global
    block); otherwise *diagonal* when both blocks sit in the same frame (block centres less
    than one frame apart in time), *multi-diagonal* when they sit in different frames at the
    same spatial place (spatial centres within ``block_size`` tokens), *other* otherwise. Pairs
    with a text block are column or other.
    """
    m = mask.reshape(-1, *mask.shape[-2:]).bool()
    t, s, is_video = _block_centres(geom)
    col = m.float().mean(dim=1) >= column_share  # [n_masks, nK]
    dt = (t[:, None] - t[None, :]).abs()
    ds = (s[:, None] - s[None, :]).abs()
    both_video = is_video[:, None] & is_video[None, :]
    diagonal = both_video & (dt < 1.0)
    multi = both_video & (dt >= 1.0) & (ds <= geom.block_size)
    kept = m.sum().item()
    if kept == 0:
        return {p: 0.0 for p in PATTERNS}
    is_col = m & col[:, None, :]
    rest = m & ~is_col
    counts = {
        "column": is_col.sum().item(),
        "diagonal": (rest & diagonal).sum().item(),
        "multi-diagonal": (rest & multi).sum().item(),
    }
    counts["other"] = kept - sum(counts.values())
    return {p: counts[p] / kept for p in PATTERNS}


def _block_centres(geom) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: mean frame index, mean spatial index (h·W + w), and whether it holds video."""
    n, bs = geom.num_blocks, geom.block_size
    idx = torch.arange(n * bs).clamp(max=geom.num_tokens - 1).reshape(n, bs).float()
    vid = idx < geom.video_tokens
    t = torch.where(vid, idx // geom.frame_tokens, torch.zeros_like(idx))
    s = torch.where(vid, idx % geom.frame_tokens, torch.zeros_like(idx))
    cnt = vid.sum(1).clamp(min=1)
    return t.sum(1) / cnt, s.sum(1) / cnt, vid.any(1)
