"""``sparsp bench attention --density-profile FILE --layer L ...`` without a GPU: options that
cannot apply refused in one line (exit 2) before anything starts, the layer names resolved on
a small generated profile, the inputs of a layer from its calibrated heads (a fit written and
read back), and the result file named after the profile, in a folder of its own that the
lookups of a preset's results (``sparsp simulate --validate``) never read."""

from __future__ import annotations

import dataclasses
import json
import re
import types
from argparse import Namespace

import pytest
import torch

from sparsp.bench import attention, common, profile_layers
from sparsp.workloads.density import DensityProfile, write_json
from sparsp.geometry import preset

# 9 frames of 320 x 192 -> 3 x 12 x 20 = 720 tokens, 23 blocks of 32; 4 heads, 3 layers
SMALL = dataclasses.replace(preset("wan2.1-1.3b", width=320, height=192, frames=9), heads=4, layers=3,
                            block_size=32)
# [step][layer][head]: layer 0 sparse, 1 in between, 2 dense; at step 2 layers 0 and 1 swap
TOY = (((0.02, 0.03, 0.04, 0.05), (0.10, 0.15, 0.20, 0.25), (0.40, 0.50, 0.55, 0.60)),
       ((0.10, 0.12, 0.14, 0.16), (0.04, 0.05, 0.06, 0.07), (0.42, 0.48, 0.52, 0.58)))


def _toy(tmp_path, name="toy.json"):
    profile = DensityProfile(source="toy", steps=2, layers=3, heads=4, densities=TOY)
    write_json(profile, tmp_path / name)
    return profile, tmp_path / name


def _main(capsys, *argv):
    from sparsp.cli import main

    try:
        code = main(["bench", "attention", *map(str, argv)])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _preset_profile(tmp_path, model="ltx-video"):
    """A one-step profile of ``model``'s layers and heads (each layer's heads alike)."""
    g = preset(model)
    grid = [[[0.05 + 0.5 * ly / g.layers] * g.heads for ly in range(g.layers)]]
    path = tmp_path / f"{model}.json"
    write_json(DensityProfile(source=model, steps=1, layers=g.layers, heads=g.heads, densities=grid), path)
    return path


# --- refusals: one line, exit 2, before any GPU or fit ----------------------------------------


@pytest.mark.parametrize("extra, match", [
    (["--layer", "3"], "--layer applies with --density-profile only"),
    (["--step", "2"], "--step applies with --density-profile only"),
    (["--calibration", "c.json"], "--calibration applies with --density-profile only"),
    (["--density-profile", "{p}"], "--density-profile needs --layer"),
    (["--density-profile", "{p}", "--layer", "0", "--text"], "--text cannot apply with --density-profile"),
    (["--density-profile", "{p}", "--layer", "0", "--input-sets", "2"], "--input-sets cannot apply"),
    (["--density-profile", "{p}", "--layer", "0", "--calibration", "c.json", "--seed", "1"],
     "--seed cannot apply with --calibration"),
    (["--density-profile", "{p}", "--layer", "0", "1", "nope"], "expected a 0-based layer index or one of densest"),
    (["--density-profile", "{p}", "--layer", "-1"], "expected a 0-based layer index"),
    (["--density-profile", "{p}", "--layer", "28"], "--layer 28: ltx-video has layers 0 to 27"),
    (["--density-profile", "{p}", "--layer", "0", "--step", "2"], "step 2 outside 1..1"),
    (["--model", "wan2.1-14b", "--density-profile", "{p}", "--layer", "0"], "preset wan2.1-14b has 40 layers"),
    (["--density-profile", "{p}", "--layer", "densest", "--calibration", "{cal}"],
     "no fit of layer 27 \\(it holds 3, 5\\)"),
    (["--density-profile", "{p}", "--layer", "3", "--calibration", "{p}"], "not a sparsp-calibration file"),
])
def test_options_that_cannot_apply_are_refused(capsys, tmp_path, extra, match):
    from sparsp.workloads import calibration as C

    path = _preset_profile(tmp_path)
    g = preset("ltx-video")

    def fit(layer):
        return C.LayerFit(layer=layer, heads=tuple(
            C.HeadFit(head=h, kind="diagonal", alignment=1.0, target=0.1, fit_density=0.1, density=0.1,
                      reachable=True) for h in range(g.heads)))
    cal = C.Calibration(model=g.name, source="ltx-video", step=None, mass=0.95, seed=0, rows=8,
                        mix=C.CALIBRATION_MIX, layers=(fit(3), fit(5))).write(tmp_path / "cal.json")
    argv = [a.format(p=path, cal=cal) for a in extra]
    code, err = _main(capsys, "--model", "ltx-video", *argv, "--out", tmp_path / "out")
    assert code == 2 and "Traceback" not in err, err
    if not err.startswith("usage:"):  # argparse's own refusals (a bad --layer value) show the usage first
        assert err.count("\n") == 1 and err.startswith("sparsp bench attention: error:"), err
    assert re.search(match, err.splitlines()[-1]), err
    assert not (tmp_path / "out").exists()  # nothing fitted, nothing written


