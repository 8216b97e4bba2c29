"""The one log-sum-exp merge of partial attention results (online softmax, fp32).

Every strategy computes attention of a query block against several disjoint sets of key
blocks (local shard, each peer's payload, each chunk) and combines the partial results here.
A partial result is ``(out, lse)`` with ``out = softmax(s_part) @ v_part`` and
``lse = logsumexp(s_part)`` over that part's keys. For two parts a, b:

    lse   = log(exp(lse_a) + exp(lse_b))
    out   = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which equals attention over the union of the key sets.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from .._triton import runs, tl, triton

__all__ = ["fold", "merge_final", "merge_into", "merge_pair", "merge_partials", "update_out_and_lse"]


def update_out_and_lse(
    out: Tensor | None, lse: Tensor | None, block_out: Tensor, block_lse: Tensor
) -> tuple[Tensor, Tensor]:
    """Fold one partial result into an fp32 accumulator.

    Args:
        out: ``(B, H, S, D)`` float32 accumulator, or ``None`` on the first call.
        lse: ``(B, H, S)`` float32 accumulator, or ``None`` on the first call.
        block_out: ``(B, H, S, D)`` partial output, any float dtype.
        block_lse: ``(B, H, S)`` natural-log LSE of the part; ``-inf`` where the part had no
            key for that query row (its ``block_out`` row is then ignored).

    Returns:
        New ``(out, lse)`` in float32. A row that is ``-inf`` on both sides stays
        ``lse = -inf`` with ``out = 0``.

    Numerics: subtract ``m = max(lse, block_lse)`` before exponentiating, so one weight is
    exactly 1 and the other is in ``[0, 1]``: the sum lies in ``[1, 2]`` and nothing overflows
    or underflows to a 0/0. When both sides are ``-inf``, ``m`` is replaced by 0 so that
    ``-inf - m`` stays ``-inf`` (never ``-inf - -inf = NaN``); both weights are then 0, the
    sum is 0, ``log(0) = -inf`` is the right LSE, and the division uses 1 instead of 0.
    Accumulating in fp32 keeps bf16 partials from losing precision across many merges
    (ring-flash-attention does the same). On CUDA the arithmetic runs as ``merge_pair``'s one
    Triton pass (the same result up to float rounding); elsewhere as the torch ops below.
    """
    if out is not None and lse is not None and out.dim() == 4 and _triton_ok(out, block_out):
        assert out.shape == block_out.shape and lse.shape == block_lse.shape
        return merge_pair(out, lse, block_out, block_lse)
    block_out = block_out.float()
    block_lse = block_lse.float()
    if out is None or lse is None:
        assert out is None and lse is None, "out and lse must both be None or both be given"
        return block_out.clone(), block_lse.clone()
    assert out.shape == block_out.shape and lse.shape == block_lse.shape
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a = torch.exp(lse - m)
    w_b = torch.exp(block_lse - m)
    total = w_a + w_b
    new_lse = m + torch.log(total)  # log(0) = -inf: both sides empty
    safe = torch.where(total > 0, total, torch.ones_like(total))
    new_out = (out * (w_a / safe).unsqueeze(-1)) + (block_out * (w_b / safe).unsqueeze(-1))
    return new_out, new_lse


def fold(out: Tensor | None, lse: Tensor | None, part_out: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """``part`` folded into ``(out, lse)`` (a kernel's aligned and short-block calls over one
    buffer: ``(BH, S, D)`` / ``(BH, S)``, or with a leading batch of one): the part as given
    when nothing came before.

    On CUDA one Triton pass writes the merge over ``out`` and ``lse`` in place, in ``out``'s
    dtype (the caller casts to the query dtype anyway). The eager form made ~6 fp32 passes over
    the whole output for a second call that touches one block per query row: FA4's packed call
    at Wan 2.1's G = 2 shard took 23.2 / 29.1 / 36.5 ms with it and 21.2 / 26.3 / 33.3 with this
    (cdf 0.85 / 0.9 / 0.95, one H200, ``sparsp bench kernel``). Elsewhere
    ``update_out_and_lse`` (fp32, new tensors)."""
    if out is None or lse is None:
        return part_out, part_lse
    if _triton_ok(out, part_out) and lse.dtype == torch.float32:
        four = [t if t.dim() == d else t[None] for t, d in ((out, 4), (lse, 3), (part_out, 4), (part_lse, 3))]
        merge_into(*four, four[0], four[1])
        return out, lse
    return update_out_and_lse(out, lse, part_out, part_lse)


def merge_partials(parts: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge ``(out, lse)`` partials over disjoint key sets into one fp32 ``(out, lse)``.

    Shapes as in ``update_out_and_lse``. Raises ``ValueError`` when ``parts`` is empty.
    """
    out: Tensor | None = None
    lse: Tensor | None = None
    for part_out, part_lse in parts:
        out, lse = update_out_and_lse(out, lse, part_out, part_lse)
    if out is None or lse is None:
        raise ValueError("merge_partials needs at least one (out, lse) partial, got none")
    return out, lse


