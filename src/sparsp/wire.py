"""The metadata row every rank all-gathers at the start of a call: its header and its size.

A row is float32: the header (int32 values bit-cast: the local shape, dtype and block-size
codes, the strategy's code, the NaN/Inf counts of q, k and v), the summaries' length, then the
summaries themselves (``sparsp.summaries``). The header is made (``header``), read back from
the gathered rows (``table_of``) and checked (``check_table``) here; the plan gathers and reads
the rows (``sparsp.plan``), the cost model counts their bytes (``sparsp.cost``), and the
strategy registry names the strategy codes.
"""

from __future__ import annotations

import zlib

import torch

from .caches import per_geometry
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


_HEADERS = per_geometry("wire: metadata headers")  # (fields, device) -> float32 header


def header(q: torch.Tensor, block_size: int, strategy: str, size: int) -> torch.Tensor:
    """float32 [HEADER_SLOTS + 1] on q's device: the int32 header (q's local shape, the dtype's
    code, ``block_size``, the strategy's code, three zero slots for the non-finite flags
    ``table_of`` fills on the receiving side, and ``size``, the summaries' length) bit-cast to
    float32, made once per geometry (a pageable host-to-device copy would sync the stream; a
    cached one costs no op per call)."""
    B, S, H, D = q.shape
    fields = (S, B, H, D, DTYPES.index(q.dtype) if q.dtype in DTYPES else 99, block_size,
              strategy_code(strategy), 0, 0, 0, size)
    key = (fields, str(q.device))
    t = _HEADERS.get(key)
    if t is None:
        t = _HEADERS[key] = torch.tensor(fields, dtype=torch.int32).view(torch.float32).to(q.device)
    return t


def table_of(rows: torch.Tensor, check: bool = True) -> torch.Tensor:
    """int64 [G, HEADER_SLOTS + 1]: the headers in the gathered rows (bit-cast back). With
    ``check`` (``SparspConfig.check_finite``), a rank's first non-finite flag is set when its
    summaries hold a NaN or Inf (``summaries.torch_summaries``: then one of its q, k, v does, or a sum
    overflowed); ``check_table`` then asks for the exact counts."""
    table = rows[:, : HEADER_SLOTS + 1].contiguous().view(torch.int32).long()
    if check:
        table[:, len(HEADER)] = torch.isfinite(rows[:, HEADER_SLOTS + 1:]).all(1).logical_not()
    return table


def check_table(table: torch.Tensor, world: int, counts=None) -> None:
    """Raise the same ``ValueError`` on every rank for a bad header table [G, HEADER_SLOTS].
    ``counts()`` gives the exact NaN/Inf counts [G, 3] when a rank flagged any (a collective
    that every rank enters, since every rank reads the same flags: ``plan.count_nonfinite``)."""
    rows = table.tolist()  # plain Python from here: a few dozen small tensor ops cost more
    for col in range(1, len(HEADER)):
        values = [r[col] for r in rows]
        if any(x != values[0] for x in values):
            if HEADER[col] == "strategy":
                values = [strategy_of(v) for v in values]
            raise ValueError(f"ranks disagree on {HEADER[col]}: {values} (rank order)")
    if any(r[0] < 1 for r in rows):
        raise ValueError(f"every rank needs at least one token; sequence lengths {[r[0] for r in rows]}")
    nonfinite = [r[len(HEADER):HEADER_SLOTS] for r in rows]
    if any(any(f) for f in nonfinite):
        if counts is not None:
            nonfinite = counts().tolist()
        found = [f"rank {r}: {name} has {int(n)} NaN/Inf value{'s' if n > 1 else ''}"
                 for r in range(world) for name, n in zip("qkv", nonfinite[r]) if n]
        if found:  # (a float32 overflow of a probe sum with no NaN/Inf value is no error)
            raise ValueError("non-finite inputs (" + "; ".join(found) + "); sp_attention needs finite "
                             "q, k, v (SparspConfig(check_finite=False) skips this check)")


__all__ = ["DTYPES", "HEADER", "HEADER_SLOTS", "check_table", "header", "strategy_code", "strategy_of",
           "summary_size", "table_of"]
