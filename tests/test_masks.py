import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsp.geometry import VideoGeometry
from sparsp.masks import (
    PooledBlocks, block_mask, density, head_density, key_sum, pattern_shares, pool_blocks, select_blocks,
)


def slow_block_mask(q, k, cdf, sim_t, bq, bk):
    """Obviously-correct reference: one (b, h, row) at a time, plain Python lists."""
    B, S, H, D = q.shape
    Sk = k.shape[1]
    q = q.double()
    k = k.double()
    nq, nk = math.ceil(S / bq), math.ceil(Sk / bk)
    out = torch.zeros(B, H, nq, nk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            c = cdf[h] if isinstance(cdf, (list, tuple)) else cdf
            st_ = sim_t[h] if isinstance(sim_t, (list, tuple)) else sim_t
            ks = k[b, :, h] - k[b, :, h].mean(0)
            kblocks = [ks[j * bk:(j + 1) * bk] for j in range(nk)]
            qblocks = [q[b, i * bq:(i + 1) * bq, h] for i in range(nq)]

            def simil(x):
                u = torch.nn.functional.normalize(x, dim=-1).mean(0)
                return float((u * u).sum())

            ksim = [True if st_ is None else simil(x) > st_ for x in kblocks]
            qsim = [True if st_ is None else simil(x) > st_ for x in qblocks]
            kmean = [x.mean(0) for x in kblocks]
            for i, xq in enumerate(qblocks):
                pq = xq.mean(0)
                scores = [float(pq @ km) / math.sqrt(D) if ksim[j] else -math.inf for j, km in enumerate(kmean)]
                top = max(scores)
                if top == -math.inf:
                    probs = [0.0] * nk
                else:
                    e = [math.exp(s - top) for s in scores]
                    probs = [x / sum(e) for x in e]
                order = sorted(range(nk), key=lambda j: (-probs[j], j))
                acc = 0.0
                for rank_, j in enumerate(order):
                    acc += probs[j]
                    if rank_ == 0 or acc <= c or c >= 1.0:
                        out[b, h, i, j] = True
                    else:
                        break
                for j in range(nk):
                    if not ksim[j]:
                        out[b, h, i, j] = True
                if not qsim[i]:
                    out[b, h, i, :] = True
    return out


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    S=st.integers(1, 70),
    H=st.integers(1, 3),
    bq=st.sampled_from([4, 8, 16]),
    bk=st.sampled_from([4, 8, 16]),
    cdf=st.sampled_from([0.0, 0.3, 0.5, 0.85, 0.9, 0.95, 1.0]),
    sim=st.sampled_from([None, 0.0, 0.3, 0.6, 1.0]),
)
def test_block_mask_matches_slow_loop(seed, S, H, bq, bk, cdf, sim):
    q = _rand((1, S, H, 8), seed) * 2
    k = _rand((1, S, H, 8), seed + 1) * 2
    got = block_mask(q, k, cdf_threshold=cdf, sim_threshold=sim, block_q=bq, block_k=bk)
    want = slow_block_mask(q, k, cdf, sim, bq, bk)
    assert torch.equal(got, want)


def test_per_head_thresholds_and_batch():
    q, k = _rand((2, 50, 3, 8), 1) * 3, _rand((2, 50, 3, 8), 2) * 3
    cdf, sim = [0.5, 0.9, 1.0], [None, None, None]
    got = block_mask(q, k, cdf_threshold=torch.tensor(cdf), block_q=8, block_k=8)
    assert torch.equal(got, slow_block_mask(q, k, cdf, sim, 8, 8))
    sims = [0.2, 0.5, 0.9]
    got = block_mask(q, k, cdf_threshold=torch.tensor(cdf), sim_threshold=torch.tensor(sims), block_q=8, block_k=8)
    assert torch.equal(got, slow_block_mask(q, k, cdf, sims, 8, 8))


def test_dense_threshold_is_dense():
    q, k = _rand((1, 300, 2, 16), 3) * 5, _rand((1, 300, 2, 16), 4) * 5
    assert block_mask(q, k, cdf_threshold=1.0).all()


def test_at_least_one_block_per_row():
    q, k = _rand((1, 64, 2, 8), 5), _rand((1, 64, 2, 8), 6)
    m = block_mask(q, k, cdf_threshold=0.0, block_q=8, block_k=8)
    assert (m.sum(-1) == 1).all()


