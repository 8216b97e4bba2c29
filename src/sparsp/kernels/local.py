"""``LocalKV``: this rank's own K/V shard as given, read by the kernels in place.

The local shard needs no packing: every one of its blocks is present, so a kernel can read
the ``(B, S, H, D)`` tensors the caller already holds (Diffusers' and FlashAttention's
layout), with one K/V head per query head. That saves the full copy of the local K/V that
packing it into a payload buffer costs on every call, and it is the layout FlashAttention-4
reads fastest (docs/design.md "Kernels and transports": per-head K/V 642 TFLOP/s kept against
523 for one shared K/V head in the same probe).

Blocks are cut from token 0 in ``block_size`` tokens; the last one may be short
(``S % block_size``). A kernel block id is the block's index within ``S`` (the same for every
``(b, h)``), so ``block_ids()`` is what ``kernel_indices`` needs. The short tail is simply the
end of each head's sequence: flex and FlashAttention-4 mask keys past ``S`` themselves, so no
second call is needed (unlike a packed ``KVBuffer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..caches import per_geometry

__all__ = ["LocalKV"]


_BLOCK_IDS = per_geometry("kernels: local block ids")  # key -> Tensor


@dataclass(frozen=True)
class LocalKV:
    """K/V of one shard, ``k, v (B, S, H, D)`` contiguous, cut into ``block_size`` blocks."""

    k: Tensor
    v: Tensor
    block_size: int

    def __post_init__(self) -> None:
        # Shape-only checks (no device sync): they run on every call.
        assert self.k.dim() == 4 and self.k.shape == self.v.shape, (
            f"k and v must both be (B, S, H, D), got {tuple(self.k.shape)} and {tuple(self.v.shape)}"
        )
        assert self.k.dtype == self.v.dtype and self.k.device == self.v.device
        assert self.k.is_contiguous() and self.v.is_contiguous(), "LocalKV needs contiguous k and v"
        assert self.block_size > 0 and self.k.shape[1] > 0

    @property
    def batch(self) -> int:
        return int(self.k.shape[0])

    @property
    def seq_len(self) -> int:
        """``S``, tokens of the shard."""
        return int(self.k.shape[1])

    @property
    def heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3])

    @property
    def num_blocks(self) -> int:
        """``n = ceil(S / block_size)``; block ids run from 0 to ``n - 1``."""
        return math.ceil(self.seq_len / self.block_size)

    @property
    def tail_len(self) -> int:
        """Tokens of the last block (``block_size`` when ``S`` divides evenly)."""
        return self.seq_len - (self.num_blocks - 1) * self.block_size

    def block_ids(self) -> Tensor:
        """Long ``[B*H, n]``: the kernel block id of every block of every ``(b, h)``.

        The argument ``kernel_indices(mask, block_ids, width)`` needs for a mask over this
        shard's blocks: block ``kb`` of any head has id ``kb``."""
        return LocalKV.ids_for(self.num_blocks, self.batch * self.heads, self.k.device)

    @staticmethod
    def ids_for(n: int, bh: int, device) -> Tensor:
        """``block_ids`` of a shard of ``n`` blocks and ``bh`` (batch, head) rows, made once
        per (n, bh, device) and shared (read-only)."""
        key = (n, bh, str(device))
        ids = _BLOCK_IDS.get(key)
        if ids is None:
            ids = torch.arange(n, dtype=torch.long, device=device).repeat(bh, 1)
            _BLOCK_IDS[key] = ids
        return ids
