"""The packed layout made before the call's host sync (``packing.prepare``) equals the one made
after it, and the fused LSE merge equals the reference merge."""

from __future__ import annotations

import math

import pytest
import torch

from sparsp.kernels import kernel_indices, merge_pair, update_out_and_lse
from sparsp.packing import halves, layout, pack, prepare


def _reference_rows(selected: torch.Tensor, seq_len: int, bs: int, heads: int) -> torch.Tensor:
    """Token rows in packed order, block by block in Python: full blocks row-major, then the
    short tail blocks."""
    BH, n = selected.shape
    tail_len = seq_len - (n - 1) * bs
    tail = tail_len < bs
    order = [(bh, j) for bh in range(BH) for j in range(n) if selected[bh, j] and not (tail and j == n - 1)]
    order += [(bh, n - 1) for bh in range(BH) if tail and selected[bh, n - 1]]
    rows = []
    for bh, j in order:
        b, h = divmod(bh, heads)
        length = tail_len if (tail and j == n - 1) else bs
        rows += [(b * seq_len + j * bs + t) * heads + h for t in range(length)]
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("seed", range(12))
def test_prepared_rows_equal_block_by_block_rows(seed):
    g = torch.Generator().manual_seed(seed)
    B, H = 1 + seed % 2, 1 + seed % 3
    bs = (4, 8, 16)[seed % 3]
    S = int(torch.randint(1, 70, (1,), generator=g))
    n = math.ceil(S / bs)
    selected = torch.rand(B * H, n, generator=g) < 0.2 + 0.6 * (seed / 12)
    pending = prepare(selected, S, bs, heads=H)
    lay = pending.finish(int(pending.num_selected), int(pending.num_short))
    want = _reference_rows(selected, S, bs, H)
    assert torch.equal(lay.token_rows(H), want)
    assert lay.num_rows == want.numel()
    # the layout made without token rows derives the same rows and offsets after the sync
    plain = layout(selected, S, bs)
    assert torch.equal(plain.token_rows(H), want)
    assert torch.equal(plain.block_start, lay.block_start) and torch.equal(plain.block_len, lay.block_len)
    # and the payload packed from either holds the same K/V rows
    k = torch.randn(B, S, H, 3, generator=g)
    v = torch.randn(B, S, H, 3, generator=g)
    out = torch.empty(B * H * n * bs * 2 * 3)
    written = pack(k, v, lay, H, out)
    kk, vv = halves(out, lay, 3)
    assert written == 2 * want.numel() * 3
    assert torch.equal(kk, k.reshape(-1, 3)[want]) and torch.equal(vv, v.reshape(-1, 3)[want])



@pytest.mark.parametrize("seed", range(6))
def test_stacked_selections_prepare_as_each_alone(seed):
    # a payload's head-group units are prepared at once (sparsp's chunks: one set of kernels
    # for all units); each unit's layout equals the one its selection gets alone
    g = torch.Generator().manual_seed(seed)
    B, H, bs = 1 + seed % 2, 4, (4, 8)[seed % 2]
    S = int(torch.randint(1, 60, (1,), generator=g))
    n = math.ceil(S / bs)
    whole = torch.rand(B, H, n, generator=g) < 0.6
    units = [(0, 1), (1, 3), (3, 4)]
    stacked = torch.zeros(len(units), B, H, n, dtype=torch.bool)
    for u, (h0, h1) in enumerate(units):
        stacked[u, :, h0:h1] = whole[:, h0:h1]
    stacked = stacked.view(len(units), B * H, n)
    parts = prepare(stacked, S, bs, heads=H).unbind()
    assert len(parts) == len(units)
    for sel, part in zip(stacked, parts):
        alone = prepare(sel, S, bs, heads=H)
        counts = (int(alone.num_selected), int(alone.num_short))
        assert (int(part.num_selected), int(part.num_short)) == counts
        a, b = part.finish(*counts), alone.finish(*counts)
        assert a.num_rows == b.num_rows and a.num_aligned == b.num_aligned
        for name in ("block_ids", "block_start", "block_len", "rows", "selected"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a.rows, _reference_rows(sel, S, bs, H))

def test_kernel_indices_list_kept_blocks_ascending():
    g = torch.Generator().manual_seed(3)
    B, H, nQ, n, bs = 1, 2, 5, 7, 4
    S = (n - 1) * bs + 3  # a short tail block
    selected = torch.rand(B * H, n, generator=g) < 0.7
    selected[:, -1] = True
    lay = layout(selected, S, bs)
    mask = (torch.rand(B, H, nQ, n, generator=g) < 0.5) & selected.view(B, H, 1, n)
    num, idx = kernel_indices(mask, lay.block_ids, n)
    ids = lay.block_ids.view(B, H, 1, n).expand(mask.shape)
    for b in range(B):
        for h in range(H):
            for qb in range(nQ):
                want = sorted(ids[b, h, qb][mask[b, h, qb]].tolist())
                assert num[b, h, qb] == len(want)
                assert idx[b, h, qb, : len(want)].tolist() == want
                assert (idx[b, h, qb, len(want):] == 0).all()


def test_merge_pair_equals_reference_merge():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 6, 4, generator=g), torch.randn(2, 3, 6, 4, generator=g)
    la, lb = torch.randn(2, 3, 6, generator=g), torch.randn(2, 3, 6, generator=g)
    la[0, 0, :2] = -math.inf  # empty on one side
    lb[0, 0, 1:3] = -math.inf  # empty on both sides at row 1
    a[0, 0, :2] = 0
    b[0, 0, 1:3] = 0
    out, lse = merge_pair(a.bfloat16(), la, b.bfloat16(), lb)
    ref_out, ref_lse = update_out_and_lse(a.bfloat16().float(), la, b.bfloat16(), lb)
    assert out.dtype == torch.float32 and not out.isnan().any()
    assert torch.allclose(out, ref_out, atol=1e-6)
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())
    finite = ~ref_lse.isneginf()
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-6)
    assert lse[0, 0, 1] == -math.inf and (out[0, 0, 1] == 0).all()


def test_fold_and_packed_result():
    from sparsp.kernels import reads_token_major
    from sparsp.kernels.buffer import packed_result
    from sparsp.kernels.merge import fold

    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 4, 5, generator=g).bfloat16()
    out, lse = packed_result(q, None, None)  # an empty buffer
    assert torch.equal(out, torch.zeros_like(q)) and out.dtype == q.dtype
    assert lse.shape == (2, 3, 4) and bool(torch.isneginf(lse).all())
    a, la = torch.randn(6, 4, 5, generator=g), torch.randn(6, 4, generator=g)
    b, lb = torch.randn(6, 4, 5, generator=g), torch.randn(6, 4, generator=g)
    first = fold(None, None, a, la)
    assert first[0] is a and first[1] is la  # the first part as given
    both = fold(a, la, b, lb)
    ref = update_out_and_lse(a, la, b, lb)
    assert torch.equal(both[0], ref[0]) and torch.equal(both[1], ref[1])
    out, lse = packed_result(q, both[0], both[1])
    assert out.shape == q.shape and out.dtype == q.dtype and torch.equal(lse, both[1].reshape(2, 3, 4))
    # the torch reference kernel reads head-major queries: callers copy them
    from sparsp.kernels import get_kernel

    assert not reads_token_major(get_kernel("torch", "cpu"), q, 4)
