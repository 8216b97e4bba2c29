"""Distributed attention on CPU (gloo, 2–4 processes) against a single-process reference."""

import math

import pytest
import torch

from dist_utils import run_distributed

from sparsp.strategies import strategy_names  # noqa: E402

STRATEGIES = strategy_names()


def reference(q, k, v, block_of_token, mask):
    """float64 attention restricted to the block mask; rows with no block give zeros."""
    B, S, H, D = q.shape
    allowed = mask[:, :, block_of_token][:, :, :, block_of_token]  # [B, H, S, S]
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(D)
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double())


def slice_blocks(lens, bs):
    """Global block id of every token when each slice is cut into blocks from its start."""
    ids, base = [], 0
    for L in lens:
        ids.append(base + torch.arange(L) // bs)
        base += math.ceil(L / bs)
    return torch.cat(ids), base


def split_mask(q, k, lens, bs, cdf, sim):
    """The mask every strategy must use: per-slice blocks, pooled as in the split form."""
    from sparsp.masks import split_mask as split

    return split(q, k, lens, bs, cdf_threshold=cdf, sim_threshold=sim)


def _inputs(seed, B, S, H, D):
    g = torch.Generator().manual_seed(seed)
    # Structured inputs (a shared direction per head plus noise) so CDF masks are truly sparse.
    c = torch.randn(1, 1, H, D, generator=g)
    q = c * 2 + torch.randn(B, S, H, D, generator=g)
    k = c * 2 + torch.randn(B, S, H, D, generator=g) + torch.linspace(-2, 2, S).view(1, S, 1, 1)
    v = torch.randn(B, S, H, D, generator=g)
    return q, k, v


def _case_worker(rank, world, lens, H, bs, cdf, sim, random_mask, seed):
    import torch.distributed as dist

    from sparsp import SparspConfig, sp_attention
    from sparsp.masks import block_mask
    from sparsp.strategies import get_transport

    B, D = 2, 16
    S = sum(lens)
    q, k, v = _inputs(seed, B, S, H, D)
    tok_block, nblocks = slice_blocks(lens, bs)
    if random_mask:
        g = torch.Generator().manual_seed(seed + 1)
        gm = torch.rand(B, H, nblocks, nblocks, generator=g) < 0.35
        gm[0, 0, 0] = False  # an empty row: defined output is zeros
    else:
        gm = None
        m = split_mask(q, k, lens, bs, cdf, sim)
        if all(L % bs == 0 for L in lens[:-1]):  # the public contract: block_mask on the whole
            assert torch.equal(m, block_mask(q, k, cdf_threshold=cdf, sim_threshold=sim, block_q=bs, block_k=bs))
    mask = gm if random_mask else m
    want_sparse = reference(q, k, v, tok_block, mask)
    want_dense = reference(q, k, v, tok_block, torch.ones_like(mask))
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), k.transpose(1, 2).double(), v.transpose(1, 2).double()).transpose(1, 2)
    assert (sdpa - want_dense).abs().max() < 1e-10
    if cdf >= 1.0 and sim is None and not random_mask:
        assert mask.all()
    a = sum(lens[:rank])
    sl = slice(a, a + lens[rank])
    cfg = SparspConfig(cdf_threshold=cdf, sim_threshold=sim, block_size=bs, transport="nccl", kernel="torch")
    errors = {}
    for strategy in STRATEGIES:
        if strategy == "ulysses" and H % world:
            continue
        out = sp_attention(q[:, sl].contiguous(), k[:, sl].contiguous(), v[:, sl].contiguous(),
                           strategy=strategy, config=cfg, _global_mask=gm)
        assert out.shape == q[:, sl].shape and out.dtype == q.dtype
        want = want_dense if strategy == "ring" else want_sparse
        errors[strategy] = (out.double() - want[:, sl]).abs().max().item()
    get_transport("nccl", None, torch.device("cpu"), 60).fence()
    dist.barrier()
    bad = {s: e for s, e in errors.items() if not e <= 1e-5}
    assert not bad, f"rank {rank}: max abs error above 1e-5: {bad}"
    return errors


