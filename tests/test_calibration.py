"""Workloads calibrated to a per-head density profile: the token-density measure against a sort,
the directly drawn scores against the generator's, kinds by density rank, the fit within its
tolerance on a small geometry, unreachable targets reported, the JSON form round-tripping, the
committed fits refitted, ``sparsp calibrate``, and the masks following the fitted heads."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch

from cli_utils import run_cli

from sparsp.geometry import preset
from sparsp.workloads import DEFAULT_MIX, HeadMix, HeadParams, row_scores, synthetic_masks, token_qk
from sparsp.workloads import calibration as C
from sparsp.workloads.alignment import ALIGNMENT_RANGE
from sparsp.workloads.density import DensityProfile
from sparsp.workloads.scores import KeyCounter, token_density

# Small: 9 frames -> 3 latent frames of 12 x 20 = 720 tokens, 6 blocks of 128; 8 heads, 2 layers.
SMALL = dataclasses.replace(preset("wan2.1-1.3b", width=320, height=192, frames=9), heads=8, layers=2)


def _profile(steps=2, seed=0, lo=0.02, hi=0.5) -> DensityProfile:
    rng = random.Random(seed)
    grid = [[[round(rng.uniform(lo, hi), 4) for _ in range(SMALL.heads)] for _ in range(SMALL.layers)]
            for _ in range(steps)]
    return DensityProfile(source="toy", steps=steps, layers=SMALL.layers, heads=SMALL.heads, densities=grid)


@pytest.fixture(scope="module")
def fitted() -> C.Calibration:
    return C.calibrate(SMALL, _profile(), step=2, rows=96)


def _sorted_density(scores: torch.Tensor, mass: float) -> torch.Tensor:
    p = torch.softmax(scores.double(), -1).sort(-1, descending=True).values
    count = (p.cumsum(-1) < mass).sum(-1) + 1
    return (count.double() / scores.shape[-1]).mean(-1)


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 30.0, 3e4])
def test_token_density_matches_a_sort(scale):
    gen = torch.Generator().manual_seed(1)
    scores = scale * torch.randn(3, 16, 5000, generator=gen) + 1e5 * (scale > 100)  # a large top, exact
    got, want = token_density(scores, 0.95), _sorted_density(scores, 0.95)
    assert torch.allclose(got, want, rtol=0.01, atol=1 / 5000)


def test_tolerance_rule():
    assert C.tolerance(0.5) == pytest.approx(0.05)
    assert C.tolerance(0.001) == 0.002  # the absolute floor wins near 0


def test_kinds_by_density_rank_keep_the_mix():
    targets = [0.9, 0.01, 0.5, 0.2, 0.3, 0.05, 0.6, 0.4]
    mix = HeadMix(diagonal=0.25, multi_diagonal=0.25, column=0.25, dense=0.25)
    kinds = C.assign_kinds(targets, mix)
    assert kinds == ("dense", "column", "multi-diagonal", "diagonal", "diagonal", "column", "dense",
                     "multi-diagonal")
    default = C.assign_kinds([i / 40 for i in range(40)], DEFAULT_MIX)
    assert {k: default.count(k) for k in set(default)} == DEFAULT_MIX.counts(40)


def test_row_scores_are_the_generators_scores():
    """Noise-free, the directly drawn scores are ``token_qk``'s q·k/√D exactly: the tables over
    the grid, text keys, sinks and the heads without RoPE."""
    kinds = ("diagonal", "multi-diagonal", "column", "dense") * 2
    mix = dataclasses.replace(DEFAULT_MIX, noise=0.0, sinks=2)
    params = HeadParams(kinds, (0.7, 1.3, 0.5, 0.9, 1.0, 0.2, 1.1, 2.0))
    for geom in (SMALL, dataclasses.replace(preset("hunyuan-video", width=256, height=160, frames=9), heads=8)):
        q, k = token_qk(geom, seed=4, mix=mix, heads=params, dtype=torch.float64)
        rows = torch.tensor([0, 13, 400, geom.num_tokens - 1])  # the last: a text token for HunyuanVideo
        scores = row_scores(geom, kinds, seed=4, layer=0, rows=rows, noise_seed=0, mix=mix)
        for h, a in enumerate(params.alignment):
            want = q[0, rows, h] @ k[0, :, h].T / math.sqrt(geom.head_dim)
            assert torch.allclose(scores.scores(h, a).double(), want, rtol=1e-4, atol=1e-3)


def test_row_scores_have_the_generators_density():
    """With noise, each row's key noise is drawn as one number per key instead of q · (noise of
    every key): the density, over every row of a small geometry, is the generator's."""
    kinds = ("diagonal", "multi-diagonal", "column", "dense") * 2
    mix = dataclasses.replace(C.CALIBRATION_MIX, sinks=2)
    alignment = (1.2, 1.4, 0.1, 2.0, 0.9, 1.0, 0.05, 3.0)
    q, k = token_qk(SMALL, seed=2, mix=mix, heads=HeadParams(kinds, alignment))
    want = token_density(torch.einsum("shd,thd->hst", q[0], k[0]) / math.sqrt(SMALL.head_dim), 0.95)
    scores = row_scores(SMALL, kinds, seed=2, layer=0, rows=torch.arange(SMALL.num_tokens), noise_seed=0, mix=mix)
    got = torch.tensor([scores.density(h, a, 0.95, KeyCounter(SMALL.num_tokens)) for h, a in enumerate(alignment)],
                       dtype=torch.float64)
    assert want.min() < 0.05 and want.max() > 0.7  # sharp and flat heads both
    # within the sampling error: the generator's rows share one draw of the keys' noise
    assert torch.allclose(got, want.double(), rtol=0.05, atol=0.002), (got, want)


