"""``sparsp simulate --density-profile``: the whole model's step from per-layer calibrated masks —
every layer row the one-call prediction of its own masks, the model rows their sums, auto's
per-layer pick the runtime's rule, ulysses with contiguous and balanced heads, every built-in
profile by default, and the options that cannot apply refused in one line."""

from __future__ import annotations

import json

import pytest
from cli_utils import run_cli
from test_calibration import _ltx_profile, _stored_calibration

from sparsp.workloads.calibration import CALIBRATION_MIX, read_calibration
from sparsp.cost import Blocks, get_profile, measure, timeline, work
from sparsp.cost.balance import rank_loads
from sparsp.geometry import preset
from sparsp.names import PROFILE_NAMES
from sparsp.placement import make_placement
from sparsp.simulate.job import simulate_one
from sparsp.simulate.layers import SUMMED
from sparsp.strategies.auto import CANDIDATES, MARGIN, candidates
from sparsp.strategies.registry import strategy_names, strategy_spec
from sparsp.workloads import synthetic_masks

LTX = preset("ltx-video")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run on two layers of LTX-Video at G = 2 and 8, every built-in profile (the default)."""
    tmp = tmp_path_factory.mktemp("density")
    profile, cal = _ltx_profile(tmp), _stored_calibration(tmp)
    out = tmp / "out"
    from sparsp.cli import main

    code = main(["simulate", "--model", "ltx-video", "--density-profile", str(profile), "--calibration", cal,
                 "--layers", "2", "--ranks", "2", "8", "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "simulate.json").read_text())
    masks = synthetic_masks(LTX, 0.9, layers=2, seed=0, mix=CALIBRATION_MIX,
                            heads=read_calibration(cal).head_params())[0.9]
    return doc, masks, out


def test_every_builtin_profile_by_default_and_small_ones_skipped(run):
    doc, _, out = run
    assert doc["mode"] == "model" and doc["fabrics"] == list(PROFILE_NAMES) and doc["layers"] == 2
    assert doc["masks"] == "calibrated:toy-ltx (mean over steps)"
    seen = {(r["fabric"], r["ranks"]) for r in doc["results"]}
    for name in PROFILE_NAMES:
        gpus = get_profile(name).gpus
        assert ((name, 8) in seen) == (gpus >= 8) and (name, 2) in seen
        if gpus < 8:
            assert {"ranks": 8, "fabric": name, "reason": f"profile {name} has {gpus} GPUs"} in doc["skipped"]
    assert (out / "layers_ms.png").stat().st_size > 0


def test_layer_rows_are_the_one_call_prediction_of_their_own_masks(run):
    doc, masks, _ = run
    for r in doc["results"]:
        # the strategies as they run (ulysses: heads balanced, its contiguous row a comparison)
        if r["layer"] is None or r["strategy"] == "auto" or r.get("balanced") is False:
            continue
        if r["fabric"] not in ("pcie4-8gpu-nop2p", "h200x2-host"):
            continue
        one = simulate_one(masks[r["layer"]], LTX, r["strategy"], r["ranks"], get_profile(r["fabric"]))
        assert r["predicted_ms"] == one["predicted_ms"] and r["bytes_total"] == one["bytes_total"], r
        assert r["density"] == pytest.approx(float(masks[r["layer"]].float().mean()), abs=1e-4)


def test_model_rows_sum_the_layer_rows(run):
    doc, _, _ = run
    rows = doc["results"]
    model = [r for r in rows if r["layer"] is None]
    strategies = set(strategy_names()) | {"auto"}
    # one model row per (G, fabric, strategy), ulysses twice (contiguous and balanced heads)
    assert len(model) == sum(len(strategies) + 1 for fabric in doc["fabrics"] for G in (2, 8)
                             if get_profile(fabric).gpus >= G)
    for m in model:
        mine = [r for r in rows if r["layer"] is not None and r["ranks"] == m["ranks"]
                and r["fabric"] == m["fabric"] and r["strategy"] == m["strategy"]
                and r.get("balanced") == m.get("balanced")]
        assert sorted(r["layer"] for r in mine) == [0, 1] and m["layers"] == 2
        assert m["predicted_ms"] == pytest.approx(sum(r["predicted_ms"] for r in mine), abs=1e-3)
        if m["strategy"] == "auto":
            assert m["choices"] == [r["choice"] for r in sorted(mine, key=lambda r: r["layer"])]
        else:
            for k in SUMMED:
                assert m[k] == pytest.approx(sum(r[k] for r in mine), abs=1e-3), k
            assert m["kept_per_rank"] == [sum(x) for x in zip(*(r["kept_per_rank"] for r in mine))]
            busiest = (sum(max(r["kept_per_rank"]) for r in mine)
                       / sum(sum(r["kept_per_rank"]) / m["ranks"] for r in mine))
            assert m["step_kept_max_over_mean"] == pytest.approx(busiest, abs=1e-4)


def test_auto_picks_per_layer_the_fastest_candidate_within_margin(run):
    doc, _, _ = run
    autos = [r for r in doc["results"] if r["strategy"] == "auto" and r["layer"] is not None]
    assert autos
    for r in autos:
        times = r["candidates_ms"]
        assert tuple(times) == candidates(LTX.heads, r["ranks"])
        best = min(times.values())
        assert r["predicted_ms"] == times[r["choice"]] <= best * (1 + MARGIN)
        # the first candidate, in auto's order of preference, within the margin
        assert r["choice"] == next(s for s in CANDIDATES if s in times and times[s] <= best * (1 + MARGIN))


def test_ulysses_balanced_heads_beside_contiguous(run):
    doc, masks, _ = run
    by = {}
    for r in doc["results"]:
        if r["strategy"] == "ulysses" and r["layer"] is not None:
            by[(r["fabric"], r["ranks"], r["layer"], r["balanced"])] = r
    assert by
    for (fabric, G, layer, balanced), r in by.items():
        kept = masks[layer].sum(dim=(1, 2)).tolist()
        order = r.get("head_order")
        assert r["kept_per_rank"] == rank_loads(kept, G, order)
        if not balanced:
            continue
        plain = by[(fabric, G, layer, False)]
        assert r["kept_max_over_mean"] <= plain["kept_max_over_mean"]
        assert r["bytes_total"] == plain["bytes_total"]  # the same all-to-all
        # the balanced row is the cost model's all-to-all with that head order
        prof = get_profile(fabric)
        d = measure(masks[layer], Blocks.of(make_placement("contiguous", LTX, G)), relay=True)
        w = work(strategy_spec("ulysses"), d, head_dim=LTX.head_dim, profile=prof, head_order=tuple(order))
        assert r["predicted_ms"] == round(timeline(w, prof, head_dim=LTX.head_dim).latency_ms, 4)
    for b in doc["balance"]:
        for part in ("model", "densest_layer", "largest_gain_layer"):
            f = b[part]
            assert f["gain"] == pytest.approx(1 - f["balanced_ms"] / f["contiguous_ms"], abs=1e-4)
        assert b["costly"] == (max(b["model"]["gain"], b["densest_layer"]["gain"]) > 0.10)
        layer = b["densest_layer"]["layer"]
        assert layer == max(range(2), key=lambda i: (int(masks[i].sum()), -i))


@pytest.mark.parametrize("extra, message", [
    (["--validate"], "--validate cannot apply with --density-profile"),
    (["--text"], "--text cannot apply with --density-profile"),
    (["--fit-profile", "T.json"], "--fit-profile fits one profile: give one --fabric with it"),
    (["--layers", "0"], "--layers must be >= 1, got 0"),
    (["--layers", "29"], "--layers 29: ltx-video has 28 layers"),
    (["--step", "3"], "step 3 outside 1..2"),
    (["--fabric", "h200x2-host", "--ranks", "4"], "--ranks 4 exceeds the 2 GPUs of profile h200x2-host"),
])
def test_options_that_cannot_apply_are_refused(extra, message, capsys, tmp_path):
    profile, cal = _ltx_profile(tmp_path), _stored_calibration(tmp_path)
    if "T.json" in extra:
        (tmp_path / "T.json").write_text(json.dumps({"kind": "transport", "rows": []}))
        extra = [str(tmp_path / "T.json") if x == "T.json" else x for x in extra]
    code, _, err = run_cli(capsys, ["simulate", "--model", "ltx-video", "--density-profile", profile,
                                    "--calibration", cal, *extra, "--no-plots", "--out", tmp_path / "o"])
    assert code == 2 and err.startswith("sparsp simulate: error:") and len(err.splitlines()) == 1, err
    assert message in err, err


@pytest.mark.parametrize("extra, message", [
    (["--step", "2"], "--step needs --density-profile"),
    (["--layers", "2"], "--layers needs --density-profile"),
    (["--fabric", "all"], "several profiles need --density-profile"),
    (["--fabric", "pcie4-8gpu-p2p", "pcie5-8gpu-p2p"], "several profiles need --density-profile"),
])
def test_profile_options_need_a_density_profile(extra, message, capsys, tmp_path):
    code, _, err = run_cli(capsys, ["simulate", "--model", "ltx-video", *extra, "--no-plots",
                                    "--out", tmp_path / "o"])
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_fits_the_calibration_once_and_writes_it(capsys, tmp_path, monkeypatch):
    from test_calibration import _with_rows

    import sparsp.analysis as A

    # fewer sampled rows keep the test fast; the rule is the same
    monkeypatch.setattr(A.AnalyzeConfig, "__init__", _with_rows(A.AnalyzeConfig.__init__, 16))
    profile, out = _ltx_profile(tmp_path), tmp_path / "out"
    code, stdout, err = run_cli(capsys, ["simulate", "--model", "ltx-video", "--density-profile", profile,
                                         "--step", 2, "--layers", 1, "--ranks", 2, "--fabric", "pcie4-8gpu-nop2p",
                                         "--strategy", "sparsp", "--no-plots", "--out", out])
    assert code == 0, err
    cal = read_calibration(out / "calibration.json", geometry="ltx-video", source="toy-ltx", step=2)
    doc = json.loads((out / "simulate.json").read_text())
    assert doc["density_calibration"]["fitted_now"] and len(cal.layers) == 1
    assert doc["fabrics"] == ["pcie4-8gpu-nop2p"] and doc["masks"] == "calibrated:toy-ltx (step 2)"
    assert {r["strategy"] for r in doc["results"]} == {"sparsp", "auto"}
    assert "wrote" in stdout and "calibration.json" in " ".join(stdout.split())
