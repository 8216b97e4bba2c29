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

The split form serves sequence parallelism (paper §4.2): every rank pools its own slice
(``summarize``: pooled queries, pooled keys and the slice's key sum), the summaries are
all-gathered (``sparsp.plan``), and ``select_blocks`` runs on their concatenation. Pooling
commutes with centring (mean(k − c) = mean(k) − c), so with similarity off the keys are
pooled raw and centred after the gather (``PooledBlocks.centered``) and one collective
suffices; with similarity on, the key mean is all-reduced first. ``split_mask`` computes the
same mask in one process from the whole sequence and its slice lengths — bit-identical to the
distributed one because both run the same arithmetic on the same pooled tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import cdf_select
from ._triton import runs, tl, triton

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

    def centered(self, center: torch.Tensor) -> "PooledBlocks":
        """Means minus ``center`` [B, H, D] (key smoothing after pooling; ``sim`` unchanged,
        so only for summaries pooled without similarity)."""
        return PooledBlocks(self.mean - center.float()[:, :, None, :], self.sim, self.lengths)

    @staticmethod
    def from_sums(sums: torch.Tensor, S: int, block_size: int) -> "PooledBlocks":
        """Summaries of a slice of ``S`` tokens from its block sums (``block_sums``, float32
        (B, n, H, D)): the means divided by each block's real length, similarity off (zero).
        The same arithmetic as ``pool_blocks`` without similarity, so the same bits."""
        lengths, denom = block_lengths(S, block_size, sums.device)
        mean = sums.permute(0, 2, 1, 3) / denom
        return PooledBlocks(mean, cached_zeros(mean.shape[:-1], mean.device), lengths)

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
    return k.sum(dim=1, dtype=torch.float32)


def pool_blocks(x: torch.Tensor, block_size: int, center: torch.Tensor | None = None, *,
                similarity: bool = True) -> PooledBlocks:
    """Pool ``x`` (B, S, H, D) into blocks of ``block_size`` tokens; ``center`` (B, H, D) is
    subtracted from every token first (key smoothing). ``similarity=False`` skips the block
    self-similarity (a pass over normalised tokens) and leaves ``sim`` zero."""
    if x.dim() != 4:
        raise ValueError(f"expected (B, S, H, D), got shape {tuple(x.shape)}")
    _check_block("block_size", block_size)
    B, S, H, D = x.shape
    if center is None and not similarity:  # the common case
        return PooledBlocks.from_sums(block_sums(x, block_size), S, block_size)
    n = math.ceil(S / block_size)
    pad = n * block_size - S
    lengths, denom = block_lengths(S, block_size, x.device)
    xf = x.float().permute(0, 2, 1, 3)  # (B, H, S, D)
    if center is not None:
        xf = xf - center.float()[:, :, None, :]
    if pad:
        # Zero padding adds nothing to sums; dividing by the real length gives the mean.
        xf = torch.nn.functional.pad(xf, (0, 0, 0, pad))
    blocks = xf.reshape(B, H, n, block_size, D)
    mean = blocks.sum(dim=3) / denom
    if similarity:
        unit = torch.nn.functional.normalize(blocks, dim=-1)  # zero rows stay zero
        sim = (unit.sum(dim=3) / denom).square().sum(dim=-1)
    else:
        sim = cached_zeros(mean.shape[:-1], mean.device)
    return PooledBlocks(mean, sim, lengths)


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 (B, n, H, D): the sum of each block's tokens of ``x`` (B, S, H, D), straight from
    x's own layout and accumulated in float32, without a float32 copy of x (a full-size
    tensor per call at video sizes); a short last block sums its real tokens. Token-major, as
    x is: what a rank sends in the metadata all-gather (``sparsp.plan``), which divides by the
    block lengths only after the gather (``PooledBlocks.from_sums``). On CUDA the summing
    kernel of ``summaries_into`` makes them, so every caller (``pool_blocks``, ``split_mask``,
    the plan) gets the same bits."""
    B, S, H, D = x.shape
    if fused_sums(x):
        out = torch.empty(B, math.ceil(S / block_size), H, D, dtype=torch.float32, device=x.device)
        summaries_into(out.view(-1), block_size, x)
        return out
    full = (S // block_size) * block_size
    sums = x[:, :full].reshape(B, S // block_size, block_size, H, D).sum(2, dtype=torch.float32)
    if full < S:
        sums = torch.cat([sums, x[:, full:].sum(1, keepdim=True, dtype=torch.float32)], 1)
    return sums


SUM_FEATURES = 256
"""Features (of a token's H·D) one program of the summing kernel sums; v's check writes one
partial sum per (batch, block, feature chunk)."""


def fused_sums(*xs: torch.Tensor | None) -> bool:
    """Whether ``summaries_into``'s kernel sums these (B, S, H, D) tensors: Triton on CUDA, the
    switch ``SPARSP_TRITON_SUMS`` on, and each token's H·D features contiguous (batch and
    sequence strides are free: q, k, v cut from one fused projection qualify)."""
    given = [x for x in xs if x is not None]
    return runs(given[0], "SPARSP_TRITON_SUMS") and all(
        x.device == given[0].device and x.stride(3) == 1 and x.stride(2) == x.shape[3] for x in given)


def check_parts(B: int, n: int, features: int) -> int:
    """Values ``summaries_into`` writes for v's non-finite check (one per program)."""
    return B * n * -(-features // SUM_FEATURES)


if triton is not None:
    @triton.jit
    def _sums(a_ptr, b_ptr, c_ptr, out_ptr, tab_ptr, S, n, F, plane, a_b, a_s, b_b, b_s, c_b, c_s,
              BS: tl.constexpr, TOK: tl.constexpr, FCH: tl.constexpr, HAS_B: tl.constexpr,
              HAS_C: tl.constexpr, OFFSETS: tl.constexpr, ALIGN: tl.constexpr):
        # one program (one warp): one block of one batch element, FCH features; a's and b's
        # sums per feature, c's one partial sum. Each step loads a TOK-token tile of every
        # tensor (all in flight at once); each thread holds every row of its columns, so the
        # sum over the tile's rows stays in registers. A tensor's sum is the same sequence of
        # adds whatever else is summed beside it, so a tensor summed alone (``block_sums``)
        # gets the bits it gets in the metadata row.
        # OFFSETS: a, b and c lie at the one pointer passed plus the element offsets in
        # ``tab_ptr`` (int64 [3], whole multiples of ALIGN elements: 16 bytes), read on the
        # device, so that a CUDA graph replays this launch for new tensors (``GraphedSums``)
        if OFFSETS:
            a_ptr += tl.multiple_of(tl.load(tab_ptr), ALIGN)
            b_ptr += tl.multiple_of(tl.load(tab_ptr + 1), ALIGN)
            c_ptr += tl.multiple_of(tl.load(tab_ptr + 2), ALIGN)
        row = tl.program_id(0)
        fc = tl.program_id(1)
        bi = (row // n).to(tl.int64)
        f = fc * FCH + tl.arange(0, FCH)
        live_f = f < F
        first = (row % n) * BS
        acc_a = tl.zeros([FCH], dtype=tl.float32)
        acc_b = tl.zeros([FCH], dtype=tl.float32)
        acc_c = tl.zeros([FCH], dtype=tl.float32)
        for t in range(0, BS, TOK):
            within = t + tl.arange(0, TOK)
            s = first + within
            m = ((within < BS) & (s < S))[:, None] & live_f[None, :]
            s = s.to(tl.int64)[:, None]
            xa = tl.load(a_ptr + bi * a_b + s * a_s + f[None, :], mask=m, other=0.0)
            if HAS_B:
                xb = tl.load(b_ptr + bi * b_b + s * b_s + f[None, :], mask=m, other=0.0)
                acc_b += tl.sum(xb.to(tl.float32), 0)
            if HAS_C:
                xc = tl.load(c_ptr + bi * c_b + s * c_s + f[None, :], mask=m, other=0.0)
                acc_c += tl.sum(xc.to(tl.float32), 0)
            acc_a += tl.sum(xa.to(tl.float32), 0)
        at = row.to(tl.int64) * F + f
        tl.store(out_ptr + at, acc_a, mask=live_f)
        if HAS_B:
            tl.store(out_ptr + plane + at, acc_b, mask=live_f)
        if HAS_C:
            tl.store(out_ptr + 2 * plane + row * tl.num_programs(1) + fc, tl.sum(acc_c, 0))


def summaries_into(out: torch.Tensor, block_size: int, a: torch.Tensor, b: torch.Tensor | None = None,
                   c: torch.Tensor | None = None, *, table: "SumsTable | None" = None) -> None:
    """One kernel over (B, S, H, D) tensors of one shape: ``out`` (float32, flat) = a's block
    sums (B, n, H, D), then b's, then ``check_parts`` partial sums of c (the metadata row's
    summaries: q, k and v's non-finite check, ``sparsp.plan``). A short last block sums its
    real tokens. CUDA (``fused_sums``); on CPU tensors in Triton's interpreter. ``table``: the
    kernel reads a, b and c where ``table``'s device offsets say (``SumsTable``: a CUDA graph of
    this launch sums new tensors of the same shape and strides); a, b, c give only their
    shapes and strides then."""
    B, S, H, D = a.shape
    n, F = math.ceil(S / block_size), H * D
    plane = B * n * F
    need = plane * (1 + (b is not None)) + (check_parts(B, n, F) if c is not None else 0)
    if out.numel() != need or out.dtype != torch.float32:
        raise ValueError(f"summaries_into needs a float32 output of {need} values, got {out.numel()} "
                         f"{out.dtype}")
    if c is not None and b is None:
        raise ValueError("summaries_into: c (the check's tensor) comes with b")
    for x in (b, c):
        if x is not None and x.shape != a.shape:
            raise ValueError(f"summaries_into: shapes differ, {tuple(a.shape)} and {tuple(x.shape)}")
    bb, cc = (b if b is not None else a), (c if c is not None else a)
    tok = min(16, triton.next_power_of_2(block_size))
    pa, pb, pc = (a, bb, cc) if table is None else (table.base,) * 3
    _sums[(B * n, triton.cdiv(F, SUM_FEATURES))](
        pa, pb, pc, out, out if table is None else table.device, S, n, F, plane, a.stride(0), a.stride(1),
        bb.stride(0), bb.stride(1), cc.stride(0), cc.stride(1), BS=block_size, TOK=tok, FCH=SUM_FEATURES,
        HAS_B=b is not None, HAS_C=c is not None, OFFSETS=table is not None,
        ALIGN=max(1, SumsTable.ALIGN_BYTES // a.element_size()), num_warps=1)


class SumsTable:
    """Where ``summaries_into`` finds its inputs when a CUDA graph replays it: element offsets
    of a, b and c from one fixed ``base`` allocation of their dtype, written on the host into
    pinned memory (``set``) and copied to the device by the graph itself (``upload``, captured
    as the graph's first node: a replay reads what the host wrote last). Offsets are whole
    multiples of 16 bytes (``fits``), so the kernel's loads stay vectorised.

    The host may rewrite the table only once the device has run the previous replay's copy:
    the metadata step's caller reads the device back (the call's one host read) before its next
    call, which orders them."""

    ALIGN_BYTES = 16

    def __init__(self, dtype: torch.dtype, device) -> None:
        self.base = torch.empty(self.ALIGN_BYTES, dtype=dtype, device=device)
        self.host = torch.zeros(3, dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")
        self.device = torch.zeros(3, dtype=torch.int64, device=device)
        self._values = self.host.numpy()
        self._origin, self._size = self.base.data_ptr(), self.base.element_size()

    def fits(self, *xs: torch.Tensor) -> bool:
        """Whether every tensor is of the base's dtype and device and 16-byte aligned."""
        return all(x.dtype == self.base.dtype and x.device == self.base.device for x in xs) and \
            self.aligned(*xs)

    @classmethod
    def aligned(cls, *xs: torch.Tensor | None) -> bool:
        """Whether every tensor given starts on the 16-byte grid the kernel's offsets assume."""
        return all(x.data_ptr() % cls.ALIGN_BYTES == 0 for x in xs if x is not None)

    def set(self, a: torch.Tensor, b: torch.Tensor | None = None, c: torch.Tensor | None = None) -> None:
        """Write the offsets of a, b, c (a stands in for a missing one) on the host."""
        o, size = self._origin, self._size
        pa = a.data_ptr()
        self._values[0] = (pa - o) // size
        self._values[1] = ((b.data_ptr() if b is not None else pa) - o) // size
        self._values[2] = ((c.data_ptr() if c is not None else pa) - o) // size

    def upload(self) -> None:
        """Queue the table's copy to the device on the current stream (a graph node when captured)."""
        self.device.copy_(self.host, non_blocking=True)


_CACHE: dict[tuple, object] = {}


def block_lengths(S: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Real tokens per block of a slice of ``S`` tokens: long [n] and float32 [1, 1, n, 1]
    (the pooling's divisor), on ``device``, made once per (S, block_size, device): a pageable
    host-to-device copy syncs the stream, and the per-call ops count (read-only, shared)."""
    key = ("lengths", S, block_size, str(device))
    got = _CACHE.get(key)
    if got is None:
        n = math.ceil(S / block_size)
        lengths = torch.full((n,), block_size, dtype=torch.long)
        lengths[-1] = S - (n - 1) * block_size
        got = (lengths.to(device), lengths.to(device, torch.float32)[None, None, :, None])
        _CACHE[key] = got
    return got


def cached_zeros(shape, device) -> torch.Tensor:
    """float32 zeros of ``shape`` on ``device``, made once per shape (read-only, shared): the
    ``sim`` of summaries pooled without similarity, the padding of the metadata row."""
    key = ("zeros", tuple(shape), str(device))
    got = _CACHE.get(key)
    if got is None:
        got = _CACHE[key] = torch.zeros(shape, dtype=torch.float32, device=device)
    return got


def summarize(q: torch.Tensor, k: torch.Tensor, block_size: int, *, center: torch.Tensor | None = None,
              similarity: bool = False) -> tuple[PooledBlocks, PooledBlocks, torch.Tensor]:
    """One slice's share of the split form: pooled queries, pooled keys and the key sum.

    Keys are pooled raw (``center=None``; centre them after the gather with
    ``PooledBlocks.centered``) or, when the similarity needs smoothed keys, around ``center``.
    """
    pq = pool_blocks(q, block_size, similarity=similarity)
    pk = pool_blocks(k, block_size, center=center, similarity=similarity)
    return pq, pk, key_sum(k)


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
    # without similarity (``plan._summaries``), over its tokens with it (all-reduced first)
    sums = torch.stack([block_sums(k[:, a:b], block_size).sum(1) if not sim else key_sum(k[:, a:b])
                        for a, b in slices])
    center = sums.sum(0) / bounds[-1]
    pq = PooledBlocks.cat([pool_blocks(q[:, a:b], block_size, similarity=sim) for a, b in slices])
    pk = PooledBlocks.cat([pool_blocks(k[:, a:b], block_size, center=center if sim else None,
                                       similarity=sim) for a, b in slices])
    if not sim:
        pk = pk.centered(center)
    return select_blocks(pq, pk, cdf_threshold=cdf_threshold, sim_threshold=sim_threshold)


def _check_block(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int (tokens per block), got {value!r}")


_THRESHOLDS: dict[tuple, torch.Tensor] = {}


def _per_head(value: Threshold, heads: int, name: str, device, dtype=torch.float64) -> torch.Tensor:
    """``dtype`` [heads] on ``device``. Checked on the host (the values are host numbers or a
    CPU tensor from ``SparspConfig``) and cached per value and device: no host sync per call."""
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
) -> torch.Tensor:
    """Bool mask [B, H, nQ, nK] of the K blocks each pooled Q block keeps."""
    B, H, _, D = pq.mean.shape
    device = pq.mean.device
    cdf = _per_head(cdf_threshold, H, "cdf_threshold", device, torch.float32)
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
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
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


def _block_centres(geom) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block: mean frame index, mean spatial index (h·W + w), and whether it holds video."""
    n, bs = geom.num_blocks, geom.block_size
    idx = torch.arange(n * bs).clamp(max=geom.num_tokens - 1).reshape(n, bs).float()
    vid = idx < geom.video_tokens
    t = torch.where(vid, idx // geom.frame_tokens, torch.zeros_like(idx))
    s = torch.where(vid, idx % geom.frame_tokens, torch.zeros_like(idx))
    cnt = vid.sum(1).clamp(min=1)
    return t.sum(1) / cnt, s.sum(1) / cnt, vid.any(1)