def test_fit_is_within_tolerance_on_another_sample(fitted):
    grid = _profile().step(2)
    assert fitted.step == 2 and len(fitted.layers) == SMALL.layers
    within = [h.within for ly in fitted.layers for h in ly.heads]
    assert sum(within) / len(within) >= 0.75
    for ly in fitted.layers:
        assert [h.target for h in ly.heads] == list(grid[ly.layer])
        assert all(h.reachable for h in ly.heads)
        # the fit itself lands within half the tolerance it aims for (or the closest it found)
        assert sum(abs(h.fit_density - h.target) <= C.tolerance(h.target) for h in ly.heads) >= 7
        assert ly.worst() in ly.heads and 0 <= ly.share_within() <= 1


def test_unreachable_targets_are_reported_not_clipped():
    targets = [0.999] + [0.2] * (SMALL.heads - 1)
    # with the default noise (1.0) the flattest a head can be is about 0.74 (C.CALIBRATION_MIX)
    fit = C.calibrate_layer(SMALL, targets, layer=0, rows=32, mix=DEFAULT_MIX)
    top = fit.heads[0]
    assert not top.reachable and not top.within and top.target == 0.999
    assert top.alignment == ALIGNMENT_RANGE[0]  # the nearest end: as dense as the knob goes
    assert top.density < 0.999 - C.tolerance(0.999)


COMMITTED = Path(__file__).resolve().parents[1] / "bench" / "results" / "density-profile"


@pytest.mark.parametrize("name, layer", [("calibration-wan2.1-14b-sparsity_wan_14B_t2v-stepmean.json", 7),
                                         ("calibration-hunyuan-video-sparsity_hunyuan10_13B_t2v-stepmean.json", 41)])
def test_a_refit_gives_the_committed_fit(name, layer):
    """One layer of each committed fit, fitted again as its command does (docs/workloads.md): the
    verified density within each head's tolerance of the file's, and the same flags."""
    cal = C.read_calibration(COMMITTED / name)
    committed = cal.layers[layer].heads
    fit = C.calibrate_layer(preset(cal.model), [h.target for h in committed], layer=layer, seed=cal.seed,
                            mix=cal.mix, mass=cal.mass, rows=cal.rows)
    same = [abs(new.density - old.density) <= C.tolerance(old.target) and (new.within, new.reachable) ==
            (old.within, old.reachable) for new, old in zip(fit.heads, committed)]
    assert sum(same) >= 0.98 * len(same), [h for h, ok in zip(committed, same) if not ok]


