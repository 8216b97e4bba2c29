"""Heads given to the ranks of a head-sharded strategy by density (``cost.balance``): the greedy
order against a brute-force optimum, never worse than contiguous heads, the cost model computing
each rank's own heads, and ``sparsp analyze`` reporting both orders."""

from __future__ import annotations

import json
import random

import pytest
import torch
from cli_utils import run_cli

from sparsp.analysis import compute_balance, head_orders
from sparsp.cost import Blocks, measure, work
from sparsp.cost.balance import balanced_heads, head_balance, rank_loads
from sparsp.geometry import VideoGeometry
from sparsp.placement import make_placement
from sparsp.strategies.registry import strategy_spec


def _optimum(kept: list[int], G: int) -> int:
    """The least busiest-rank load over every split of the heads into G groups of H/G."""
    per, best = len(kept) // G, [sum(kept)]

    def place(i: int, loads: list[int], counts: list[int]) -> None:
        if max(loads) >= best[0]:
            return
        if i == len(kept):
            best[0] = max(loads)
            return
        for r in range(G):
            if counts[r] < per:
                loads[r] += kept[i]
                counts[r] += 1
                place(i + 1, loads, counts)
                loads[r] -= kept[i]
                counts[r] -= 1

    place(0, [0] * G, [0] * G)
    return best[0]


@pytest.mark.parametrize("kept, G, want_order", [
    ([5, 4, 3, 3], 2, (0, 3, 1, 2)),  # 8 | 7: the optimum (5 + 3, 4 + 3)
    ([9, 1, 8, 2, 7, 3], 2, (0, 3, 5, 1, 2, 4)),  # 14 | 16: no three heads make 15
    ([1, 2, 3, 4, 10, 20, 30, 40], 4, (0, 7, 1, 6, 2, 5, 3, 4)),  # each dense head with a light one
])
def test_balanced_order_reaches_the_optimum_on_small_cases(kept, G, want_order):
    order = balanced_heads(kept, G)
    assert order == want_order
    loads = rank_loads(kept, G, order)
    assert max(loads) == _optimum(kept, G) < max(rank_loads(kept, G))
    per = len(kept) // G
    assert all(order[r * per:(r + 1) * per] == tuple(sorted(order[r * per:(r + 1) * per])) for r in range(G))


def test_balanced_order_is_never_worse_than_contiguous_and_near_the_optimum():
    rng = random.Random(0)
    for _ in range(150):
        G = rng.choice([2, 3, 4])
        kept = [rng.randint(0, 60) for _ in range(G * rng.choice([2, 3]))]
        order = balanced_heads(kept, G)
        assert sorted(order) == list(range(len(kept)))
        best, mine = _optimum(kept, G), max(rank_loads(kept, G, order))
        assert best <= mine <= max(rank_loads(kept, G))
        assert mine <= 4 / 3 * best
    # an even mask keeps the contiguous order; so does one the greedy rule cannot improve
    assert balanced_heads([7] * 8, 4) == tuple(range(8))
    assert balanced_heads([1, 5, 1, 5], 2) == (0, 1, 2, 3)


def test_head_balance_figures_and_refusals():
    b = head_balance([1, 2, 3, 10], 2)
    assert b["kept_per_rank"] == [3, 13] and b["densest_rank"] == 1
    assert b["kept_max_over_mean"] == pytest.approx(13 / 8, abs=1e-4)
    assert b["balanced_kept_per_rank"] == [11, 5] and b["head_order"] == [0, 3, 1, 2]
    with pytest.raises(ValueError, match="do not divide"):
        balanced_heads([1, 2, 3], 2)
    with pytest.raises(ValueError, match="not a permutation"):
        rank_loads([1, 2, 3, 4], 2, (0, 0, 1, 2))


ULYSSES = strategy_spec("ulysses")
GEOM = VideoGeometry(name="toy", frames=2, height=8, width=16, heads=8, head_dim=64, block_size=32, layers=1)


def _masks(seed: int = 0) -> torch.Tensor:
    """bool [heads, nB, nB], each head at its own density (the last heads densest)."""
    g = torch.Generator().manual_seed(seed)
    nB = GEOM.num_blocks
    dens = torch.linspace(0.05, 0.9, GEOM.heads)[:, None, None]
    return torch.rand(GEOM.heads, nB, nB, generator=g) < dens


