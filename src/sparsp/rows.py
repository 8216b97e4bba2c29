"""Row gathers that move bytes unchanged, in the widest element that tiles a row.

``index_select`` on a bf16 tensor copies 2 bytes per thread and computes an offset for each;
the rows sparsp gathers (one head of one token: 128 or 256 bytes of K or V; a token of hidden
states) are whole multiples of 16 bytes, so viewed as ``complex128`` the same gather copies 16
bytes per element, eight times fewer. The copy is bitwise (no arithmetic touches the values),
so the result is identical whatever the view; rows or pointers that do not divide by a wider
element fall back to the tensor's own dtype.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gather_rows"]

_WIDE = (torch.complex128, torch.int64, torch.int32)  # 16, 8, 4 bytes


def _width(*ts: torch.Tensor) -> torch.dtype | None:
    """The widest dtype that tiles the last dim of every ``t`` and its pointer, or None."""
    size = ts[0].element_size()
    if any(t.numel() == 0 for t in ts):
        return None
    for dt in _WIDE:
        w = dt.itemsize
        if w <= size:
            return None
        if all(t.shape[-1] * size % w == 0 and t.data_ptr() % w == 0 for t in ts):
            return dt
    return None


def gather_rows(x: torch.Tensor, index: torch.Tensor, dim: int = 0,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.index_select(dim, index)`` (written into ``out`` when given, which is returned),
    through the widest element view that tiles the bytes after ``dim``."""
    dim = dim % x.dim()
    if x.is_contiguous() and (out is None or out.is_contiguous()):
        row = math.prod(x.shape[dim + 1:])
        src = x.reshape(*x.shape[: dim + 1], row)  # the bytes after dim as one row: a view
        dst = None if out is None else out.view(*out.shape[: dim + 1], row)
        wide = _width(src) if dst is None else _width(src, dst)
        if wide is not None:
            if dst is not None:
                torch.index_select(src.view(wide), dim, index, out=dst.view(wide))
                return out
            got = torch.index_select(src.view(wide), dim, index).view(x.dtype)
            return got.view(*x.shape[:dim], index.numel(), *x.shape[dim + 1:])
    if out is not None:
        return torch.index_select(x, dim, index, out=out)
    return x.index_select(dim, index)
