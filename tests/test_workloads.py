"""Synthetic workloads: determinism, shapes, block-level generation equal to token-level pooling,
the three video patterns coming out of RoPE, calibration, and the trace format."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsp import masks as M
from sparsp.geometry import Rope, VideoGeometry, preset
from sparsp.workloads.traces import Trace, load_trace, save_trace
from sparsp.workloads import DEFAULT_MIX, KINDS, HeadMix, head_kinds, pooled_qk, synthetic_masks, token_qk

CDFS = (0.85, 0.9, 0.95)
# Small, awkward on purpose: text tokens, a short tail block, frames not a whole number of blocks.
SMALL = VideoGeometry(frames=3, height=6, width=10, text_tokens=20, block_size=16, heads=8, head_dim=32,
                      rope=Rope(axes_dim=(8, 12, 12), theta=256.0))
EVERY_KIND = HeadMix(diagonal=0.25, multi_diagonal=0.25, column=0.25, dense=0.25, sinks=3)
NOISE_FREE = dataclasses.replace(EVERY_KIND, noise=0.0)
ONLY = {k: HeadMix(**{f: float(f == k.replace("-", "_")) for f in ("diagonal", "multi_diagonal", "column", "dense")})
        for k in KINDS}


def _kind_heads(geom, kind, seed=0, mix=None):
    return [h for h, k in enumerate(head_kinds(geom, seed=seed, mix=mix)) if k == kind]


# --- determinism and shapes -------------------------------------------------------------------


def test_token_qk_is_deterministic_by_seed_and_layer():
    q1, k1 = token_qk(SMALL, seed=5, mix=EVERY_KIND)
    q2, k2 = token_qk(SMALL, seed=5, mix=EVERY_KIND)
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    q3, _ = token_qk(SMALL, seed=6, mix=EVERY_KIND)
    q4, _ = token_qk(SMALL, seed=5, mix=EVERY_KIND, layer=1)
    assert not torch.allclose(q1, q3) and not torch.allclose(q1, q4)


def test_pooled_qk_and_masks_are_deterministic_and_layers_differ():
    g = preset("wan2.1-1.3b", width=640, height=368, frames=21)
    a, b = pooled_qk(g, seed=3), pooled_qk(g, seed=3)
    assert torch.equal(a[0].mean, b[0].mean) and torch.equal(a[1].mean, b[1].mean)
    m1 = synthetic_masks(g, 0.9, layers=2, seed=3)[0.9]
    m2 = synthetic_masks(g, 0.9, layers=2, seed=3)[0.9]
    assert torch.equal(m1, m2)
    assert not torch.equal(m1[0], m1[1])  # the layer changes every draw
    assert head_kinds(g, seed=3, layer=0) != head_kinds(g, seed=3, layer=1)


def test_shapes_and_dtypes():
    q, k = token_qk(SMALL, batch=2, seed=0, dtype=torch.bfloat16)
    assert q.shape == k.shape == (2, SMALL.num_tokens, SMALL.heads, SMALL.head_dim)
    assert q.dtype == k.dtype == torch.bfloat16
    pq, pk = pooled_qk(SMALL, seed=0)
    for p in (pq, pk):
        assert p.mean.shape == (1, SMALL.heads, SMALL.num_blocks, SMALL.head_dim)
        assert p.mean.dtype == torch.float32
        assert torch.equal(p.sim, torch.ones(1, SMALL.heads, SMALL.num_blocks))  # similarity off
        assert torch.equal(p.lengths, SMALL.block_lengths())
    out = synthetic_masks(SMALL, [0.5, 1.0], layers=3, seed=0)
    assert set(out) == {0.5, 1.0}
    for m in out.values():
        assert m.shape == (3, SMALL.heads, SMALL.num_blocks, SMALL.num_blocks) and m.dtype == torch.bool
    assert out[1.0].all()  # cdf 1 with similarity off is dense (docs/design.md, "Mask semantics")


def test_head_counts_follow_the_mix():
    g = preset("wan2.1-14b")
    kinds = head_kinds(g, seed=0)
    counts = {k: kinds.count(k) for k in KINDS}
    assert counts == DEFAULT_MIX.counts(40) == {"diagonal": 15, "multi-diagonal": 15, "column": 6, "dense": 4}


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=4, max_size=4).filter(lambda w: sum(w) > 0.01), st.integers(1, 64))
def test_counts_sum_to_heads(weights, heads):
    total = sum(weights)
    shares = [w / total for w in weights]
    shares[-1] = max(0.0, 1.0 - sum(shares[:-1]))
    mix = HeadMix(diagonal=shares[0], multi_diagonal=shares[1], column=shares[2], dense=shares[3])
    counts = mix.counts(heads)
    assert sum(counts.values()) == heads and all(n >= 0 for n in counts.values())
    for k, share in mix.shares().items():
        assert abs(counts[k] - share * heads) < 1.0 + 1e-9


@pytest.mark.parametrize("bad", [
    dict(diagonal=0.5),  # shares sum to 1.125
    dict(dense=-0.1, diagonal=0.575),
    dict(alignment=(1.2, 0.8)),
    dict(time_share=(0.2, 1.5)),
    dict(sinks=-1),
    dict(sink_share=1.0),
    dict(noise=-1.0),
])
def test_headmix_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="HeadMix"):
        HeadMix(**bad)


def test_token_qk_refuses_full_size_geometries():
    with pytest.raises(ValueError, match="pooled_qk"):
        token_qk(preset("hunyuan-video"), seed=0)


# --- block-level generation equals pooling of the token-level generation ---------------------


# LTX's odd axis split (22, 21, 21) leaves one pair of its 64 dims unrotated.
@pytest.mark.parametrize("geom", [SMALL, preset("ltx-video", width=256, height=128, frames=17, block_size=32)],
                         ids=["small", "ltx-odd-axes"])
def test_pooled_equals_pooling_of_tokens_noise_free(geom):
    q, k = token_qk(geom, seed=3, mix=NOISE_FREE, dtype=torch.float64)
    pq, pk = pooled_qk(geom, seed=3, mix=NOISE_FREE)
    assert set(head_kinds(geom, seed=3, mix=NOISE_FREE)) == set(KINDS)
    ref_q = M.pool_blocks(q, geom.block_size)
    ref_k = M.pool_blocks(k, geom.block_size, center=M.key_sum(k) / k.shape[1])
    torch.testing.assert_close(pq.mean, ref_q.mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pk.mean, ref_k.mean, rtol=1e-5, atol=1e-4)  # sinks: |k| ~ 50


def test_pooled_masks_match_token_masks_with_noise():
    g = preset("hunyuan-video", width=640, height=384, frames=33)  # 8,896 tokens incl. 256 text
    q, k = token_qk(g, seed=1)
    token_mask = M.block_mask(q, k, cdf_threshold=0.9)[0]
    pq, pk = pooled_qk(g, seed=1)
    pooled_mask = M.select_blocks(pq, pk, cdf_threshold=0.9)[0]
    # Noise is drawn per token on one path and per block on the other: equal in distribution.
    assert abs(M.density(token_mask) - M.density(pooled_mask)) < 0.01
    assert (token_mask == pooled_mask).float().mean().item() > 0.93


# --- the patterns come from RoPE ----------------------------------------------------------------


def test_text_tokens_have_no_rope():
    q, k = token_qk(SMALL, seed=2, mix=NOISE_FREE)
    positional = [h for h, kind in enumerate(head_kinds(SMALL, seed=2, mix=NOISE_FREE)) if kind != "dense"]
    text = q[0, SMALL.video_tokens:, positional]
    assert torch.equal(text, text[:1].expand_as(text))  # every text token alike: no position
    torch.testing.assert_close(text[0], q[0, 0, positional])  # token (0, 0, 0) is not turned


def test_multi_diagonal_scores_fade_slowly_with_time_and_diagonal_scores_fast():
    g = VideoGeometry(frames=6, height=8, width=8, heads=8, head_dim=64, rope=Rope(axes_dim=(16, 24, 24), theta=256.0))
    mix = HeadMix(diagonal=0.5, multi_diagonal=0.5, column=0.0, dense=0.0, noise=0.0)
    q, k = token_qk(g, seed=0, mix=mix, dtype=torch.float64)
    scores = torch.einsum("shd,thd->hst", q[0], k[0])
    same_place = scores[:, 0, g.frame_tokens:: g.frame_tokens]  # query 0 vs (t, 0, 0), t = 1..5
    own = scores[:, 0, :1]
    for h in _kind_heads(g, "multi-diagonal", mix=mix):
        # a small time share (multi_time_share): the same place in other frames keeps ≥ 85 %
        assert (same_place[h] > 0.85 * own[h]).all() and (same_place[h] < own[h]).any()
    for h in _kind_heads(g, "diagonal", mix=mix):
        assert (same_place[h] < own[h] - 1.0).all()
    # a zero time share makes them exactly time-invariant
    flat = HeadMix(diagonal=0.5, multi_diagonal=0.5, column=0.0, dense=0.0, noise=0.0, multi_time_share=(0.0, 0.0))
    q, k = token_qk(g, seed=0, mix=flat, dtype=torch.float64)
    scores = torch.einsum("shd,thd->hst", q[0], k[0])
    for h in _kind_heads(g, "multi-diagonal", mix=flat):
        torch.testing.assert_close(scores[h, 0, g.frame_tokens:: g.frame_tokens], scores[h, 0, :1].expand(5))


@pytest.fixture(scope="module")
def hunyuan():
    """One layer of the full hunyuan-video geometry (992 blocks, 24 heads) at the three cdfs."""
    g = preset("hunyuan-video")
    return g, synthetic_masks(g, CDFS, seed=0), head_kinds(g, seed=0)


def test_calibration_density_hunyuan(hunyuan):
    g, masks, _ = hunyuan
    assert g.num_blocks == 992
    dens = [M.density(masks[c]) for c in CDFS]
    assert all(0.15 <= d <= 0.45 for d in dens), dens
    assert dens[0] < dens[1] < dens[2]


def test_multi_diagonal_heads_keep_other_frames_more_than_diagonal_heads(hunyuan):
    g, masks, kinds = hunyuan
    for c in CDFS:
        m = masks[c][0]
        diag = M.pattern_shares(m[[h for h, k in enumerate(kinds) if k == "diagonal"]], g)
        multi = M.pattern_shares(m[[h for h, k in enumerate(kinds) if k == "multi-diagonal"]], g)
        assert multi["multi-diagonal"] > diag["multi-diagonal"]
        assert diag["diagonal"] > 2 * multi["diagonal"]


def test_column_heads_have_columns_and_dense_heads_are_densest(hunyuan):
    g, masks, kinds = hunyuan
    m = masks[0.95][0]
    by_kind = {k: [h for h, x in enumerate(kinds) if x == k] for k in KINDS}
    hd = M.head_density(m)
    assert hd[by_kind["dense"]].min() > hd[by_kind["diagonal"] + by_kind["multi-diagonal"]].max()
    assert hd[by_kind["dense"]].min() > 0.9
    assert M.pattern_shares(m[by_kind["column"]], g)["column"] > 0.5
    shares = M.pattern_shares(masks[0.9], g)
    assert min(shares["diagonal"], shares["multi-diagonal"], shares["column"]) > 0.03


def test_pattern_of_one_kind_mixes():
    g = preset("hunyuan-video", width=640, height=384, frames=65)  # 17 latent frames
    multi = M.pattern_shares(synthetic_masks(g, 0.9, mix=ONLY["multi-diagonal"])[0.9], g)
    diag = M.pattern_shares(synthetic_masks(g, 0.9, mix=ONLY["diagonal"])[0.9], g)
    assert multi["multi-diagonal"] > diag["multi-diagonal"] and diag["diagonal"] > multi["diagonal"]


# --- traces -------------------------------------------------------------------------------------


def _small_masks(layers=2):
    return synthetic_masks(SMALL, 0.9, layers=layers, seed=0)[0.9]


def test_trace_round_trip(tmp_path):
    masks = _small_masks()
    path = tmp_path / "t.pt"
    save_trace(path, masks, SMALL, cdf_threshold=0.9, source="synthetic seed 0")
    trace = load_trace(path, expected_geometry=SMALL)
    assert isinstance(trace, Trace)
    assert torch.equal(trace.masks, masks)
    assert trace.geometry == SMALL and trace.cdf_threshold == 0.9 and trace.sim_threshold is None
    assert trace.source == "synthetic seed 0"
    save_trace(path, masks[:1], SMALL, cdf_threshold=0.85, sim_threshold=0.6, source="x")
    assert load_trace(path).sim_threshold == 0.6


def test_trace_of_a_preset_gets_its_rope_back(tmp_path):
    g = preset("wan2.1-1.3b", width=320, height=176, frames=5)
    save_trace(tmp_path / "w.pt", torch.zeros(1, g.heads, g.num_blocks, g.num_blocks, dtype=torch.bool), g,
               cdf_threshold=0.9, source="zeros")
    assert load_trace(tmp_path / "w.pt", expected_geometry=g).geometry.rope == g.rope


def _raw(**overrides):
    data = {"format": "sparsp-trace", "version": 1, "masks": _small_masks(1),
            "geometry": {f.name: getattr(SMALL, f.name) for f in dataclasses.fields(VideoGeometry) if f.name != "rope"},
            "cdf_threshold": 0.9, "sim_threshold": None, "source": "test"}
    data.update(overrides)
    return data


@pytest.mark.parametrize("overrides, match", [
    (dict(format="other"), "not a sparsp-trace"),
    (dict(version=2), "version 2"),
    (dict(masks=torch.zeros(1, 8, 13, 13, dtype=torch.uint8)), "bool"),
    (dict(masks=torch.zeros(1, 7, 13, 13, dtype=torch.bool)), "shape"),
    (dict(masks=torch.zeros(1, 8, 12, 13, dtype=torch.bool)), "shape"),
    (dict(masks=torch.zeros(8, 13, 13, dtype=torch.bool)), "shape"),
    (dict(cdf_threshold=1.5), "cdf_threshold"),
    (dict(sim_threshold="x"), "sim_threshold"),
    (dict(geometry={"frames": 3}), "geometry"),
])
def test_trace_validation_errors(tmp_path, overrides, match):
    path = tmp_path / "bad.pt"
    torch.save(_raw(**overrides), path)
    with pytest.raises(ValueError, match=match) as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_trace_missing_keys_and_non_dict(tmp_path):
    path = tmp_path / "bad.pt"
    data = _raw()
    del data["source"]
    torch.save(data, path)
    with pytest.raises(ValueError, match="lacks"):
        load_trace(path)
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match="not a sparsp-trace"):
        load_trace(path)


def test_trace_geometry_mismatch_names_both(tmp_path):
    path = tmp_path / "t.pt"
    save_trace(path, _small_masks(), SMALL, cdf_threshold=0.9, source="s")
    other = dataclasses.replace(SMALL, frames=4)
    with pytest.raises(ValueError) as err:
        load_trace(path, expected_geometry=other)
    assert SMALL.describe() in str(err.value) and other.describe() in str(err.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_trace_file(tmp_path, damage):
    path = tmp_path / "t.pt"
    save_trace(path, _small_masks(), SMALL, cdf_threshold=0.9, source="s")
    blob = path.read_bytes()
    path.write_bytes({"truncate": blob[: len(blob) // 2], "garbage": b"not a torch file" * 10, "empty": b""}[damage])
    with pytest.raises(ValueError, match="not a readable trace") as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_save_trace_validates(tmp_path):
    with pytest.raises(ValueError, match="shape"):
        save_trace(tmp_path / "t.pt", _small_masks()[:, :4], SMALL, cdf_threshold=0.9, source="s")
    with pytest.raises(ValueError, match="bool"):
        save_trace(tmp_path / "t.pt", _small_masks().float(), SMALL, cdf_threshold=0.9, source="s")
    with pytest.raises(ValueError, match="cdf_threshold"):
        save_trace(tmp_path / "t.pt", _small_masks(), SMALL, cdf_threshold=2.0, source="s")


def test_head_params_set_kinds_and_alignment_and_are_checked():
    from sparsp.workloads import HeadParams

    kinds = ("dense",) * 4 + ("diagonal",) * 4
    q, _ = token_qk(SMALL, seed=2, mix=NOISE_FREE, heads=HeadParams(kinds, (1.0,) * 8))
    q2, _ = token_qk(SMALL, seed=2, mix=NOISE_FREE, heads=HeadParams(kinds, (2.0,) * 8))
    assert torch.allclose(2 * q, q2, atol=1e-5)  # noise-free q is a·R(p)c: linear in a
    # a dense head has no RoPE: every token's q is the same vector
    assert torch.allclose(q[0, :, 0], q[0, :1, 0].expand_as(q[0, :, 0]))
    with pytest.raises(ValueError, match="unknown head kind 'spiral'"):
        HeadParams(("spiral",), (1.0,))
    with pytest.raises(ValueError, match="2 kinds but 1 alignments"):
        HeadParams(("dense", "column"), (1.0,))
    with pytest.raises(ValueError, match="HeadParams for 2 heads, the geometry has 8"):
        pooled_qk(SMALL, seed=0, heads=HeadParams(("dense", "column"), (1.0, 1.0)))


# --- the default mix's table (docs/workloads.md, "Calibration") ----------------------------------


def test_the_docs_table_of_the_default_mix_is_the_generators():
    """A row of the table (HunyuanVideo, seed 0, cdf 0.9), recomputed as every row is made: one
    layer of ``synthetic_masks`` at the default mix, its density and pattern shares, then the
    shares without the dense control heads."""
    from pathlib import Path

    geom = preset("hunyuan-video")
    m = synthetic_masks(geom, 0.9, seed=0)[0.9]
    positional = [h for h, k in enumerate(head_kinds(geom, seed=0)) if k != "dense"]
    shares = [" / ".join(f"{v:.2f}" for v in M.pattern_shares(x, geom).values()) for x in (m, m[:, positional])]
    row = f"| hunyuan-video | 0 | 0.9 | {M.density(m):.3f} | {shares[0]} | {shares[1]} |"
    assert row in (Path(__file__).resolve().parents[1] / "docs" / "workloads.md").read_text()