def test_cost_model_computes_each_ranks_own_heads():
    m = _masks()
    G = 4
    pl = make_placement("contiguous", GEOM, G)
    d = measure(m, Blocks.of(pl))
    order = balanced_heads(m.sum(dim=(1, 2)).tolist(), G)
    plain = work(ULYSSES, d, head_dim=GEOM.head_dim, head_order=tuple(range(GEOM.heads)))
    even = work(ULYSSES, d, head_dim=GEOM.head_dim, head_order=order)
    # by default the model charges what ulysses runs: heads balanced by their kept pairs
    runs = work(ULYSSES, d, head_dim=GEOM.head_dim)
    assert runs.flops == work(ULYSSES, d, head_dim=GEOM.head_dim,
                              head_order=balanced_heads(d.head_pairs, G)).flops
    per = GEOM.heads // G
    L = GEOM.block_lengths().double()
    pairs = torch.einsum("hqk,q,k->h", m.double(), L, L)  # kept token pairs per head, brute force
    for w, heads in ((plain, tuple(range(GEOM.heads))), (even, order)):
        for r in range(G):
            mine = [heads[i] for i in range(r * per, (r + 1) * per)]
            assert w.flops[r][0] == pytest.approx(4.0 * GEOM.head_dim * float(pairs[mine].sum()))
    assert max(f[0] for f in even.flops) < max(f[0] for f in plain.flops)
    assert even.recv == plain.recv and even.back == plain.back  # the same bytes: H/G heads each
    with pytest.raises(ValueError, match="not a permutation"):
        work(ULYSSES, d, head_dim=GEOM.head_dim, head_order=(0,) * GEOM.heads)


def test_compute_balance_with_balanced_heads():
    m = torch.stack([_masks(0), _masks(1)])
    pl = make_placement("contiguous", GEOM, 4)
    orders = head_orders(m, 4)
    plain, even = compute_balance(m, pl, "ulysses"), compute_balance(m, pl, "ulysses", orders)
    L = GEOM.block_lengths().double()
    pairs = torch.einsum("lhqk,q,k->lh", m.double(), L, L)
    want = torch.stack([pairs[i][list(o)] for i, o in enumerate(orders)]).sum(0).reshape(4, -1).sum(1)
    assert even == pytest.approx(float(want.max() / want.mean()), abs=1e-4)
    assert even < plain


def test_analyze_reports_ulysses_heads_contiguous_and_balanced(capsys, tmp_path):
    from test_calibration import _ltx_profile, _stored_calibration

    from sparsp.workloads.calibration import CALIBRATION_MIX, read_calibration
    from sparsp.geometry import preset
    from sparsp.workloads import synthetic_masks

    profile, cal = _ltx_profile(tmp_path), _stored_calibration(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = run_cli(capsys, ["analyze", "--model", "ltx-video", "--density-profile", profile,
                                         "--calibration", cal, "--layers", 2, "--ranks", 8, "--cdf", 0.9,
                                         "--placement", "contiguous", "--strategy", "sparsp", "ulysses",
                                         "--no-plots", "--out", out])
    assert code == 0, err
    doc = json.loads((out / "analysis.json").read_text())
    m = synthetic_masks(preset("ltx-video"), 0.9, layers=2, seed=0, mix=CALIBRATION_MIX,
                        heads=read_calibration(cal).head_params())[0.9]
    for r in doc["per_layer"]:
        if r["strategy"] == "ulysses":
            per_head = m[r["layer"]].sum(dim=(1, 2)).reshape(8, -1).sum(1).tolist()
            assert r["kept_per_rank"] == per_head and r["densest_rank"] == per_head.index(max(per_head))
            order = r["head_order"]
            assert r["balanced_kept_per_rank"] == rank_loads(m[r["layer"]].sum(dim=(1, 2)).tolist(), 8, order)
            assert r["balanced_kept_max_over_mean"] <= r["kept_max_over_mean"]
        else:  # sequence-sharded: the kept blocks of the query blocks each rank owns
            assert "head_order" not in r and sum(r["kept_per_rank"]) == int(m[r["layer"]].sum())
    ul = next(r for r in doc["results"] if r["strategy"] == "ulysses")
    assert ul["balanced_compute_max_over_mean"] < ul["compute_max_over_mean"]
    text = " ".join(stdout.split())
    assert "with heads given to ranks by density" in text
    # the table shows ulysses as it runs (balanced heads); the contiguous figure is in one note per cdf
    row = next(line for line in stdout.splitlines() if "│ ulysses" in line)
    assert row.rstrip(" │").endswith(f"{ul['balanced_compute_max_over_mean']:.2f}x")
    note = (f"ulysses, cdf 0.90: compute max/mean {ul['balanced_compute_max_over_mean']:.2f}x as it runs "
            f"(heads given to ranks by density, cost.balance), {ul['compute_max_over_mean']:.2f}x with "
            f"contiguous head groups")
    assert text.count(note) == 1
