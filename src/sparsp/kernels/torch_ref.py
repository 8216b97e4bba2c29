"""Reference block-sparse attention in plain PyTorch (CPU and GPU), with LSE.

It is the ground truth the flex backend is tested against and the fallback wherever flex
cannot run (CPU, short tail blocks at arbitrary offsets). It never builds an ``Sq x Skv``
score matrix: each query block gathers only the K/V rows of its selected buffer blocks, and
query blocks are processed in chunks whose working set is bounded by ``_CHUNK_ELEMS``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .buffer import KVBuffer

__all__ = ["block_sparse_attention", "check_inputs", "compact_indices"]

# Elements (fp32) of scores plus gathered K and V per chunk: 2**24 = 64 MiB of scores at
# most, small enough for a laptop, large enough that the Python loop over chunks is short.
_CHUNK_ELEMS = 1 << 24


def check_inputs(q: Tensor, kv: KVBuffer, kv_num_blocks: Tensor, kv_indices: Tensor) -> int:
    """Validate the kernel arguments (shapes only, no device sync); return ``nQ``."""
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, Sq, D), got shape {tuple(q.shape)}")
    B, H, Sq, D = q.shape
    if kv.k.shape[1] != D:
        raise ValueError(f"head dim of q ({D}) and of the KV buffer ({kv.k.shape[1]}) differ")
    if q.device != kv.k.device:
        raise ValueError(f"q is on {q.device} but the KV buffer is on {kv.k.device}")
    if q.dtype != kv.k.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the KV buffer dtype {kv.k.dtype}")
    n_q = math.ceil(Sq / kv.block_size)
    if tuple(kv_num_blocks.shape) != (B, H, n_q):
        raise ValueError(
            f"kv_num_blocks must be (B, H, nQ) = {(B, H, n_q)}, got {tuple(kv_num_blocks.shape)}"
        )
    if kv_indices.dim() != 4 or tuple(kv_indices.shape[:3]) != (B, H, n_q):
        raise ValueError(
            f"kv_indices must be (B, H, nQ, K) with (B, H, nQ) = {(B, H, n_q)}, "
            f"got {tuple(kv_indices.shape)}"
        )
    return n_q


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
    k = keep.shape[-1]
    # A stable descending sort of the 0/1 flags puts kept slots first in their original
    # order: a gather by prefix sums without a Python loop and without a host sync.
    order = torch.argsort(keep.to(torch.int32), dim=-1, descending=True, stable=True)
    packed = torch.gather(indices.to(torch.int32), -1, order)
    num = keep.sum(-1, dtype=torch.int32)
    if k >= width:
        packed = packed[..., :width]
    else:
        packed = torch.nn.functional.pad(packed, (0, width - k))
    slot = torch.arange(width, device=keep.device, dtype=torch.int32)
    packed = torch.where(slot < num.unsqueeze(-1), packed, torch.zeros_like(packed))
    return num, packed.contiguous()


def _attend_chunk(
    q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Masked softmax attention for a chunk of query blocks, fp32.

    q: ``[c, bs, D]``; k, v: ``[c, T, D]`` (T = K * bs gathered rows); valid: bool
    ``[c, T]``. Returns out ``[c, bs, D]`` and lse ``[c, bs]``; a row with no valid key gets
    out 0 and lse -inf.
    """
    s = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
    s.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    # An all-masked row has max -inf; shifting by 0 instead keeps exp(-inf) = 0, not NaN.
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp(s.sub_(m))
    denom = p.sum(dim=-1, keepdim=True)
    out = torch.bmm(p, v).div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
    lse = (m + torch.log(denom)).squeeze(-1)
    return out, lse


def block_sparse_attention(
    q: Tensor,
    kv: KVBuffer,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention of head-major queries against a packed KV buffer.

    Args:
        q: ``(B, H, Sq, D)``. Query block ``i`` is rows ``[i*bs, min((i+1)*bs, Sq))`` with
            ``bs = kv.block_size``; ``nQ = ceil(Sq / bs)``.
        kv: the packed K/V (full and short blocks; short ones at any offset).
        kv_num_blocks: int ``[B, H, nQ]``: how many slots of ``kv_indices`` are used.
        kv_indices: int ``[B, H, nQ, K]``: buffer block ids attended by each query block,
            any order, duplicate-free within the used slots; unused slots are ignored.
        scale: softmax scale, default ``1 / sqrt(D)``.

    Returns:
        ``out`` ``(B, H, Sq, D)`` float32 and ``lse`` ``(B, H, Sq)`` float32 (natural log of
        the sum of ``exp(scale * q.k)`` over attended keys). A query row with no selected
        block gets ``out = 0`` and ``lse = -inf``, which the LSE merge treats as empty.
    """
    n_q = check_inputs(q, kv, kv_num_blocks, kv_indices)
    B, H, Sq, D = q.shape
    bs, BH = kv.block_size, B * H
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    rows = BH * n_q
    idx = kv_indices.reshape(rows, -1).to(device=q.device, dtype=torch.long)
    num = kv_num_blocks.reshape(rows, 1).to(device=q.device, dtype=torch.long)
    slots = idx.shape[1]
    used = torch.arange(slots, device=q.device) < num

    if q.device.type == "cpu" and slots > 0:
        # Drop trailing slots no row uses (free on CPU; on GPU it would cost a host sync).
        slots = int(used.any(dim=0).nonzero().max().item()) + 1 if bool(used.any()) else 0
        idx, used = idx[:, :slots], used[:, :slots]

    out = torch.zeros(rows, bs, D, dtype=torch.float32, device=q.device)
    lse = torch.full((rows, bs), float("-inf"), dtype=torch.float32, device=q.device)
    if slots > 0 and kv.num_blocks > 0:
        # Token rows of every used slot: [rows, K, bs]; padding of short blocks and unused
        # slots point at row 0 and are masked out.
        safe_idx = torch.where(used, idx, torch.zeros_like(idx))
        start = kv.block_start[safe_idx]
        length = torch.where(used, kv.block_len[safe_idx], torch.zeros_like(safe_idx))
        offs = torch.arange(bs, device=q.device)
        tok_ok = offs < length.unsqueeze(-1)
        tok = torch.where(tok_ok, start.unsqueeze(-1) + offs, torch.zeros_like(start).unsqueeze(-1))
        tok, tok_ok = tok.reshape(rows, slots * bs), tok_ok.reshape(rows, slots * bs)

        q_pad = torch.nn.functional.pad(q.reshape(BH, Sq, D), (0, 0, 0, n_q * bs - Sq))
        q_rows = q_pad.reshape(rows, bs, D).float()
        per_row = slots * bs * (bs + 2 * D)  # scores + gathered K and V
        chunk = max(1, _CHUNK_ELEMS // per_row)
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            k_rows = kv.k[tok[r0:r1]].float()
            v_rows = kv.v[tok[r0:r1]].float()
            out[r0:r1], lse[r0:r1] = _attend_chunk(
                q_rows[r0:r1], k_rows, v_rows, tok_ok[r0:r1], scale
            )

    out = out.reshape(B, H, n_q * bs, D)[:, :, :Sq]
    lse = lse.reshape(B, H, n_q * bs)[:, :, :Sq]
    return out.contiguous(), lse.contiguous()
