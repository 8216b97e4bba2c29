"""CPU smoke run of ``sparsp bench e2e`` (2 gloo processes, tiny model) as the docs write it
(``--tiny --device cpu``, no block size or output directory given): its plumbing — result file
name and kind, one row per strategy with the issue's fields, every parallel row run (the
tiny model's own block size gives each rank blocks), a failing baseline recorded as an error
row, fabric ``gloo``, the result outside the tracked ``bench/results``, the PNG."""

import argparse
import json
import os
import statistics
from pathlib import Path

import pytest

from dist_utils import run_distributed

pytest.importorskip("diffusers")

FIELDS = {"model", "ranks", "fabric", "strategy", "transport", "cdf", "density", "weights", "layers", "steps",
          "step_ms", "per_layer_ms", "attention_ms"}
STRATEGIES = ["1gpu-dense", "1gpu-sparse", "diffusers-ring", "ring-sparse", "ulysses", "sparsp"]
# The dense FLOPs of one tiny step's video self-attention, 4 · tokens² · heads · head dim per
# layer: Wan's 3x8x8 latent patchifies to 48 tokens (2 heads of 12, 2 layers); HunyuanVideo's
# joint attention adds its 8 text tokens (2 heads of 16; one dual and one single block).
STEP_FLOPS = {"wan2.1-14b": 2 * 4 * 48**2 * 24, "hunyuan-video": 2 * 4 * (48 + 8) ** 2 * 32}


def _bench_worker(rank, world, cwd, model, weights):
    from sparsp.cli import main

    os.chdir(cwd)  # the default --out is relative: results/bench here
    return main(["bench", "e2e", *model, "--tiny", "--device", "cpu", "--dtype", "fp32",
                 "--steps", "2", "--warmup", "1", "--weights", weights, "--strategy", *STRATEGIES])


@pytest.mark.parametrize("model, weights", [(None, "random"), ("hunyuan-video", "synthetic-structure")])
def test_bench_e2e_cpu_smoke(tmp_path, model, weights):
    import torch

    from sparsp.bench.e2e import diffusers_refusal

    argv = ["--model", model] if model else []  # None: the default model (Wan)
    kind = "hunyuan-video" if model else "wan"
    assert run_distributed(_bench_worker, 2, tmp_path, argv, weights, timeout=240) == [0, 0]
    preset = model or "wan2.1-14b"
    (path,) = tmp_path.glob("**/*.json")
    assert path.parent == tmp_path / "results" / "bench" and path.name.startswith(f"e2e-{preset}-cpu-")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "e2e" and doc["machine"] == "cpu"
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert list(rows) == STRATEGIES
    for name, r in rows.items():
        assert FIELDS <= set(r), (name, FIELDS - set(r))
        assert r["weights"] == weights and r["fabric"] == "gloo" and r["steps"] == 2
    # Diffusers' own context parallelism needs an accelerator, and HunyuanVideo has no plan for
    # it: the row records which, decided before trying
    ring = rows["diffusers-ring"]
    assert ring["step_ms"] is None and ring["error"] == diffusers_refusal("diffusers-ring", kind, torch.device("cpu"))
    assert ("no context-parallel plan" if model == "hunyuan-video" else "needs an accelerator") in ring["error"]
    layers = 2  # every tiny model has two blocks (HunyuanVideo: one dual, one single)
    for name in ("1gpu-dense", "1gpu-sparse", "ring-sparse", "ulysses", "sparsp"):
        r = rows[name]
        assert "error" not in r, (name, r.get("error"))
        assert r["layers"] == layers and len(r["step_ms_all"]) == 2, (name, r)  # --steps 2, each timed
        assert r["step_ms"] == pytest.approx(statistics.median(r["step_ms_all"]))
        assert r["per_layer_ms"] == pytest.approx(r["step_ms"] / layers)
        assert r["ranks"] == (1 if name.startswith("1gpu") else 2)
    densities = {rows[n]["density"] for n in ("1gpu-sparse", "ring-sparse", "ulysses", "sparsp")}
    assert len(densities) == 1 and 0 < densities.pop() < 1  # the masks every sparse row shares
    assert rows["1gpu-dense"]["density"] is None
    # the dense baseline at its best: every backend tried, the fastest that ran chosen, the
    # ones that cannot run on a CPU (cuDNN, flash-attn) recorded with why
    dense = rows["1gpu-dense"]
    tried = {t["backend"]: t for t in dense["backends_tried"]}
    ran = {b: t["step_ms"] for b, t in tried.items() if "error" not in t}
    assert "native" in ran and dense["attention_backend"] == min(ran, key=ran.get), tried
    assert "error" in tried["_native_cudnn"] and "error" in tried["flash"], tried
    # every rate is the step's attention FLOPs over its attention time: what the clock says
    # cancels out of the product, whatever the machine's speed (stored whole, never rounded)
    flops = STEP_FLOPS[preset]
    for t in [*(t for t in tried.values() if "error" not in t), dense]:
        assert t["attention_tflops"] * 1e12 * t["attention_ms"] * 1e-3 == pytest.approx(flops), t
    assert (rows["sparsp"].get("qk") == "synthetic") == (weights == "synthetic-structure")
    assert path.with_suffix(".png").stat().st_size > 1000


