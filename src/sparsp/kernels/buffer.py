"""The packed K/V layout every kernel reads: one buffer of token rows for all heads.

Strategies never hand a kernel a dense ``(B, S, H, D)`` key tensor. They hand it a
``KVBuffer``: token rows of the blocks that are present (local shard, or payloads received
from peers), packed one after the other, plus where each block starts and how long it is.
A kernel addresses K/V only through buffer block ids, so the same code serves a dense local
shard and a sparse remote payload.

Canonical order (the packing of every payload, ``sparsp.packing``):

1. all *full* blocks (``block_size`` tokens), row-major over ``(bh, kb)``;
2. then the *short* tail blocks (the last block of a segment whose length is not a multiple
   of ``block_size``), row-major over ``bh``.

Full blocks first keeps them aligned at ``j * block_size``, which is what flex's ``BlockMask``
and FlashAttention-4's block lists address. Short blocks obey two rules that every payload of
``sparsp.packing`` meets (a payload holds blocks of ONE owner's shard): they all have the same
length ``short_len`` (the tail of the owner's shard), and a query row of ``(b, h)`` lists at
most one of them (its own segment's tail). The fast kernels then run them as a second, tiny
block-sparse call over a per-head scratch K/V (``split_lists``) and merge the two by LSE.

The kernels' other K/V type, ``LocalKV`` (``kernels/local.py``), is this rank's own shard as
given, ``(B, S, H, D)``, read in place without packing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import runs, tl, triton
from torch import Tensor

__all__ = ["KVBuffer", "ShortSplit", "canonical_block_ids", "compact_indices", "compact_rows", "kernel_indices",
           "split_lists"]


def packed_result(q: Tensor, out: Tensor | None, lse: Tensor | None) -> tuple[Tensor, Tensor]:
    """A packed-buffer kernel's ``(B·H, Sq, D)`` result in ``q``'s ``(B, H, Sq, D)`` shape and
    dtype, natural-log lse ``(B, H, Sq)``; ``None`` (an empty buffer): zeros and ``-inf``."""
    B, H, Sq, D = q.shape
    if out is None or lse is None:  # an empty buffer: nothing to attend
        return (
            torch.zeros_like(q),
            torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device),
        )
    return out.reshape(B, H, Sq, D).to(q.dtype), lse.reshape(B, H, Sq)


def canonical_block_ids(selected: Tensor, tail: bool) -> Tensor:
    """Buffer block index of every selected ``(bh, kb)`` under the canonical order.

    Args:
        selected: bool ``[..., BH, nK]``; which blocks of each ``bh`` row are packed (leading
            dimensions: independent selections, e.g. a payload's head-group units, each
            numbered on its own).
        tail: column ``nK - 1`` is a short block (segment length not a multiple of the block
            size); short blocks are packed after every full block.

    Returns:
        long ``[..., BH, nK]``: the buffer block index, ``-1`` where not selected.

    Both ends of a transfer call this on the same (exchanged) mask, so they agree on every
    offset without sending metadata (docs/design.md "The mechanism", demand-directed routing:
    offsets from prefix sums). Pure tensor ops, no Python loop over blocks.
    """
    if selected.dim() < 2 or selected.dtype != torch.bool:
        raise ValueError(
            f"selected must be a bool tensor of 2 or more dimensions, got shape "
            f"{tuple(selected.shape)} and dtype {selected.dtype}"
        )
    lead = selected.shape[:-2]
    full = selected.clone()
    if tail and selected.shape[-1] > 0:
        full[..., -1] = False
    # Row-major over (bh, kb) is the flattened order, so an inclusive cumsum minus one is the
    # rank of each selected full block.
    full_rank = torch.cumsum(full.reshape(*lead, -1).long(), -1).reshape(full.shape) - 1
    ids = torch.where(full, full_rank, torch.full_like(full_rank, -1))
    if tail and selected.shape[-1] > 0:
        short = selected[..., -1]
        num_full = full.sum((-2, -1))  # on the device: no host sync on GPU
        if lead:
            num_full = num_full.unsqueeze(-1)
        short_rank = torch.cumsum(short.long(), -1) - 1 + num_full
        ids[..., -1] = torch.where(short, short_rank, torch.full_like(short_rank, -1))
    return ids


@dataclass(frozen=True)
class KVBuffer:
    """K/V token rows for a set of blocks, all heads in one buffer.

    k, v: ``[N, D]`` (same dtype/device). Buffer block ``j`` holds token rows
    ``[block_start[j], block_start[j] + block_len[j])``. ``block_start``/``block_len``:
    LongTensor ``[nb]`` (device of ``k``). The first ``num_aligned`` blocks are full
    (``block_len == block_size``) and aligned (``block_start[j] == j * block_size``); any later
    blocks are short (``0 < len < block_size``), all ``short_len`` rows long, at any offset.

    ``short_len``: the length of the short blocks as a Python int, so that kernels can size
    their scratch without reading the device (``from_payload`` derives it from the row count).
    ``None`` (the default, for buffers built by hand) makes a fast kernel read it from
    ``block_len`` once per call, a host synchronisation on GPU.

    ``N`` may exceed the rows actually used: receive buffers are fixed-capacity slots, and a
    fixed ``N`` keeps kernel shapes static (no recompilation per demand pattern).
    """

    k: Tensor
    v: Tensor
    block_start: Tensor
    block_len: Tensor
    block_size: int
    num_aligned: int
    short_len: int | None = None

    def __post_init__(self) -> None:
        # Shape-only checks: they run on every call and must not sync the GPU.
        assert self.k.dim() == 2 and self.k.shape == self.v.shape, (
            f"k and v must both be [N, D], got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
        )
        assert self.k.dtype == self.v.dtype and self.k.device == self.v.device
        assert self.block_start.shape == self.block_len.shape and self.block_start.dim() == 1
        assert self.block_size > 0
        assert 0 <= self.num_aligned <= self.num_blocks
        assert self.num_aligned * self.block_size <= self.k.shape[0]
        assert self.short_len is None or 0 < self.short_len < self.block_size or (
            self.short_len == 0 and self.num_short == 0
        ), f"short_len must be in (0, block_size), got {self.short_len}"

    @property
    def num_blocks(self) -> int:
        """``nb``, the number of blocks (full and short) in the buffer."""
        return int(self.block_start.shape[0])

    @property
    def num_short(self) -> int:
        """Short blocks in the buffer (they follow the ``num_aligned`` full ones)."""
        return self.num_blocks - self.num_aligned

    @property
    def capacity(self) -> int:
        """``N``, the number of token rows (used or not)."""
        return int(self.k.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[1])

    def tail_length(self) -> int:
        """``short_len``, read from the device when it was not given (a host sync on GPU)."""
        if self.num_short == 0:
            return 0
        if self.short_len is not None:
            return self.short_len
        return int(self.block_len[self.num_aligned].item())

    def validate(self, *, uniform_short: bool = True) -> None:
        """Check the value invariants (syncs with the device; for tests and debugging).

        ``uniform_short=False`` skips the one rule only the fast kernels need (short blocks
        of one length): the torch reference reads any short blocks."""
        bs, na = self.block_size, self.num_aligned
        start, length = self.block_start.cpu(), self.block_len.cpu()
        expect = torch.arange(na, dtype=torch.long) * bs
        if not torch.equal(start[:na], expect) or not bool((length[:na] == bs).all()):
            raise ValueError("the first num_aligned blocks must be full and at j * block_size")
        if not bool(((length[na:] > 0) & (length[na:] < bs)).all()):
            raise ValueError("blocks after num_aligned must be short (0 < len < block_size)")
        if uniform_short and self.num_short and not bool((length[na:] == self.tail_length()).all()):
            raise ValueError("short blocks must all have the same length (short_len)")
        if not bool(((start >= 0) & (start + length <= self.capacity)).all()):
            raise ValueError("a block reaches past the buffer capacity")

    @classmethod
    def from_payload(cls, flat: Tensor, *, rows: int, block_start: Tensor, block_len: Tensor,
                     num_aligned: int, block_size: int, head_dim: int) -> "KVBuffer":
        """View a flat payload buffer (``rows`` K rows, then ``rows`` V rows) as a ``KVBuffer``.

        ``k`` and ``v`` are both viewed at the buffer's full capacity ``flat.numel() // (2·D)``
        rows (rows past the payload are never addressed), so a kernel sees the same shapes on
        every call of a geometry (no recompilation per demand pattern) and both views are
        contiguous. No copy. ``short_len`` follows from the counts without reading the device:
        ``rows = num_aligned · block_size + num_short · short_len``.
        """
        D = head_dim
        cap = flat.numel() // (2 * D)
        k = flat[: cap * D].view(cap, D)
        v = flat[rows * D: (rows + cap) * D].view(cap, D)
        n_short = int(block_start.shape[0]) - num_aligned
        short_rows = rows - num_aligned * block_size
        assert n_short > 0 or short_rows == 0, "rows past the full blocks but no short block"
        short_len = short_rows // n_short if n_short else 0
        assert short_len * n_short == short_rows, "short blocks of different lengths"
        return cls(k, v, block_start, block_len, block_size, num_aligned, short_len)


def compact_indices(keep: Tensor, indices: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Move the kept index slots of each row to the front, keeping their order.

    Args:
        keep: bool ``[..., K]``, which slots of ``indices`` to keep.
        indices: integer ``[..., K]``.
        width: slots in the result; must be at least the number kept in any row (the
            caller guarantees it, e.g. duplicate-free ids drawn from ``width`` blocks).

    Returns:
        ``(num int32 [...], idx int32 [..., width])``; slots past ``num`` are 0, so every
        entry is a valid block id (flex's ``BlockMask`` indexes with all of them).
    """
    if keep.dim() == 4 and _compact_ok(keep):
        return compact_rows(keep, indices.expand(keep.shape), width)
    # Prefix sums give every kept slot its place; a scatter writes it there (the others go to
    # a spare slot past ``width`` that is cut off). No sort, no Python loop, no host sync.
    pos = keep.cumsum(-1) - 1
    target = torch.where(keep, pos, width)
    packed = torch.zeros(*keep.shape[:-1], width + 1, dtype=torch.int32, device=keep.device)
    packed.scatter_(-1, target, indices.to(torch.int32).expand(keep.shape))
    return keep.sum(-1, dtype=torch.int32), packed[..., :width].contiguous()