def _pair(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    # ``update_out_and_lse``'s arithmetic, written so that a compiler fuses it into one pass
    lse, block_lse = lse.float(), block_lse.float()
    m = torch.maximum(lse, block_lse)
    m = torch.where(torch.isneginf(m), 0.0, m)
    w_a = torch.exp(lse - m)
    w_b = torch.exp(block_lse - m)
    total = w_a + w_b
    inv = 1.0 / torch.where(total > 0, total, 1.0)
    new_out = out.float() * (w_a * inv).unsqueeze(-1) + block_out.float() * (w_b * inv).unsqueeze(-1)
    return new_out, m + torch.log(total)


def _rows(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, row) strides of a (B, H, S[, D]) tensor."""
    return t.stride(0), t.stride(1), t.stride(2)


if triton is not None:
    @triton.jit
    def _merge_rows(a_ptr, la_ptr, b_ptr, lb_ptr, o_ptr, lo_ptr, H, S, D,
                    sa_b, sa_h, sa_s, sla_b, sla_h, sla_s, sb_b, sb_h, sb_s, slb_b, slb_h, slb_s,
                    so_b, so_h, so_s, slo_b, slo_h, slo_s,
                    WRITE_LSE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program: BLOCK_S query rows of one (batch, head), every head-dim column
        bh = tl.program_id(1)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        rows = s < S
        tile = rows[:, None] & (d < D)[None, :]
        la = tl.load(la_ptr + b * sla_b + h * sla_h + s * sla_s, mask=rows, other=float("-inf")).to(tl.float32)
        lb = tl.load(lb_ptr + b * slb_b + h * slb_h + s * slb_s, mask=rows, other=float("-inf")).to(tl.float32)
        m = tl.maximum(la, lb)
        m = tl.where(m == float("-inf"), 0.0, m)
        wa = tl.exp(la - m)
        wb = tl.exp(lb - m)
        total = wa + wb
        inv = 1.0 / tl.where(total > 0, total, 1.0)
        xa = tl.load(a_ptr + b * sa_b + h * sa_h + s[:, None] * sa_s + d[None, :], mask=tile, other=0.0)
        xb = tl.load(b_ptr + b * sb_b + h * sb_h + s[:, None] * sb_s + d[None, :], mask=tile, other=0.0)
        out = xa.to(tl.float32) * (wa * inv)[:, None] + xb.to(tl.float32) * (wb * inv)[:, None]
        tl.store(o_ptr + b * so_b + h * so_h + s[:, None] * so_s + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=tile)
        if WRITE_LSE:
            tl.store(lo_ptr + b * slo_b + h * slo_h + s * slo_s, m + tl.log(total), mask=rows)


def _triton_ok(*ts: Tensor) -> bool:
    """Whether the Triton merge runs on these (B, H, S, D) partials: CUDA, Triton importable,
    head-dim contiguous (any other strides), Triton kernels not switched off (``_triton.runs``).
    (The CPU suite runs ``_launch`` itself in Triton's interpreter.)"""
    return runs(ts[0]) and all(t.stride(-1) == 1 for t in ts)


def _launch(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, dest: Tensor,
            dest_lse: Tensor | None) -> None:
    B, H, S, D = out.shape
    if B * H * S == 0:
        return
    block_d = triton.next_power_of_2(D)
    block_s = max(1, min(64, 8192 // block_d))
    lo = dest_lse if dest_lse is not None else lse  # not written without WRITE_LSE
    grid = (triton.cdiv(S, block_s), B * H)
    _merge_rows[grid](out, lse, block_out, block_lse, dest, lo, H, S, D,
                      *_rows(out), *_rows(lse), *_rows(block_out), *_rows(block_lse),
                      *_rows(dest), *_rows(lo),
                      WRITE_LSE=dest_lse is not None, BLOCK_S=block_s, BLOCK_D=block_d)


def merge_pair(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """``update_out_and_lse`` for two given partials (any float dtypes, any strides but a
    contiguous head dim) → fp32 ``(B, H, S, D)``, ``(B, H, S)``.

    On CUDA one Triton kernel reads both partials once and writes the fp32 result once (the
    eager form makes ~6 passes over the (B, H, S, D) tensors: 3.5 ms per call at HunyuanVideo's
    shard size on an H200). Elsewhere the eager arithmetic (the same up to float rounding)."""
    if not _triton_ok(out, block_out):
        return _pair(out, lse, block_out, block_lse)
    dest = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    dest_lse = torch.empty(lse.shape, dtype=torch.float32, device=out.device)
    _launch(out, lse, block_out, block_lse, dest, dest_lse)
    return dest, dest_lse


def merge_into(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, dest: Tensor,
               dest_lse: Tensor | None = None) -> None:
    """``update_out_and_lse`` written into ``dest`` (B, H, S, D), any dtype and strides (a head
    slice of an accumulator, a transposed view of an output), and its LSE into ``dest_lse``
    when given; in place over ``out`` is allowed. One Triton pass on CUDA, eager elsewhere."""
    if _triton_ok(out, block_out, dest):
        _launch(out, lse, block_out, block_lse, dest, dest_lse)
        return
    new_out, new_lse = _pair(out, lse, block_out, block_lse)
    dest.copy_(new_out)
    if dest_lse is not None:
        dest_lse.copy_(new_lse)


def _final(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, dtype: torch.dtype) -> Tensor:
    return _pair(out, lse, block_out, block_lse)[0].permute(0, 2, 1, 3).to(dtype).contiguous()


def merge_final(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, dtype: torch.dtype) -> Tensor:
    """The last merge of a call, written as the caller's output: ``update_out_and_lse``'s
    output only, token-major (B, S, H, D) in ``dtype``.

    ``merge_pair`` followed by the output's cast and transpose would write the float32 result
    and read it back (at HunyuanVideo's shard, 0.78 GB each way); here the partials are read
    once and the output written once, by ``merge_pair``'s kernel with the output's strides
    (eager elsewhere)."""
    if not _triton_ok(out, block_out):
        return _final(out, lse, block_out, block_lse, dtype)
    B, H, S, D = out.shape
    result = torch.empty(B, S, H, D, dtype=dtype, device=out.device)
    _launch(out, lse, block_out, block_lse, result.permute(0, 2, 1, 3), None)
    return result