@pytest.mark.parametrize("ranks, block", [(2, 8), (3, 8), (4, 16)])
def test_split_form_equals_single_process(ranks, block):
    S = 7 * block * ranks + 5  # last rank's slice ends with a short block
    q, k = _rand((2, S, 3, 8), 7) * 2, _rand((2, S, 3, 8), 8) * 2
    want = block_mask(q, k, cdf_threshold=0.8, sim_threshold=0.4, block_q=block, block_k=block)
    bounds = [0] + [7 * block * (r + 1) for r in range(ranks - 1)] + [S]
    # "all-reduce" of the key sum and "all-gather" of pooled keys, by hand
    center = sum(key_sum(k[:, a:b]) for a, b in zip(bounds, bounds[1:])) / S
    pk = PooledBlocks.cat([pool_blocks(k[:, a:b], block, center) for a, b in zip(bounds, bounds[1:])])
    rows = [
        select_blocks(pool_blocks(q[:, a:b], block), pk, cdf_threshold=0.8, sim_threshold=0.4)
        for a, b in zip(bounds, bounds[1:])
    ]
    assert torch.equal(torch.cat(rows, dim=2), want)


def test_threshold_validation():
    q = _rand((1, 16, 2, 4), 0)
    with pytest.raises(ValueError, match="cdf_threshold"):
        block_mask(q, q, cdf_threshold=1.5)
    with pytest.raises(ValueError, match="sim_threshold"):
        block_mask(q, q, cdf_threshold=0.5, sim_threshold=-0.1)
    with pytest.raises(ValueError, match="per-head"):
        block_mask(q, q, cdf_threshold=torch.tensor([0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match=r"\(B, S, H, D\)"):
        block_mask(q[0], q[0], cdf_threshold=0.5)


def test_statistics():
    m = torch.zeros(2, 4, 4, dtype=torch.bool)
    m[0] = True
    assert density(m) == 0.5
    assert head_density(m[None]).tolist() == [1.0, 0.0]
    g = VideoGeometry(frames=4, height=4, width=8, block_size=16)  # 2 blocks per frame, 8 blocks
    eye = torch.eye(8, dtype=torch.bool)[None]
    assert pattern_shares(eye, g)["diagonal"] == 1.0
    multi = torch.zeros(1, 8, 8, dtype=torch.bool)
    multi[0, 0, 2] = multi[0, 0, 4] = multi[0, 1, 3] = multi[0, 1, 5] = True
    shares = pattern_shares(multi, g, column_share=0.9)
    assert shares["multi-diagonal"] == 1.0
    col = torch.zeros(1, 8, 8, dtype=torch.bool)
    col[0, :, 7] = True
    assert pattern_shares(col, g)["column"] == 1.0
    assert sum(pattern_shares(torch.rand(3, 8, 8) > 0.5, g).values()) == pytest.approx(1.0)


def test_send_rows_are_kept_per_geometry_and_bounded():
    """``summaries.send_row``: one row per (geometry's header, capacity), the header then zeros,
    the same tensor on every call (the summaries are written into it in place), and at most
    ``MAX_SEND_ROWS`` kept, the least recently used dropped first; ``caches.forget_all`` drops
    them."""
    from sparsp import caches, summaries

    caches.forget_all()
    headers = [torch.tensor([float(i), 1.0, 2.0]) for i in range(summaries.MAX_SEND_ROWS + 4)]
    first = summaries.send_row(headers[0], 5)
    assert torch.equal(first, torch.tensor([0.0, 1.0, 2.0, 0, 0, 0, 0, 0]))
    assert summaries.send_row(headers[0], 5) is first and summaries.send_row(headers[0], 6) is not first
    for h in headers[1:]:
        summaries.send_row(h, 5)
        summaries.send_row(headers[0], 5)  # kept in use: never the least recently used
    assert len(summaries._SEND_ROWS) == summaries.MAX_SEND_ROWS
    assert summaries.send_row(headers[0], 5) is first
    assert summaries.send_row(headers[1], 5) is not None and len(summaries._SEND_ROWS) == summaries.MAX_SEND_ROWS
    caches.forget_all()
    assert not summaries._SEND_ROWS