def _settled(*argv):
    from sparsp.bench.args import add_e2e
    from sparsp.bench.e2e import settle_arguments

    p = argparse.ArgumentParser()
    add_e2e(p)
    args = p.parse_args(list(argv))
    settle_arguments(args)
    return args


def test_tiny_defaults_give_way_to_given_values(monkeypatch):
    """``--tiny``: block size 8 and ``results/bench`` unless given; a full-size run keeps 128;
    a CPU run writes to ``results/bench`` too (never into the tracked ``bench/results``, which
    only a full-size GPU run writes to); a CPU run's fabric is ``gloo``."""
    tiny = _settled("--tiny", "--device", "cpu")
    assert (tiny.block_size, tiny.out, tiny.fabric) == (8, Path("results/bench"), "gloo")
    given = _settled("--tiny", "--device", "cpu", "--block-size", "16", "--out", "x")
    assert (given.block_size, given.out) == (16, Path("x"))
    full = _settled("--device", "cpu")
    assert (full.block_size, full.out, full.fabric) == (128, Path("results/bench"), "gloo")
    assert "ring-sparse" in full.strategy and "1gpu-dense" in full.strategy
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = _settled("--device", "cuda")
    assert (gpu.block_size, gpu.out, gpu.fabric) == (128, Path("bench/results"), "nvlink")
    assert _settled("--device", "cuda", "--tiny").out == Path("results/bench")


