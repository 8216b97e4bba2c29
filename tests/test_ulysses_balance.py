"""``ulysses`` gives heads to ranks by density (``cost.balance``): on gloo ranks, with heads whose
masks differ in density so that the contiguous groups are unbalanced, every rank takes the
same non-contiguous order, computes the heads it was given, and the output comes back in the
caller's head order, equal to the single-process reference; whole-block and short-block slices,
fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from dist_utils import reference, run_distributed, slice_blocks


def _case(lens, H, D, bs, seed):
    """q, k, v of the whole sequence and a mask whose first heads keep every block and the
    rest few: contiguous head groups put the dense heads on the first ranks."""
    S = sum(lens)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    ids, n = slice_blocks(lens, bs)
    mask = torch.rand(1, H, n, n, generator=g) < 0.15
    mask[:, : H // 2] = True  # dense heads first
    mask |= torch.eye(n, dtype=torch.bool)  # every query block keeps one block
    return q, k, v, ids, mask


def _worker(rank, world, lens, H, dtype):
    from sparsp import SparspConfig, sp_attention
    from sparsp.cost.balance import balanced_heads, contiguous_heads
    from sparsp.strategies import ulysses

    D, bs = 16, 16
    q, k, v, ids, mask = _case(lens, H, D, bs, seed=3)
    orders = []
    real = ulysses.balanced_heads

    def spy(work, ranks):
        orders.append(real(work, ranks))
        return orders[-1]

    ulysses.balanced_heads = spy
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    out = sp_attention(*(t[:, sl].contiguous().to(dtype) for t in (q, k, v)), strategy="ulysses",
                       config=SparspConfig(block_size=bs), _global_mask=mask)
    want = reference(*(t.to(dtype) for t in (q, k, v)), ids, mask)[:, sl]
    kept = mask.sum(dim=(0, 2, 3)).tolist()
    return {"error": (out.double() - want).abs().max().item(), "order": orders[-1],
            "contiguous": contiguous_heads(H), "by_blocks": balanced_heads(kept, world)}


@pytest.mark.parametrize("lens, H, dtype, tol", [
    ([64, 64], 4, torch.float32, 1e-4),  # whole blocks: one kernel over the whole sequence
    ([48, 40, 56], 6, torch.bfloat16, 3e-2),  # short blocks at the cuts: per-slice kernels
    ([32, 48, 32, 40], 8, torch.float32, 1e-4),
])
def test_heads_balanced_by_density_same_output(lens, H, dtype, tol):
    got = run_distributed(_worker, len(lens), lens, H, dtype, timeout=120)
    orders = {tuple(g["order"]) for g in got}
    assert len(orders) == 1  # every rank derives the same order
    order = orders.pop()
    assert order != got[0]["contiguous"] and sorted(order) == list(range(H))
    # dense heads spread over the ranks: each rank's group holds the same number of them
    per = H // len(lens)
    dense = [sum(h < H // 2 for h in order[r * per:(r + 1) * per]) for r in range(len(lens))]
    assert max(dense) - min(dense) <= 1, (order, dense)
    assert all(g["error"] < tol for g in got), [g["error"] for g in got]