# --- the layers a name picks ------------------------------------------------------------------


def test_layer_names_pick_by_the_layers_mean_density(tmp_path):
    profile, _ = _toy(tmp_path)
    names = ["densest", "median", "sparsest"]
    # over the mean of the steps: layer means 0.0825, 0.115, 0.5125
    assert profile_layers.resolve_layers(profile, names) == [(2, "densest"), (1, "median"), (0, "sparsest")]
    # at step 2 layers 0 and 1 swap
    assert profile_layers.resolve_layers(profile, names, 2) == [(2, "densest"), (0, "median"), (1, "sparsest")]
    # each layer once, in the order asked, the first way it was asked for
    assert profile_layers.resolve_layers(profile, [1, "sparsest", 0, "densest", 2], 1) == [
        (1, None), (0, "sparsest"), (2, "densest")]
    # ties to the lower index; the lower median of an even number of layers
    flat = DensityProfile(source="flat", steps=1, layers=4, heads=1, densities=[[[0.3], [0.1], [0.3], [0.2]]])
    assert profile_layers.resolve_layers(flat, names) == [(0, "densest"), (3, "median"), (1, "sparsest")]
    with pytest.raises(ValueError, match="--layer 3: toy has layers 0 to 2"):
        profile_layers.resolve_layers(profile, [3])


# --- a layer's inputs from its calibrated heads -----------------------------------------------


def _block_density(q, k) -> float:
    from sparsp.masks import block_mask

    return float(block_mask(q, k, cdf_threshold=0.9, block_q=SMALL.block_size,
                            block_k=SMALL.block_size).float().mean())


