import pytest
import torch

from sparsp.demand import BYTE_RULES, demand_sets, head_split, relay_amplification, remote_demand, sharing_curve
from sparsp.geometry import VideoGeometry
from sparsp.placement import contiguous, periodic
from sparsp.strategies import comm_bytes, strategy_names

STRATEGIES = strategy_names()


def brute_force(masks, placement, strategy, head_dim, dtype_bytes):
    """Simulate each strategy's messages one block at a time."""
    g = placement.geometry
    G, H, n = placement.ranks, masks.shape[0], g.num_blocks
    owner = placement.owner.tolist()
    lens = g.block_lengths().tolist()
    bb = [2 * L * head_dim * dtype_bytes for L in lens]
    need = [[set() for _ in range(H)] for _ in range(G)]  # need[r][h] = remote blocks
    for h in range(H):
        for qb in range(n):
            for kb in range(n):
                if masks[h, qb, kb] and owner[qb] != owner[kb]:
                    need[owner[qb]][h].add(kb)
    recv = [0] * G
    if strategy in ("ring", "ring-sparse"):
        for k in range(1, G):  # hop k: r receives the shard that started at r - k
            for r in range(G):
                p = (r - k) % G
                recv[r] += sum(bb[kb] for kb in range(n) if owner[kb] == p) * H
    elif strategy == "sparsp":
        for r in range(G):
            recv[r] = sum(bb[kb] for h in range(H) for kb in need[r][h])
    elif strategy == "ring-relay":
        for p in range(G):  # follow origin p's blocks around the ring
            for h in range(H):
                for kb in range(n):
                    if owner[kb] != p:
                        continue
                    consumers = [k for k in range(1, G) if kb in need[(p + k) % G][h]]
                    if consumers:
                        for k in range(1, max(consumers) + 1):  # every hop up to the farthest
                            recv[(p + k) % G] += bb[kb]
    elif strategy == "ulysses":
        tok = [sum(L for kb, L in enumerate(lens) if owner[kb] == r) for r in range(G)]
        heads = head_split(H, G)
        row = head_dim * dtype_bytes
        for r in range(G):
            for p in range(G):
                if p != r:
                    recv[r] += 3 * tok[p] * heads[r] * row + tok[r] * heads[p] * row
    return recv


@pytest.mark.parametrize("G", [2, 3, 4, 8])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["contiguous", "periodic"])
def test_bytes_match_brute_force(G, strategy, kind):
    g = VideoGeometry(frames=3, height=4, width=7, text_tokens=9, block_size=8)  # 93 tokens, tail 5
    masks = torch.rand(3, g.num_blocks, g.num_blocks, generator=torch.Generator().manual_seed(G)) < 0.3
    pl = (contiguous if kind == "contiguous" else periodic)(g, G)
    got = comm_bytes(masks, pl, strategy, head_dim=16, dtype_bytes=2)
    want = brute_force(masks, pl, strategy, 16, 2)
    assert got["per_rank"] == want
    assert got["total"] == sum(want)
    assert all(isinstance(x, int) for x in got["per_rank"])


def test_orderings_between_strategies():
    g = VideoGeometry(frames=4, height=4, width=8, block_size=8)
    masks = torch.rand(4, g.num_blocks, g.num_blocks, generator=torch.Generator().manual_seed(4)) < 0.2
    pl = contiguous(g, 4)
    b = {s: comm_bytes(masks, pl, s, head_dim=8)["total"] for s in STRATEGIES}
    assert b["ring"] == b["ring-sparse"] >= b["ring-relay"] >= b["sparsp"]
    dense = torch.ones_like(masks)
    d = {s: comm_bytes(dense, pl, s, head_dim=8)["total"] for s in ("ring", "ring-relay", "sparsp")}
    assert d["ring"] == d["ring-relay"] == d["sparsp"]


def test_demand_sets_never_local():
    g = VideoGeometry(frames=2, height=4, width=8, block_size=8)
    masks = torch.ones(2, g.num_blocks, g.num_blocks, dtype=torch.bool)
    pl = periodic(g, 2)
    d = demand_sets(masks, pl)
    for r in range(2):
        assert not d[r][:, pl.owner == r].any()
        assert d[r][:, pl.owner != r].all()


def test_two_ranks_relay_equals_direct_and_curves():
    g = VideoGeometry(frames=4, height=4, width=8, block_size=8)
    masks = torch.rand(2, g.num_blocks, g.num_blocks, generator=torch.Generator().manual_seed(2)) < 0.25
    amp = relay_amplification(masks, contiguous, g, [2, 4], head_dim=8)
    assert amp[0].ratio == pytest.approx(1.0)
    assert amp[1].ratio >= 1.0
    xs, ys = sharing_curve(masks, contiguous(g, 4))
    assert ys[0] == 1.0 and (ys[1:] <= ys[:-1]).all()


def test_bad_inputs():
    g = VideoGeometry(frames=2, height=4, width=8, block_size=8)
    pl = contiguous(g, 2)
    with pytest.raises(ValueError, match="strategy='allgather' is not one of"):
        comm_bytes(torch.ones(1, 8, 8, dtype=torch.bool), pl, "allgather", head_dim=8)
    from sparsp.demand import comm_bytes as rule_bytes

    with pytest.raises(ValueError, match="unknown byte rule 'gossip'"):
        rule_bytes(torch.ones(1, 8, 8, dtype=torch.bool), pl, "gossip", head_dim=8)
    with pytest.raises(ValueError, match="masks must be bool"):
        comm_bytes(torch.ones(1, 7, 8, dtype=torch.bool), pl, "ring", head_dim=8)


def test_remote_demand_matches_demand_sets_and_a_loop():
    """The one demand function: placed-order runtime masks and analysis masks agree."""
    g = VideoGeometry(frames=3, height=4, width=8, block_size=8)
    masks = torch.rand(2, g.num_blocks, g.num_blocks, generator=torch.Generator().manual_seed(7)) < 0.3
    pl = periodic(g, 3)
    want = torch.zeros(3, 2, g.num_blocks, dtype=torch.bool)
    for r in range(3):
        for h in range(2):
            for qb in range(g.num_blocks):
                for kb in range(g.num_blocks):
                    if masks[h, qb, kb] and pl.owner[qb] == r and pl.owner[kb] != r:
                        want[r, h, kb] = True
    assert torch.equal(demand_sets(masks, pl), want)
    # the runtime view: the same mask in placed order, blocks owned by contiguous rank ranges
    order = pl.block_order
    placed = masks[:, order][:, :, order]
    got = remote_demand(placed[None], pl.owner[order], 3)[:, 0]
    assert torch.equal(got, want[:, :, order])


def test_every_strategy_names_a_byte_rule():
    from sparsp.strategies import strategy_spec

    for name in STRATEGIES:
        rule = strategy_spec(name).byte_rule
        assert rule in BYTE_RULES or callable(rule), name
