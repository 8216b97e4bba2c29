"""Block masks in SpargeAttn's CDF mode, in one piece and split for sequence parallelism.

Semantics (docs/design.md, "Mask semantics"), per (batch, head):

1. keys are smoothed: k̃ = k − mean(k over the whole sequence);
2. each Q block and K block is pooled by the mean of its tokens (a short tail block is divided
   by its real length); its self-similarity is ‖mean of L2-normalised tokens‖² ∈ [0, 1], and it
   is *similar* when that exceeds ``sim_threshold`` (``None``: similarity off, all similar);
3. block scores = softmax over K blocks of pooled_q · pooled_kᵀ / √D with non-similar K columns
   at −inf; each row is sorted descending and the top blocks whose cumulative mass is
   ≤ ``cdf_threshold`` are kept (the block that crosses the threshold is not; at least one is);
4. non-similar K blocks become full columns, non-similar Q blocks full rows.

Pooling (step 2) is ``sparsp.summaries``': what a rank summarises of its slice and sends.
This module selects blocks from pooled summaries (``select_blocks``) and measures masks
(``density``, ``pattern_shares``).

The split form serves sequence parallelism (paper §4.2): every rank pools its own slice
(``summaries.summarize``: pooled queries, pooled keys and the slice's key sum), the summaries
are all-gathered (``sparsp.plan``), and ``select_blocks`` runs on their concatenation. Pooling
commutes with centring (mean(k − c) = mean(k) − c), so with similarity off the keys are
pooled raw and centred after the gather (``PooledBlocks.centered``) and one collective
suffices; with similarity on, the key mean is all-reduced first. ``split_mask`` computes the
same mask in one process from the whole sequence and its slice lengths — bit-identical to the
distributed one because both run the same arithmetic on the same pooled tensors.
"""

from __future__ import annotations

import torch

from . import cdf_select
from .caches import per_geometry
from .summaries import PooledBlocks, block_sums, check_block, key_sum, pool_blocks
# the summaries' other names, importable from here as they were before they had a module
from .summaries import (SUM_FEATURES, SumsTable, block_lengths, cached_zeros, check_parts,  # noqa: F401
                        fused_sums, summaries_into, summarize)

Threshold = float | torch.Tensor


def split_mask(q: torch.Tensor, k: torch.Tensor, seq_lens, block_size: int, *, cdf_threshold: Threshold,
               sim_threshold: Threshold | None = None) -> torch.Tensor:
    """The block mask a sequence-parallel call uses, computed in one process.

    ``q, k`` (B, S, H, D) hold the whole (placed) sequence, ``seq_lens`` the slice of every rank
    in rank order; every slice is cut into blocks from its own start → bool [B, H, N, N] over
    the slices' blocks. Same arithmetic as the distributed call (``sparsp.plan``), so the same
    bits; with whole-block slices it equals ``block_mask(q, k)`` up to float rounding of the
    key mean.
    """
    bounds = [0]
    for n in seq_lens:
        bounds.append(bounds[-1] + int(n))
    if bounds[-1] != q.shape[1] or q.shape != k.shape:
        raise ValueError(f"seq_lens {list(seq_lens)} must sum to the {q.shape[1]} tokens of q and k "
                         f"(same shape), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    sim = sim_threshold is not None
    slices = list(zip(bounds, bounds[1:]))
    # each slice's key sum as the distributed call makes it: from the slice's block sums
    # without similarity (``summaries.torch_summaries``), over its tokens with it (all-reduced
    # first)
    sums = torch.stack([block_sums(k[:, a:b], block_size).sum(1) if not sim else key_sum(k[:, a:b])
                        for a, b in slices])
    center = sums.sum(0) / bounds[-1]
    pq = PooledBlocks.cat([pool_blocks(q[:, a:b], block_size, similarity=sim) for a, b in slices])
    pk = PooledBlocks.cat([pool_blocks(k[:, a:b], block_size, center=center if sim else None,
                                       similarity=sim) for a, b in slices])
    if not sim:
        pk = pk.centered(center)
    return select_blocks(pq, pk, cdf_threshold=cdf_threshold, sim_threshold=sim_threshold)


_THRESHOLDS = per_geometry("masks: per-head thresholds")


def _per_head(value: Threshold, heads: int, name: str, device, dtype=torch.float64, *,
              trusted: bool = False) -> torch.Tensor:
    """``dtype`` [heads] on ``device``. Checked on the host (the values are host numbers or a
    CPU tensor from ``SparspConfig``) and cached per value and device: no host sync per call.
    ``trusted``: a device tensor of [heads] values checked where they were made (a captured
    plan stage's thresholds input, ``threshold_tensor``), used as it is."""
    if trusted and isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to(dtype)
    src = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float64)
    if src.device.type != "cpu":  # a caller's device tensor: checked where it lives
        t = src.to(device=device, dtype=torch.float64)
        t = t.expand(heads) if t.dim() == 0 else t
        if t.shape != (heads,):
            raise ValueError(f"{name} must be a scalar or a tensor of {heads} per-head values, "
                             f"got shape {tuple(t.shape)}")
        if torch.isnan(t).any() or (t < 0).any() or (t > 1).any():
            raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
        return t.to(dtype)
    values = tuple(float(x) for x in src.double().reshape(-1).tolist())
    if src.dim() == 0:
        values = values * heads
    if len(values) != heads or src.dim() > 1:
        raise ValueError(f"{name} must be a scalar or a tensor of {heads} per-head values, "
                         f"got shape {tuple(src.shape)}")
    if not all(0.0 <= x <= 1.0 for x in values):  # NaN fails too
        raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
    key = (values, str(device), dtype)
    t = _THRESHOLDS.get(key)
    if t is None:
        t = torch.tensor(values, dtype=torch.float64).to(device, dtype)
        _THRESHOLDS[key] = t
    return t


