"""The packed K/V layout every kernel reads: one buffer of token rows for all heads.

Strategies never hand a kernel a dense ``(B, S, H, D)`` key tensor. They hand it a
``KVBuffer``: token rows of the blocks that are present (local shard, or payloads received
from peers), packed one after the other, plus where each block starts and how long it is.
A kernel addresses K/V only through buffer block ids, so the same code serves a dense local
shard and a sparse remote payload.

Canonical order (shared by ``from_dense`` and the packing of remote payloads):

1. all *full* blocks (``block_size`` tokens), row-major over ``(bh, kb)``;
2. then the *short* tail blocks (the last block of a segment whose length is not a multiple
   of ``block_size``), row-major over ``bh``.

Full blocks first keeps them aligned at ``j * block_size``, which is what the flex backend
needs to address them through a ``BlockMask``; short blocks are handled by the torch backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["KVBuffer", "canonical_block_ids"]


def canonical_block_ids(selected: Tensor, tail: bool) -> Tensor:
    """Buffer block index of every selected ``(bh, kb)`` under the canonical order.

    Args:
        selected: bool ``[BH, nK]``; which blocks of each ``bh`` row are packed.
        tail: column ``nK - 1`` is a short block (segment length not a multiple of the block
            size); short blocks are packed after every full block.

    Returns:
        long ``[BH, nK]``: the buffer block index, ``-1`` where not selected.

    Both ends of a transfer call this on the same (exchanged) mask, so they agree on every
    offset without sending metadata (DESIGN "demand-directed routing": offsets from prefix
    sums). Pure tensor ops, no Python loop over blocks.
    """
    if selected.dim() != 2 or selected.dtype != torch.bool:
        raise ValueError(
            f"selected must be a 2-D bool tensor, got shape {tuple(selected.shape)} "
            f"and dtype {selected.dtype}"
        )
    full = selected.clone()
    if tail and selected.shape[1] > 0:
        full[:, -1] = False
    # Row-major over (bh, kb) is the flattened order, so an inclusive cumsum minus one is the
    # rank of each selected full block.
    full_rank = torch.cumsum(full.reshape(-1).long(), 0).reshape(full.shape) - 1
    ids = torch.where(full, full_rank, torch.full_like(full_rank, -1))
    if tail and selected.shape[1] > 0:
        short = selected[:, -1]
        num_full = full.sum()  # a 0-dim tensor: no host sync on GPU
        short_rank = torch.cumsum(short.long(), 0) - 1 + num_full
        ids[:, -1] = torch.where(short, short_rank, torch.full_like(short_rank, -1))
    return ids


@dataclass(frozen=True)
class KVBuffer:
    """K/V token rows for a set of blocks, all heads in one buffer.

    k, v: ``[N, D]`` (same dtype/device). Buffer block ``j`` holds token rows
    ``[block_start[j], block_start[j] + block_len[j])``. ``block_start``/``block_len``:
    LongTensor ``[nb]`` (device of ``k``). Invariant used by the flex backend: the first
    ``num_aligned`` blocks are full (``block_len == block_size``) and aligned
    (``block_start[j] == j * block_size``); any later blocks are short (tail blocks of
    ``< block_size`` tokens) and may sit at any offset.

    ``N`` may exceed the rows actually used: receive buffers are fixed-capacity slots, and a
    fixed ``N`` keeps kernel shapes static (no recompilation per demand pattern).
    """

    k: Tensor
    v: Tensor
    block_start: Tensor
    block_len: Tensor
    block_size: int
    num_aligned: int

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

    @property
    def num_blocks(self) -> int:
        """``nb``, the number of blocks (full and short) in the buffer."""
        return int(self.block_start.shape[0])

    @property
    def capacity(self) -> int:
        """``N``, the number of token rows (used or not)."""
        return int(self.k.shape[0])

    def validate(self) -> None:
        """Check the value invariants (syncs with the device; for tests and debugging)."""
        bs, na = self.block_size, self.num_aligned
        start, length = self.block_start.cpu(), self.block_len.cpu()
        expect = torch.arange(na, dtype=torch.long) * bs
        if not torch.equal(start[:na], expect) or not bool((length[:na] == bs).all()):
            raise ValueError("the first num_aligned blocks must be full and at j * block_size")
        if not bool(((length[na:] > 0) & (length[na:] < bs)).all()):
            raise ValueError("blocks after num_aligned must be short (0 < len < block_size)")
        if not bool(((start >= 0) & (start + length <= self.capacity)).all()):
            raise ValueError("a block reaches past the buffer capacity")

    @classmethod
    def from_dense(cls, k: Tensor, v: Tensor, block_size: int) -> tuple[KVBuffer, Tensor]:
        """Pack dense ``k, v`` of shape ``(B, S, H, D)`` in the canonical order.

        Returns:
            ``(kv, block_id)``: ``kv`` holds every block of every ``(b, h)`` segment;
            ``block_id`` is long ``[B*H, nK]`` with ``block_id[b*H + h, kb]`` the buffer
            block of key block ``kb`` of ``(b, h)``, ``nK = ceil(S / block_size)``.
            Use it to translate a ``[B, H, nQ, nK]`` block mask into buffer indices.
        """
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(
                f"k and v must be (B, S, H, D) of equal shape, got {tuple(k.shape)} and "
                f"{tuple(v.shape)}"
            )
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        B, S, H, D = k.shape
        BH, bs = B * H, block_size
        n_full, tail_len = divmod(S, bs)
        n_k = n_full + (tail_len > 0)
        device = k.device

        def pack(x: Tensor) -> Tensor:
            # (B, S, H, D) -> (B, H, S, D): each (b, h) segment becomes contiguous, so full
            # blocks flatten in row-major (b, h, block) order and tails in (b, h) order.
            seg = x.permute(0, 2, 1, 3)
            full = seg[:, :, : n_full * bs].reshape(BH * n_full * bs, D)
            tails = seg[:, :, n_full * bs :].reshape(BH * tail_len, D)
            return torch.cat([full, tails], dim=0)

        num_aligned = BH * n_full
        start_full = torch.arange(num_aligned, dtype=torch.long, device=device) * bs
        start_tail = num_aligned * bs + torch.arange(
            BH if tail_len else 0, dtype=torch.long, device=device
        ) * tail_len
        block_start = torch.cat([start_full, start_tail])
        block_len = torch.cat(
            [
                torch.full((num_aligned,), bs, dtype=torch.long, device=device),
                torch.full((start_tail.numel(),), tail_len, dtype=torch.long, device=device),
            ]
        )
        kv = cls(pack(k), pack(v), block_start, block_len, bs, num_aligned)
        selected = torch.ones(BH, n_k, dtype=torch.bool, device=device)
        return kv, canonical_block_ids(selected, tail=tail_len > 0)