@pytest.mark.parametrize("argv, match", [
    (["--fabric", "nvlink"], "--fabric nvlink names a path between GPUs; a CPU run goes through gloo"),
    (["--strategy", "sparsp", "nope"], "--strategy: unknown name 'nope'; registered: 1gpu-dense, "),
    (["--device", "tpu"], "--device must be auto, cuda or cpu, got 'tpu'"),
])
def test_bad_arguments_one_line_exit_2(capsys, argv, match):
    from sparsp.strategies import strategy_names

    with pytest.raises(SystemExit) as e:
        _settled("--tiny", "--device", "cpu", *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("sparsp bench e2e: error: "), err
    assert match in err, err
    if "nope" in argv:
        assert all(n in err for n in strategy_names()), err


def test_pick_fastest_records_failures_and_takes_the_fastest():
    from sparsp.bench.backends import BackendFailed, pick_fastest

    def measure(name):
        if name == "broken":
            raise ValueError("needs a GPU\nsecond line")
        if name == "refused":
            raise BackendFailed("RuntimeError: refused on rank 1")
        return {"step_ms": {"slow": 3.0, "fast": 1.0, "mid": 2.0}[name]}

    best, tried = pick_fastest(["slow", "broken", "fast", "refused", "mid"], measure)
    assert best == "fast"
    assert tried == [{"backend": "slow", "step_ms": 3.0}, {"backend": "broken", "error": "ValueError: needs a GPU second line"},
                     {"backend": "fast", "step_ms": 1.0},
                     {"backend": "refused", "error": "RuntimeError: refused on rank 1"},
                     {"backend": "mid", "step_ms": 2.0}]
    with pytest.raises(RuntimeError, match="no dense attention backend ran: broken: ValueError: needs a GPU"):
        pick_fastest(["broken"], measure)


@pytest.mark.parametrize("valid_text", [None, 5])
def test_dense_hunyuan_gets_no_text_mask_when_every_token_is_valid(valid_text):
    """An all-valid text mask keeps cuDNN and flash from applying: the dense row's blocks get
    None in its place; a mask that masks something stays."""
    import torch

    from sparsp.bench.e2e_model import drop_all_valid_text_masks
    from sparsp.integrations.models import TINY, build_transformer, dummy_inputs

    model = build_transformer("hunyuan-video", config=TINY["hunyuan-video"], dtype=torch.float32, device="cpu")
    inputs = dummy_inputs(model, (3, 8, 8), text_tokens=8, seed=1, valid_text=valid_text)
    drop_all_valid_text_masks(model, inputs, "hunyuan-video", dense=True)
    seen = []
    for block in (*model.transformer_blocks, *model.single_transformer_blocks):
        block.register_forward_pre_hook(lambda m, args: seen.append(args[3]))
    with torch.no_grad():
        model(**inputs)
    assert len(seen) == 2
    assert all((mask is None) == (valid_text is None) for mask in seen), seen


@pytest.mark.parametrize("argv, match", [
    (["--step", "3"], "--step applies to --density-profile only"),
    (["--calibration", "c.json"], "--calibration applies to --density-profile only"),
    (["--density-profile", "p.csv", "--tiny"], "--tiny cannot apply"),
    (["--density-profile", "p.csv", "--latent", "3", "8", "8"], "--latent cannot apply"),
    (["--density-profile", "p.csv", "--weights", "random"], "--weights random cannot apply"),
])
def test_density_profile_options_that_cannot_apply(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        _settled("--device", "cpu", *argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and match in err, err


def test_a_density_profile_run_has_calibrated_weights_and_its_own_file_name():
    from sparsp.bench.e2e import _result_name

    args = _settled("--device", "cpu", "--density-profile", "dir/sparsity_x.csv", "--step", "4")
    assert args.weights == "synthetic-structure"
    assert _result_name(args) == "wan2.1-14b-sparsity_x-step4"
    assert _result_name(_settled("--device", "cpu", "--density-profile", "p.csv")) == "wan2.1-14b-p-stepmean"
    assert _result_name(_settled("--device", "cpu")) == "wan2.1-14b"


def test_calibrated_qk_follow_each_layer():
    """``synthetic_qk`` with a calibration: each layer its own fitted heads (the generator's q/k
    of that layer's parameters), cached per layer; a layer past the fit raises; without a
    calibration every layer shares one draw."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from sparsp.workloads import calibration as C
    from sparsp.bench.e2e_model import rope_for, synthetic_qk
    from sparsp.workloads.density import DensityProfile
    from sparsp.geometry import preset
    from sparsp.integrations.models import TINY, build_transformer
    from sparsp.workloads import token_qk

    model = build_transformer("wan", config=TINY["wan"], seed=0, dtype=torch.float32, device="cpu")
    heads, dim = model.config.num_attention_heads, model.config.attention_head_dim
    geom = dataclasses.replace(preset("wan2.1-1.3b", width=128, height=128, frames=5), heads=heads, head_dim=dim,
                               layers=2, rope=None)
    geom = dataclasses.replace(geom, rope=rope_for(model))
    grid = [[[0.05, 0.4][layer]] * heads for layer in range(2)]
    cal = C.calibrate(geom, DensityProfile(source="toy", steps=1, layers=2, heads=heads, densities=[grid]), rows=32)
    layout = SimpleNamespace(geometry=geom, attn_tokens=torch.arange(geom.num_tokens), cache={})
    like = torch.empty(1, geom.num_tokens, heads, dim)
    qk = synthetic_qk(model, 0, cal)
    q0, k0 = qk(layout, like, 0)
    q1, _ = qk(layout, like, 1)
    assert qk(layout, like, 0)[0] is q0  # made once per geometry and layer
    want, _ = token_qk(geom, seed=cal.seed, heads=cal.head_params()[1], mix=cal.mix, layer=1,
                       tokens=layout.attn_tokens)
    assert torch.equal(q1, want) and not torch.equal(q0, q1)
    with pytest.raises(ValueError, match="the calibration has 2 layers"):
        qk(layout, like, 2)
    plain = synthetic_qk(model, 0)
    layout.cache.clear()
    assert torch.equal(plain(layout, like, 0)[0], plain(layout, like, 1)[0])


def test_a_rate_is_stored_whole():
    """A tiny model's attention on a slow CPU runs at a few MFLOP/s: the row keeps the rate as
    measured (rounded to 4 decimals of TFLOP/s it read 0.0); rounding is for printing."""
    from sparsp.bench.backends import tflops

    assert tflops(442368.0, 66.6) == pytest.approx(442368.0 / 66.6e-3 / 1e12, rel=1e-12)
    assert tflops(442368.0, 0.0) is None and tflops(0.0, 1.0) is None