def threshold_tensor(value: Threshold, heads: int, device) -> torch.Tensor:
    """A host threshold (a number or per-head values) as the float32 [heads] device tensor the
    selection reads, checked and made once per value and device."""
    return _per_head(value, heads, "cdf_threshold", device, torch.float32)


def _keeps_all(value: Threshold) -> bool:
    """Whether some head's threshold may be 1 (known on the host for host values; a caller's
    device tensor is not read: assume it may)."""
    if isinstance(value, torch.Tensor):
        return value.device.type != "cpu" or bool((value >= 1.0).any())
    return float(value) >= 1.0


def select_blocks(
    pq: PooledBlocks,
    pk: PooledBlocks,
    *,
    cdf_threshold: Threshold,
    sim_threshold: Threshold | None = None,
    scale: float | None = None,
    trusted: bool = False,
) -> torch.Tensor:
    """Bool mask [B, H, nQ, nK] of the K blocks each pooled Q block keeps. ``trusted``: a
    device ``cdf_threshold`` is used unchecked (``threshold_tensor`` made it)."""
    B, H, _, D = pq.mean.shape
    device = pq.mean.device
    cdf = _per_head(cdf_threshold, H, "cdf_threshold", device, torch.float32, trusted=trusted)
    scale = D**-0.5 if scale is None else scale
    scores = torch.matmul(pq.mean, pk.mean.transpose(-1, -2)).mul_(scale)
    if sim_threshold is not None:
        sim = _per_head(sim_threshold, H, "sim_threshold", device)[None, :, None]
        k_similar = pk.sim.double() > sim  # [B, H, nK]
        q_similar = pq.sim.double() > sim
        scores = scores.masked_fill(~k_similar[:, :, None, :], float("-inf"))
    # float32 throughout: a float64 softmax and sort cost ~2x on the GPU (radix passes), and
    # every rank runs this same arithmetic on the same gathered summaries, so the mask is the
    # same bits everywhere (``split_mask`` runs it too)
    if cdf_select.available(scores):  # on CUDA: softmax and selection in one kernel, no sort
        mask = cdf_select.select(scores, cdf)
    else:
        mask = _select_sorted(scores, cdf, _keeps_all(cdf_threshold), sim_threshold is not None)
    if sim_threshold is not None:
        mask |= ~k_similar[:, :, None, :]
        mask |= ~q_similar[:, :, :, None]
    return mask


def _select_sorted(scores: torch.Tensor, cdf: torch.Tensor, keeps_all: bool, empty_rows: bool) -> torch.Tensor:
    """The selection of ``select_blocks`` with torch ops (the CPU path and the reference of
    ``cdf_select``): softmax, a stable descending sort of every row, the prefix mass."""
    probs = torch.softmax(scores.float(), dim=-1)
    if empty_rows:
        probs.nan_to_num_(0.0)  # a row of all −inf (no similar K block) → 0
    ordered, order = probs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = ordered.cumsum(dim=-1) <= cdf[None, :, None, None]
    keep_sorted[..., 0] = True  # at least one block per row
    if keeps_all:
        # cdf = 1 keeps everything: a cumulative sum can round to 1 + ε before the last block.
        keep_sorted |= (cdf >= 1.0)[None, :, None, None]  # (device ops: no host sync)
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


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
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    center = key_sum(k) / k.shape[1]
    sim = sim_threshold is not None
    pq = pool_blocks(q, block_q, similarity=sim)
    pk = pool_blocks(k, block_k, center=center if sim else None, similarity=sim)
    if not sim:
        pk = pk.centered(center)  # the split form's order of operations (see the module doc)
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


_BIT_WEIGHTS: dict = {}  # device -> uint8 [8]: 1, 2, 4, ... 128


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask [..., n] as uint8 [..., ceil(n / 8)], eight blocks a byte (a kept plan holds
    its mask this way: an eighth of the bool tensor). Device ops only, no host sync."""
    n = mask.shape[-1]
    pad = -n % 8
    if pad:
        mask = torch.nn.functional.pad(mask, (0, pad))
    key = str(mask.device)
    weights = _BIT_WEIGHTS.get(key)
    if weights is None:
        weights = _BIT_WEIGHTS[key] = (2 ** torch.arange(8, dtype=torch.int32)).to(torch.uint8).to(mask.device)
    return (mask.reshape(*mask.shape[:-1], -1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """``pack_bits``' inverse: bool [..., n]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :n].bool()


def _block_centres(geom) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: mean frame index, mean spatial index (h·W + w), and whether it holds video."""
    n, bs = geom.num_blocks, geom.block_size
    idx = torch.arange(n * bs).clamp(max=geom.num_tokens - 1).reshape(n, bs).float()
    vid = idx < geom.video_tokens
    t = torch.where(vid, idx // geom.frame_tokens, torch.zeros_like(idx))
    s = torch.where(vid, idx % geom.frame_tokens, torch.zeros_like(idx))
    cnt = vid.sum(1).clamp(min=1)
    return t.sum(1) / cnt, s.sum(1) / cnt, vid.any(1)


__all__ = ["PATTERNS", "PooledBlocks", "SUM_FEATURES", "SumsTable", "Threshold", "block_lengths", "block_mask", "pack_bits", "threshold_tensor", "unpack_bits",
           "block_sums", "cached_zeros", "check_parts", "density", "fused_sums", "head_density", "key_sum",
           "pattern_shares", "pool_blocks", "select_blocks", "split_mask", "summaries_into", "summarize"]