CASES = [
    # world, per-rank lengths (tokens), heads, block, cdf, sim, random mask
    (2, [48, 32], 2, 16, 0.8, None, False),
    (2, [64, 53], 4, 16, 0.9, 0.5, False),  # tail block on the last rank, similarity on
    (3, [32, 48, 41], 3, 16, 0.7, None, False),
    (3, [40, 35, 50], 3, 16, 0.85, None, False),  # short blocks in the middle of the sequence
    (4, [32, 16, 48, 37], 4, 16, 0.75, None, False),
    (3, [32, 48, 41], 3, 16, 0.9, None, True),  # random masks, incl. an empty row
    (4, [16, 32, 32, 20], 4, 16, 0.9, None, True),
]


@pytest.mark.parametrize("world, lens, H, bs, cdf, sim, random_mask", CASES)
def test_strategies_match_reference(world, lens, H, bs, cdf, sim, random_mask):
    run_distributed(_case_worker, world, lens, H, bs, cdf, sim, random_mask, 7, timeout=240)


@pytest.mark.parametrize("world, lens", [(2, [48, 45]), (3, [32, 33, 16])])
def test_dense_threshold_equals_sdpa(world, lens):
    run_distributed(_case_worker, world, lens, 3 if world == 3 else 2, 16, 1.0, None, False, 11, timeout=240)


def _placed_worker(rank, world, kind, strategy_cdf, seed):
    """A placed video sequence: outputs unpermute to plain attention, bytes match demand.py."""
    import torch.distributed as dist

    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import comm_bytes
    from sparsp.geometry import VideoGeometry
    from sparsp.masks import block_mask
    from sparsp.placement import make_placement
    from sparsp.strategies import get_transport

    geom = VideoGeometry(frames=4, height=4, width=12, text_tokens=10, block_size=16, heads=4, head_dim=8)
    pl = make_placement(kind, geom, world)
    B, H, D, bs = 1, geom.heads, geom.head_dim, geom.block_size
    q, k, v = _inputs(seed, B, geom.num_tokens, H, D)
    mask = block_mask(q, k, cdf_threshold=strategy_cdf, block_q=bs, block_k=bs)  # original order
    tok_block = torch.arange(geom.num_tokens) // bs
    want = reference(q, k, v, tok_block, mask)
    qp, kp, vp = (pl.permute(x, 1) for x in (q, k, v))
    sl = pl.token_slice(rank)
    cfg = SparspConfig(cdf_threshold=strategy_cdf, block_size=bs, transport="nccl", kernel="torch")
    transport = get_transport("nccl", None, torch.device("cpu"), cfg.timeout_s)
    for strategy in STRATEGIES:
        if strategy == "ulysses" and H % world:
            continue
        transport.fence()
        transport.reset_counters()
        out = sp_attention(qp[:, sl].contiguous(), kp[:, sl].contiguous(), vp[:, sl].contiguous(),
                           strategy=strategy, config=cfg)
        transport.fence()
        # gather every rank's slice and undo the placement
        n_max = max(pl.tokens_per_rank)
        padded = torch.zeros(B, n_max, H, D)
        padded[:, : out.shape[1]] = out
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)  # gloo needs equal sizes
        full = pl.unpermute(torch.cat([p[:, :n] for p, n in zip(parts, pl.tokens_per_rank)], dim=1), 1)
        ref = want if strategy != "ring" else reference(q, k, v, tok_block, torch.ones_like(mask))
        err = (full.double() - ref).abs().max().item()
        assert err <= 1e-5, f"{strategy} ({kind}): error {err}"
        predicted = comm_bytes(mask[0], pl, strategy, head_dim=D, dtype_bytes=4)["per_rank"][rank]
        moved = transport.total_received
        assert moved == predicted, f"{strategy} ({kind}) rank {rank}: moved {moved} B, demand.py says {predicted} B"
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["contiguous", "periodic"])
def test_placed_sequences_and_bytes(world, kind):
    run_distributed(_placed_worker, world, kind, 0.8, 3, timeout=240)