def test_a_layers_inputs_come_from_its_calibrated_heads(tmp_path, capsys):
    from sparsp.workloads import calibration as C
    from sparsp.placement import make_placement
    from sparsp.workloads import token_qk

    profile, path = _toy(tmp_path)
    args = Namespace(density_profile=path, step=None, layer=["densest", "sparsest"], calibration=None, seed=None,
                     out=tmp_path / "out")
    workloads, extra = profile_layers.profile_workloads(args, SMALL, rows=48)
    printed = capsys.readouterr().out
    assert "calibrating layer 2 (densest)" in printed and "calibrating layer 0 (sparsest)" in printed
    assert "calibrating layer 1" not in printed  # only the asked layers are fitted
    written = tmp_path / "out" / "density-profile" / "calibration-wan2.1-1.3b-toy-stepmean-layer0_2.json"
    assert extra["calibration"] == str(written) and written.exists()
    means = profile.layer_means()
    assert [(w.layer, w.pick, w.density) for w in workloads] == [(2, "densest", means[2]), (0, "sparsest", means[0])]
    assert [w.row_fields()["layer"] for w in workloads] == [2, 0]
    assert extra["workload"] == workloads[0].row_fields()["workload"] == "density-profile"

    # the fit written is the fit read: a later run passes it and fits nothing
    again = Namespace(**{**vars(args), "calibration": written, "layer": [0, 2]})
    reread, _ = profile_layers.profile_workloads(again, SMALL)
    assert "calibrating" not in capsys.readouterr().out
    assert {w.layer: w.heads for w in reread} == {w.layer: w.heads for w in workloads}
    # a fit of chosen layers is not a fit of the first layers: analyze and e2e refuse it
    with pytest.raises(ValueError, match="layers must run 0, 1"):
        C.read_calibration(written)

    pl = make_placement("contiguous", SMALL, 2)
    masks = {}
    for w in workloads:
        parts = [attention.make_inputs(SMALL, pl, r, "cpu", torch.float32, 0, w) for r in range(2)]
        for r, (q, k, v) in enumerate(parts):  # this rank's share of the placed tokens, every head
            tokens = pl.perm[pl.token_slice(r)]
            assert q.shape == k.shape == v.shape == (1, len(tokens), SMALL.heads, SMALL.head_dim)
            # the layer's calibrated heads (its index, seed and mix), not drawn ones
            want = token_qk(SMALL, seed=w.seed, layer=w.layer, heads=w.heads, mix=w.mix, tokens=tokens)
            assert torch.equal(q, want[0]) and torch.equal(k, want[1])
        assert sum(p[0].shape[1] for p in parts) == SMALL.num_tokens
        q, k = (torch.cat([p[i] for p in parts], dim=1) for i in (0, 1))
        masks[w.pick] = _block_density(q, k)
    # the densest layer's heads make a denser mask than the sparsest layer's
    assert masks["densest"] > masks["sparsest"] + 0.05, masks
    drawn = attention.make_inputs(SMALL, pl, 0, "cpu", torch.float32, 0)
    assert not torch.equal(drawn[0], attention.make_inputs(SMALL, pl, 0, "cpu", torch.float32, 0, workloads[0])[0])


# --- the result file and the lookups of a preset's results ------------------------------------


class _Date(__import__("datetime").date):
    @classmethod
    def today(cls):
        return cls(2025, 3, 4)


def test_profile_results_have_their_own_file_that_preset_lookups_skip(tmp_path, monkeypatch):
    from sparsp.simulate.calibrate import newest
    from sparsp.simulate.job import discover_attention

    monkeypatch.setattr(common, "datetime", types.SimpleNamespace(date=_Date))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "results"
    preset_args = Namespace(out=out, density_profile=None, step=None)
    plain = attention.write_rows([{"strategy": "ring", "median_ms": 1.0}], "wan2.1-14b", preset_args, None)
    assert plain == out / "attention-wan2.1-14b-cpu-2025-03-04.json"
    fields = {"workload": "density-profile", "layer": 39, "layer_pick": "densest", "profile_density": 0.5}
    for step, name in ((None, "stepmean"), (7, "step7")):
        args = Namespace(out=out, density_profile=tmp_path / "sparsity_wan_14B_t2v.csv", step=step)
        path = attention.write_rows([{"strategy": "ring", "median_ms": 1.0, **fields}], "wan2.1-14b", args,
                                    {"workload": "density-profile", "step": step})
        assert path == out / "density-profile" / f"attention-wan2.1-14b-sparsity_wan_14B_t2v-{name}-cpu-2025-03-04.json"
        doc = json.loads(path.read_text())
        assert doc["workload"] == "density-profile" and doc["rows"][0]["layer"] == 39 and doc["step"] == step
    # what looks for a preset's results finds the preset's file only
    assert discover_attention(out) == [plain]
    assert newest("attention", out, per_subject=True) == [plain]
    assert "workload" not in json.loads(plain.read_text())
