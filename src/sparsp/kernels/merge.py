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

__all__ = ["fold", "merge_pair", "merge_partials", "update_out_and_lse"]


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
    (ring-flash-attention does the same).
    """
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
    """``part`` folded into ``(out, lse)``: the part as given when nothing came before, else
    ``update_out_and_lse`` (a kernel's aligned and short-block calls over one buffer)."""
    if out is None or lse is None:
        return part_out, part_lse
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


_FUSED: dict[str, object] = {}


def merge_pair(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """``update_out_and_lse`` for two given partials (any float dtypes, any strides) → fp32.

    On CUDA one fused kernel (``torch.compile``, dynamic shapes: one graph for every geometry)
    reads both partials once and writes the fp32 result once — the eager form makes ~6 passes
    over the (B, H, S, D) tensors, 3.5 ms per call at HunyuanVideo's shard size on an H200.
    Elsewhere, or where compiling fails (no Triton), the eager arithmetic (same result up to
    float rounding order)."""
    if out.device.type != "cuda":
        return _pair(out, lse, block_out, block_lse)
    fn = _FUSED.get("pair")
    if fn is None:
        fn = torch.compile(_pair, dynamic=True, fullgraph=True)
        _FUSED["pair"] = fn
    if fn is _pair:
        return _pair(out, lse, block_out, block_lse)
    try:
        return fn(out, lse, block_out, block_lse)
    except Exception as e:  # noqa: BLE001  (a compiler that cannot run here: eager from now on)
        import warnings

        warnings.warn(f"sparsp: the fused LSE merge does not compile here ({type(e).__name__}: {e}); "
                      "merging eagerly", RuntimeWarning, stacklevel=2)
        _FUSED["pair"] = _pair
        return _pair(out, lse, block_out, block_lse)
