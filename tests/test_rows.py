"""``rows.gather_rows``: the same bits as ``index_select`` whatever view it copies through."""

from __future__ import annotations

import pytest
import torch

from sparsp.rows import _width, gather_rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape, dim", [((50, 8, 64), 0), ((50, 8, 3), 0), ((2, 40, 4, 128), 1),
                                        ((7, 5), 1), ((30, 1), 0)])
def test_gather_rows_equals_index_select_bit_for_bit(dtype, shape, dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    x.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0], dtype=dtype)
    if dtype != torch.float32:  # a NaN with a payload: a bitwise copy keeps it
        x.view(torch.int16).view(-1)[3] = 0x7FC1
    index = torch.randint(0, shape[dim], (2 * shape[dim] + 1,), generator=g)
    assert torch.equal(_bits(gather_rows(x, index, dim)), _bits(x.index_select(dim, index)))


def test_gather_rows_into_out_and_the_fallbacks():
    x = torch.randn(64, 128).to(torch.bfloat16)
    index = torch.randperm(64)[:40]
    big = torch.empty(40 * 128 + 1, dtype=torch.bfloat16)
    out = big[:40 * 128].view(40, 128)
    assert gather_rows(x, index, out=out) is out
    assert torch.equal(_bits(out), _bits(x[index]))
    assert _width(x) is torch.complex128  # 256-byte rows: 16-byte elements
    odd = big[1: 1 + 40 * 128].view(40, 128)  # 2 bytes past an aligned pointer: no wide view
    assert _width(x, odd) is None
    assert torch.equal(_bits(gather_rows(x, index, out=odd)), _bits(x[index]))
    strided = x[:, ::2]  # not contiguous: index_select itself
    assert torch.equal(_bits(gather_rows(strided, index)), _bits(strided[index]))


def test_gather_rows_of_nothing():
    x = torch.randn(0, 8).to(torch.bfloat16)
    assert gather_rows(x, torch.zeros(0, dtype=torch.long)).shape == (0, 8)
    y = torch.randn(5, 8).to(torch.bfloat16)
    out = torch.empty(0, 8, dtype=torch.bfloat16)
    assert gather_rows(y, torch.zeros(0, dtype=torch.long), out=out).shape == (0, 8)
