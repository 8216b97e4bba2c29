"""The metadata row every rank all-gathers at the start of a call: its header and its size.

A row is float32: the header (int32 values bit-cast: the local shape, dtype and block-size
codes, the strategy's code, the NaN/Inf counts of q, k and v), the summaries' length, then the
summaries themselves (``sparsp.summaries``). The plan reads it (``sparsp.plan``), the cost model
counts its bytes (``sparsp.cost``), and the strategy registry names its codes.
"""

from __future__ import annotations

import zlib

import torch

from .summaries import check_parts

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
"""The dtypes the header codes by index (any other is coded 99)."""

HEADER = ("sequence length", "batch", "heads", "head dim", "dtype", "block_size", "strategy")
"""The header's fields that every rank must agree on but the first, in order."""

HEADER_SLOTS = len(HEADER) + 3
"""int32 slots of the header: its fields and the NaN/Inf counts of q, k, v."""

_CODES: dict[int, str] = {}


def strategy_code(name: str) -> int:
    """A stable int per strategy name (the header carries it; crc32 fits in int32)."""
    code = zlib.crc32(name.encode()) & 0x7FFFFFFF
    _CODES[code] = name
    return code


def strategy_of(code: int):
    """The name behind a strategy code seen by :func:`strategy_code`, else the code itself."""
    return _CODES.get(code, code)


def summary_size(B: int, H: int, D: int, n: int, similarity: bool, check: bool, fused: bool = True) -> int:
    """float32 values of a sparse call's summaries for n blocks; ``fused``: as the CUDA kernel
    writes them (v's check in ``summaries.check_parts`` values, not one)."""
    if similarity:
        return 2 * B * H * n * (D + 1) + B * H * D + int(check)
    return 2 * B * n * H * D + (check_parts(B, n, H * D) if fused else 1) * int(check)


__all__ = ["DTYPES", "HEADER", "HEADER_SLOTS", "strategy_code", "strategy_of", "summary_size"]