def test_json_round_trip_and_refusals(fitted, tmp_path):
    path = fitted.write(tmp_path / "cal.json")
    again = C.read_calibration(path, geometry=SMALL, source="toy", step=2)
    assert again == fitted
    assert again.head_params() == fitted.head_params()
    doc = json.loads(path.read_text())
    assert doc["layers"][0]["heads"][0].keys() >= {"kind", "alignment", "target", "density", "within"}
    with pytest.raises(ValueError, match="fitted for step 2, not mean over steps"):
        C.read_calibration(path, step=None)
    with pytest.raises(ValueError, match="fitted for source 'toy', not 'other'"):
        C.read_calibration(path, source="other")
    with pytest.raises(ValueError, match="8 heads per layer, hunyuan-video has 24"):
        C.read_calibration(path, geometry="hunyuan-video")
    doc["layers"][1]["heads"][3]["kind"] = "spiral"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"bad\.json: bad calibration .*unknown head kind 'spiral'"):
        C.read_calibration(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        C.read_calibration(bad)


def test_masks_follow_the_fitted_heads(fitted):
    heads = fitted.head_params()
    m = synthetic_masks(SMALL, 0.9, layers=2, seed=fitted.seed, heads=heads)[0.9]
    assert torch.equal(m, synthetic_masks(SMALL, 0.9, layers=2, seed=fitted.seed, heads=heads)[0.9])
    assert not torch.equal(m, synthetic_masks(SMALL, 0.9, layers=2, seed=fitted.seed)[0.9])
    with pytest.raises(ValueError, match="head parameters for only 2"):
        synthetic_masks(SMALL, 0.9, layers=3, heads=heads)


def test_profile_must_match_the_geometry():
    wrong = DensityProfile(source="w", steps=1, layers=2, heads=4, densities=[[[0.1] * 4] * 2])
    with pytest.raises(ValueError, match="2 layers x 4 heads"):
        C.calibrate(SMALL, wrong)


# --- sparsp calibrate ----------------------------------------------------------------------------


def test_calibrate_writes_the_fit_and_a_line_per_layer(capsys, tmp_path):
    profile, out = _ltx_profile(tmp_path), tmp_path / "fits" / "cal.json"
    code, stdout, err = run_cli(capsys, ["calibrate", profile, "--model", "ltx-video", "--layers", 2, "--rows", 8,
                                         "--step", 1, "--out", out])
    assert code == 0, err
    cal = C.read_calibration(out, geometry="ltx-video", source="toy-ltx", step=1)
    assert len(cal.layers) == 2 and cal.rows == 8
    lines = stdout.splitlines()
    # not a terminal: one line per layer as it is fitted, then the table
    assert [line.split(":")[0] for line in lines[:2]] == ["fitted layer 0 (1/2)", "fitted layer 1 (2/2)"]
    assert lines[2].startswith("| layer | heads within tolerance") and len(lines) == 2 + 2 + 2 + 1
    assert f"wrote {out}" in lines[-1]


@pytest.mark.parametrize("where, match", [("dir", "is a directory; give a file"), ("under-a-file", "is a file")])
def test_calibrate_refuses_an_unwritable_out_before_fitting(capsys, tmp_path, monkeypatch, where, match):
    monkeypatch.setattr(C, "calibrate", lambda *a, **k: pytest.fail("fitted before checking --out"))
    (tmp_path / "notes.txt").write_text("a file")
    out = tmp_path if where == "dir" else tmp_path / "notes.txt" / "cal.json"
    code, _, err = run_cli(capsys, ["calibrate", tmp_path / "missing.csv", "--model", "ltx-video", "--out", out])
    assert code == 2 and err.startswith("sparsp calibrate: error:") and match in err and err.count("\n") == 1


# --- sparsp analyze --density-profile ------------------------------------------------------------

LTX = preset("ltx-video")


def _ltx_profile(tmp_path, layers=LTX.layers, heads=LTX.heads):
    from sparsp.workloads.density import write_json

    rng = random.Random(3)
    grid = [[[round(rng.uniform(0.01, 0.6), 4) for _ in range(heads)] for _ in range(layers)] for _ in range(2)]
    path = tmp_path / "profile.json"
    write_json(DensityProfile(source="toy-ltx", steps=2, layers=layers, heads=heads, densities=grid), path)
    return path


def _stored_calibration(tmp_path, step=None, layers=2) -> str:
    """A calibration file as `calibrate` writes it, with made-up alignments (no fitting: fast)."""
    grid = [[0.05 + 0.01 * h for h in range(LTX.heads)]] * layers
    fits = tuple(C.LayerFit(layer=ly, heads=tuple(
        C.HeadFit(head=h, kind=k, alignment=0.5 + 0.02 * h, target=t, fit_density=t, density=t, reachable=True)
        for h, (k, t) in enumerate(zip(C.assign_kinds(row, C.CALIBRATION_MIX), row))))
        for ly, row in enumerate(grid))
    cal = C.Calibration(model="ltx-video", source="toy-ltx", step=step, mass=0.95, seed=0, rows=8,
                        mix=C.CALIBRATION_MIX, layers=fits)
    return str(cal.write(tmp_path / "cal.json"))


def _cli(capsys, *args):
    return run_cli(capsys, args)


def test_analyze_with_a_stored_calibration_reports_every_layer(capsys, tmp_path):
    profile, cal = _ltx_profile(tmp_path), _stored_calibration(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = _cli(capsys, "analyze", "--model", "ltx-video", "--density-profile", profile,
                             "--calibration", cal, "--layers", 2, "--ranks", 2, "--cdf", 0.9,
                             "--strategy", "ring", "sparsp", "--out", out)
    assert code == 0, err
    doc = json.loads((out / "analysis.json").read_text())
    assert doc["layers"] == 2 and doc["masks"] == "calibrated:toy-ltx (mean over steps)"
    assert doc["calibration"]["file"] == cal and not doc["calibration"]["fitted_now"]
    assert not (out / "calibration.json").exists()  # reused, not refitted
    per_layer = doc["per_layer"]
    assert {r["layer"] for r in per_layer} == {0, 1}
    assert len(per_layer) == 2 * 2 * 2  # layers x placements x strategies
    # the per-layer bytes sum to the model's (the existing summed rows)
    for r in doc["results"]:
        mine = [x for x in per_layer if x["placement"] == r["placement"] and x["strategy"] == r["strategy"]]
        assert sum(x["bytes_total"] for x in mine) == r["bytes_total"]
    for r in doc["imbalance"]:
        assert r["kept_max_over_mean"] >= 1.0 and r["recv_max_over_mean"] >= 1.0
    assert (out / "layers.png").exists()
    assert "calibration (read, " in stdout and "received bytes" in stdout
    # the masks are the calibrated heads' masks
    heads = C.read_calibration(cal).head_params()
    want = synthetic_masks(LTX, 0.9, layers=2, seed=0, mix=C.CALIBRATION_MIX, heads=heads)[0.9]
    from sparsp.masks import density
    assert doc["mask_stats"][0]["density"] == pytest.approx(density(want))


def test_analyze_fits_and_writes_the_calibration(capsys, tmp_path, monkeypatch):
    import sparsp.analysis as A

    # fewer sampled rows keep the test fast; the rule is the same
    monkeypatch.setattr(A.AnalyzeConfig, "__init__", _with_rows(A.AnalyzeConfig.__init__, 16))
    profile = _ltx_profile(tmp_path)
    out = tmp_path / "out"
    code, stdout, err = _cli(capsys, "analyze", "--model", "ltx-video", "--density-profile", profile,
                             "--step", 1, "--layers", 1, "--ranks", 2, "--cdf", 0.9, "--strategy", "sparsp",
                             "--no-plots", "--out", out)
    assert code == 0, err
    cal = C.read_calibration(out / "calibration.json", geometry="ltx-video", source="toy-ltx", step=1)
    assert len(cal.layers) == 1 and cal.rows == 16
    assert [h.target for h in cal.layers[0].heads] == list(DensityProfile.step(
        __import__("sparsp.workloads.density", fromlist=["read_profile"]).read_profile(profile), 1)[0])
    assert "calibration (fitted now, " in stdout
    assert stdout.startswith("fitted layer 0 (1/1): ")  # a line per layer: capsys is not a terminal


def _with_rows(init, rows):
    def patched(self, *args, **kwargs):
        kwargs.setdefault("calibration_rows", rows)
        init(self, *args, **kwargs)
    return patched


@pytest.mark.parametrize("extra, match", [
    (["--trace", "t.pt"], "--density-profile cannot apply with --trace"),
    (["--step", "3"], "step 3 outside 1..2"),
    (["--calibration", "CAL1"], "fitted for step 1, not mean over steps"),
])
def test_analyze_profile_refusals(capsys, tmp_path, extra, match):
    profile = _ltx_profile(tmp_path)
    extra = [_stored_calibration(tmp_path, step=1) if x == "CAL1" else x for x in extra]
    code, _, err = _cli(capsys, "analyze", "--model", "ltx-video", "--density-profile", profile, *extra,
                        "--layers", 1, "--no-plots", "--out", tmp_path / "o")
    assert code == 2 and err.startswith("sparsp analyze: error:") and match in err and len(err.splitlines()) == 1


def test_analyze_refuses_a_profile_of_another_model(capsys, tmp_path):
    profile = _ltx_profile(tmp_path, layers=3, heads=4)
    code, _, err = _cli(capsys, "analyze", "--model", "ltx-video", "--density-profile", profile,
                        "--no-plots", "--out", tmp_path / "o")
    assert code == 2 and len(err.splitlines()) == 1
    assert "3 layers x 4 heads, but preset ltx-video has 28 layers x 32 heads" in err
    code, _, err = _cli(capsys, "analyze", "--step", 2, "--no-plots", "--out", tmp_path / "o")
    assert code == 2 and "--step needs --density-profile" in err
