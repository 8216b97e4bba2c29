"""Reference block-sparse attention in plain PyTorch (CPU and GPU), with LSE.

It is the ground truth the GPU backends are tested against and the CPU path. It reads both
K/V types (a packed ``KVBuffer`` and a ``LocalKV`` shard) and any block lists: full and short
blocks alike take one slot of a row's list (a short block is padded to ``block_size`` rows and
masked), so a row pays for exactly the blocks it lists. It never builds an ``Sq x Skv`` score
matrix: each query block gathers only the K/V rows of its listed blocks, and query blocks are
processed in chunks whose working set is bounded by ``_CHUNK_ELEMS``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .buffer import KVBuffer, compact_indices
from .local import LocalKV

__all__ = ["block_sparse_attention", "check_inputs", "compact_indices"]

# Elements (fp32) of scores plus gathered K and V per chunk: 2**24 = 64 MiB of scores at
# most, small enough for a laptop, large enough that the Python loop over chunks is short.
_CHUNK_ELEMS = 1 << 24


def check_inputs(q: Tensor, kv: KVBuffer | LocalKV, kv_num_blocks: Tensor, kv_indices: Tensor) -> int:
    """Validate the kernel arguments (shapes only, no device sync); return ``nQ``."""
    if q.dim() != 4:
        raise ValueError(f"q must be (B, H, Sq, D), got shape {tuple(q.shape)}")
    if not isinstance(kv, (KVBuffer, LocalKV)):
        raise ValueError(f"kv must be a KVBuffer or a LocalKV, got {type(kv).__name__}")
    B, H, Sq, D = q.shape
    if kv.head_dim != D:
        raise ValueError(f"head dim of q ({D}) and of the K/V ({kv.head_dim}) differ")
    if isinstance(kv, LocalKV) and (kv.batch, kv.heads) != (B, H):
        raise ValueError(
            f"LocalKV has (batch, heads) = {(kv.batch, kv.heads)} but q has {(B, H)}"
        )
    if q.device != kv.k.device:
        raise ValueError(f"q is on {q.device} but the K/V is on {kv.k.device}")
    if q.dtype != kv.k.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the K/V dtype {kv.k.dtype}")
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


def _block_rows(kv: KVBuffer | LocalKV, head: Tensor, ids: Tensor, used: Tensor):
    """Where each listed block's rows lie in ``kv``'s flat ``[rows, D]`` view.

    ``head``: long ``[R, 1]``, the ``b * H + h`` of each list; ``ids``: long ``[R, K]``.
    Returns ``(first, stride, length)``: block rows are ``first + i * stride`` for
    ``i < length`` (``length`` 0 on unused slots)."""
    bs = kv.block_size
    if isinstance(kv, LocalKV):
        # (B, S, H, D) flattened to (B*S*H, D): token s of head h of batch b is row (b*S+s)*H+h.
        S, H = kv.seq_len, kv.heads
        first = ((head // H) * S + ids * bs) * H + head % H
        length = (S - ids * bs).clamp(min=0, max=bs)
        stride = H
    else:
        safe = ids.clamp(min=0, max=max(kv.num_blocks - 1, 0))
        first, length, stride = kv.block_start[safe], kv.block_len[safe], 1
    return first, stride, torch.where(used, length, torch.zeros_like(length))


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
    kv: KVBuffer | LocalKV,
    kv_num_blocks: Tensor,
    kv_indices: Tensor,
    *,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Block-sparse attention of head-major queries against a packed buffer or a local shard.

    Args:
        q: ``(B, H, Sq, D)``, any strides. Query block ``i`` is rows
            ``[i*bs, min((i+1)*bs, Sq))`` with ``bs = kv.block_size``; ``nQ = ceil(Sq / bs)``.
        kv: a ``KVBuffer`` (ids are buffer block ids) or a ``LocalKV`` (ids are block indices
            within the shard, the same for every head; the last block may be short).
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
    k_flat, v_flat = kv.k.reshape(-1, D), kv.v.reshape(-1, D)  # views (both are contiguous)
    has_blocks = isinstance(kv, LocalKV) or kv.num_blocks > 0
    if slots > 0 and has_blocks:
        # Token rows of every used slot: [rows, K, bs]; padding of short blocks and unused
        # slots point at row 0 and are masked out.
        head = torch.arange(rows, device=q.device).unsqueeze(-1) // n_q
        first, stride, length = _block_rows(kv, head, idx, used)
        offs = torch.arange(bs, device=q.device)
        tok_ok = offs < length.unsqueeze(-1)
        tok = first.unsqueeze(-1) + offs * stride
        tok = torch.where(tok_ok, tok, torch.zeros_like(tok))
        tok, tok_ok = tok.reshape(rows, slots * bs), tok_ok.reshape(rows, slots * bs)

        q_pad = torch.nn.functional.pad(q.reshape(BH, Sq, D), (0, 0, 0, n_q * bs - Sq))
        q_rows = q_pad.reshape(rows, bs, D).float()
        per_row = slots * bs * (bs + 2 * D)  # scores + gathered K and V
        chunk = max(1, _CHUNK_ELEMS // per_row)
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            k_rows = k_flat[tok[r0:r1]].float()
            v_rows = v_flat[tok[r0:r1]].float()
            out[r0:r1], lse[r0:r1] = _attend_chunk(
                q_rows[r0:r1], k_rows, v_rows, tok_ok[r0:r1], scale
            )

    out = out.reshape(B, H, n_q * bs, D)[:, :, :Sq]
    lse = lse.reshape(B, H, n_q * bs)[:, :, :Sq]
    return out.contiguous(), lse.contiguous()