if triton is not None:
    @triton.jit
    def _compact(keep_ptr, ids_ptr, num_ptr, idx_ptr, H, nQ, n, width,
                 k0, k1, k2, k3, i0, i1, i2, i3, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
        # one program: one (b, h, query block) row; its kept ids to the front, in order
        row = tl.program_id(0).to(tl.int64)
        q = row % nQ
        h = (row // nQ) % H
        b = row // (nQ * H)
        j = tl.arange(0, BLOCK_N)
        inside = j < n
        kept = tl.load(keep_ptr + b * k0 + h * k1 + q * k2 + j * k3, mask=inside, other=0) != 0
        ids = tl.load(ids_ptr + b * i0 + h * i1 + q * i2 + j * i3, mask=inside & kept, other=0)
        pos = tl.cumsum(kept.to(tl.int32), 0) - 1
        count = tl.sum(kept.to(tl.int32), 0)
        tl.store(idx_ptr + row * width + pos, ids.to(tl.int32), mask=kept & (pos < width))
        w = tl.arange(0, BLOCK_W)
        tl.store(idx_ptr + row * width + w, tl.zeros([BLOCK_W], dtype=tl.int32), mask=(w >= count) & (w < width))
        tl.store(num_ptr + row, count)


def _compact_ok(keep: Tensor) -> bool:
    return runs(keep) and 0 < keep.shape[-1] <= 16384


def compact_rows(keep: Tensor, indices: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """``compact_indices`` of a 4-D ``keep`` [B, H, nQ, K] (any strides; ``indices`` the same
    shape, any strides, e.g. an expanded [B, H, 1, K]) as one Triton kernel, one program per
    row: the kept slots' prefix count in registers, their ids stored at it, the rest of the
    row zeroed (the torch form runs a 64-bit prefix sum, a scatter and two copies over the
    whole mask: 0.6 ms per call at HunyuanVideo size on an H200). CUDA; CPU tensors in
    Triton's interpreter."""
    B, H, nQ, n = keep.shape
    num = torch.empty(B, H, nQ, dtype=torch.int32, device=keep.device)
    idx = torch.empty(B, H, nQ, width, dtype=torch.int32, device=keep.device)
    rows = B * H * nQ
    if rows == 0:
        return num, idx
    if keep.dtype == torch.bool:
        keep = keep.view(torch.uint8)
    _compact[(rows,)](keep, indices, num, idx, H, nQ, n, width, *keep.stride(), *indices.stride(),
                      BLOCK_N=triton.next_power_of_2(n), BLOCK_W=triton.next_power_of_2(max(width, 1)))
    return num, idx


def fit_width(idx: Tensor, width: int) -> Tensor:
    """``idx [..., K]`` cut or zero-padded to ``width`` slots (contiguous int32).

    Cutting is safe whenever the used slots (a prefix of each row) fit in ``width``; callers
    pass a width no smaller than any duplicate-free count (e.g. the number of blocks)."""
    idx = idx.to(torch.int32)
    if idx.shape[-1] >= width:
        return idx[..., :width].contiguous()
    return torch.nn.functional.pad(idx, (0, width - idx.shape[-1])).contiguous()


def sorted_lists(kv_num_blocks: Tensor, kv_indices: Tensor, width: int) -> Tensor:
    """The used ids of every list in ascending order, cut or padded to ``width`` (int32).

    FlashAttention-4 masks keys past the sequence end only in the FIRST block it processes,
    which is the LAST id of a list, so a list that may hold the short tail block (the highest
    id) must be ascending. ``kernel_indices`` already gives ascending lists; this makes any
    order safe (one small sort of int32 lists, no host sync)."""
    slots = kv_indices.shape[-1]
    used = torch.arange(slots, device=kv_indices.device) < kv_num_blocks.unsqueeze(-1)
    big = torch.iinfo(torch.int32).max
    keyed = torch.where(used, kv_indices.to(torch.int32), big).sort(dim=-1).values
    return fit_width(torch.where(keyed == big, 0, keyed), width)


@dataclass(frozen=True)
class ShortSplit:
    """A packed buffer's block lists split into full blocks and (at most one) short block.

    ``num``/``idx``: the full (aligned) blocks of every list, int32 ``[B, H, nQ]`` and
    ``[B, H, nQ, width]`` (kept order, unused slots 0). ``has_short``: bool ``[B, H, nQ]``,
    the row lists a short block. ``rows``: long ``[B*H, short_len]``, the buffer rows of the
    short block of each ``(b, h)`` (rows of block 0 where a head lists none: never read,
    since its lists are empty). ``None`` fields when the buffer has no short block.
    """

    num: Tensor
    idx: Tensor
    has_short: Tensor | None
    rows: Tensor | None


def split_lists(kv: KVBuffer, kv_num_blocks: Tensor, kv_indices: Tensor, width: int) -> ShortSplit:
    """Split block lists over a packed buffer into full blocks and one short slot per row.

    The short block of each ``(b, h)`` is found from the lists themselves (a row may list
    only its own segment's tail, so every row of a head names the same one): no Python loop
    and no host synchronisation. On CPU both rules of the module docstring are asserted.
    """
    B, H, n_q, slots = kv_indices.shape
    idx = kv_indices.to(torch.int32)
    num = kv_num_blocks.to(device=idx.device, dtype=torch.int32)
    if kv.num_short == 0:
        return ShortSplit(num, fit_width(idx, width), None, None)
    used = torch.arange(slots, device=idx.device) < num.unsqueeze(-1)
    short = used & (idx >= kv.num_aligned)
    a_num, a_idx = compact_indices(used & ~short, idx, width)
    # One slot per row (the width fix): a row holds at most one short id, so the max over the
    # row's slots is that id, -1 when the row lists none.
    row_short = torch.where(short, idx, -1).amax(dim=-1)  # [B, H, nQ]
    head_short = row_short.amax(dim=-1).reshape(B * H)  # [BH]
    if idx.device.type == "cpu":  # on GPU these checks would cost a host sync per call
        assert bool((short.sum(-1) <= 1).all()), "a query row lists more than one short block"
        same = (row_short < 0) | (row_short == head_short.view(B, H, 1))
        assert bool(same.all()), "the rows of one head list different short blocks"
    length = kv.tail_length()
    start = kv.block_start[head_short.clamp(min=0).long()]  # [BH]
    rows = start.unsqueeze(-1) + torch.arange(length, device=start.device)
    rows = rows.clamp(max=kv.capacity - 1)
    return ShortSplit(a_num, a_idx, row_short >= 0, rows)


def kernel_indices(mask: Tensor, block_ids: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Block lists for a kernel from a block mask over one shard's blocks.

    Args:
        mask: bool ``[B, H, nQ, n]``, the query blocks' selection over the shard's ``n`` blocks.
        block_ids: long ``[B*H, n]``, the buffer block id of every block of the shard (``-1``
            where the block is not in the buffer; ``canonical_block_ids``).
        width: slots per list, fixed per geometry so compiled kernels see static shapes.

    Returns:
        ``(kv_num_blocks int32 [B, H, nQ], kv_indices int32 [B, H, nQ, width])``: ids sorted
        ascending, unused slots 0. No host synchronisation on GPU.
    """
    B, H, nQ, n = mask.shape
    ids = block_ids.view(B, H, 1, n).to(mask.device)
    if mask.device.type == "cpu":  # on GPU these checks would cost a host sync per call
        assert not (mask & (ids < 0)).any(), "a kept block is missing from the buffer"
        kept = torch.where(mask, ids, -1)
        running = kept.cummax(-1).values
        assert bool(((kept < 0) | (kept >= running)).all()), "buffer ids must ascend along a shard"
    # Buffer ids ascend with the block index inside every (b, h) (canonical order: full blocks
    # row-major, the short tail block — the last index — after all of them; LocalKV: the index
    # itself), so compacting the kept blocks in index order lists them ascending.
    return compact_indices(mask, ids, width)
