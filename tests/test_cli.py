"""The command line as a new user meets it: ``--help`` without torch, the ``--tiny`` trace path
of the docs, options that cannot apply refused (never ignored), the plots' and tables' labels.

Every case but the ``--help`` one calls ``sparsp.cli.main`` in this process (fast); bad input
files are in ``test_bad_input.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sparsp.geometry import VideoGeometry
from sparsp.workloads.traces import load_trace, save_trace

SMALL = VideoGeometry(frames=2, height=4, width=6, text_tokens=5, block_size=8, heads=2, head_dim=8)


def _main(capsys, *args):
    from sparsp.cli import main

    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own errors and --help
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _trace(tmp_path, geom=SMALL, layers=2):
    path = tmp_path / "trace.pt"
    n = geom.num_blocks
    masks = torch.rand(layers, geom.heads, n, n, generator=torch.Generator().manual_seed(1)) < 0.3
    save_trace(path, masks, geom, cdf_threshold=0.9, source="test")
    return path


# --- --help: no torch, Diffusers or matplotlib ---------------------------------------------------

HELP_CHECK = r"""
import sys
from sparsp.cli import main
heavy = ("torch", "diffusers", "matplotlib", "rich.table")
for argv in ([], ["analyze"], ["simulate"], ["trace"], ["bench"], ["bench", "attention"], ["bench", "e2e"],
             ["bench", "kernel"], ["bench", "transport"], ["bench", "report"], ["bench", "timeline"],
             ["calibrate"], ["density"]):
    try:
        main([*argv, "--help"])
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
    loaded = [m for m in heavy if m in sys.modules]
    assert not loaded, (argv, loaded)
print("LIGHT")
"""


def test_help_of_every_verb_imports_no_torch():
    """``sparsp --help`` and each verb's ``--help`` build their parsers from plain data
    (``sparsp.names``), so they answer without importing torch (9-13 s on a 2-core machine)."""
    run = subprocess.run([sys.executable, "-c", HELP_CHECK], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "LIGHT" in run.stdout, run.stderr[-2000:]
    for verb in ("analyze", "simulate", "trace", "bench", "calibrate", "density",
                 *(f"bench {v}" for v in ("attention", "e2e", "kernel", "transport", "report", "timeline"))):
        assert f"usage: sparsp {verb}" in run.stdout
    # each bench verb's description is its module's docstring, read without importing the module
    assert "One attention layer per strategy" in run.stdout and "End-to-end denoising steps" in run.stdout


def test_light_names_match_the_registries():
    from sparsp import names

    assert not [n for n in vars(names) if "STRATEG" in n.upper()]  # named only where they register
    from sparsp.cost.profiles import PROFILES
    from sparsp.integrations.models import PRESETS as MODEL_PRESETS
    from sparsp.placement import PLACEMENTS

    assert names.TRACE_MODELS == tuple(MODEL_PRESETS)
    assert names.PROFILE_NAMES == tuple(PROFILES)
    assert set(names.PLACEMENTS) == set(PLACEMENTS)


# --- trace --tiny, then analyze --trace, as the docs write them ----------------------------------


def test_tiny_trace_then_analyze_two_ranks(capsys, tmp_path):
    trace = tmp_path / "t.pt"
    code, out, err = _main(capsys, "trace", "--tiny", "--device", "cpu", "--out", trace)
    assert code == 0, err
    t = load_trace(trace)
    assert t.geometry.block_size == 8 and t.geometry.num_blocks >= 2  # --tiny's own block size
    code, out, err = _main(capsys, "analyze", "--trace", trace, "--ranks", 2, "--no-plots", "--out", tmp_path / "a")
    assert code == 0, err
    doc = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert doc["layers"] == t.masks.shape[0]  # every layer of the trace, not just the first


def test_trace_refuses_text_tokens_that_embeds_override(capsys, tmp_path):
    embeds = tmp_path / "e.pt"
    torch.save({"encoder_hidden_states": torch.zeros(1, 4, 16)}, embeds)
    code, out, err = _main(capsys, "trace", "--tiny", "--device", "cpu", "--embeds", embeds, "--text-tokens", 5,
                           "--out", tmp_path / "t.pt")
    assert code == 2 and "--text-tokens cannot apply: --embeds" in err and err.count("\n") == 1, err


def test_tiny_help_says_the_block_size(capsys):
    code, out, _ = _main(capsys, "trace", "--help")
    assert code == 0 and "--block-size 8 unless given" in "".join(out.split()).replace("unlessgiven", " unless given").replace("size8", "size 8")


@pytest.mark.parametrize("args, match", [
    (["--cdf", "1.5"], r"--cdf must lie in \[0, 1\], got 1.5"),
    (["--sim", "-0.1"], r"--sim must lie in \[0, 1\], got -0.1"),
    (["--block-size", "0"], "--block-size must be a positive number of tokens, got 0"),
    (["--frames", "0"], "--frames must be >= 1, got 0"),
    (["--subfolder", "x"], "--subfolder applies only with --pretrained"),
    (["--embeds", "{tmp}/missing.pt"], "--embeds {tmp}/missing.pt: no such file"),
    (["--pretrained", "{tmp}/no-such-model"], "--pretrained {tmp}/no-such-model: cannot load a WanTransformer3DModel"),
    (["--pretrained", "{tmp}"], "--pretrained {tmp}: cannot load a WanTransformer3DModel"),  # no config.json
    (["--device", "tpu"], "--device must be cpu, cuda, cuda:N or auto, got 'tpu'"),
    (["--out", "{tmp}"], "--out {tmp} is a directory"),
])
def test_trace_bad_arguments_one_line_exit_2(capsys, tmp_path, monkeypatch, args, match):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a --pretrained that is no directory: never the network
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = _main(capsys, "trace", "--tiny" if "--pretrained" not in args else "--dtype=fp32",
                           "--device", "cpu", *args, *([] if "--out" in args else ["--out", tmp_path / "t.pt"]))
    assert code == 2, (out, err)
    assert err.startswith("sparsp trace: error: ") and err.count("\n") == 1, err
    assert match.replace("{tmp}", str(tmp_path)) in err or __import__("re").search(
        match.replace("{tmp}", str(tmp_path)), err), err
    assert "Traceback" not in out + err


# --- analyze: an option that cannot apply is refused ---------------------------------------------


@pytest.mark.parametrize("extra, match", [
    (["--cdf", "0.5"], "--cdf cannot apply with --trace"),
    (["--model", "wan2.1-14b"], "--model cannot apply with --trace"),
    (["--seed", "3"], "--seed cannot apply with --trace"),
    (["--model", "ltx-2", "--cdf", "0.8"], "--model and --cdf cannot apply with --trace"),
    (["--layers", "3"], "--layers 3: the trace .* holds 2 layer"),
])
def test_analyze_refuses_options_a_trace_fixes(capsys, tmp_path, extra, match):
    import re

    code, out, err = _main(capsys, "analyze", "--no-plots", "--trace", _trace(tmp_path), "--ranks", 2,
                           "--out", tmp_path / "o", *extra)
    assert code == 2 and re.search(match, err) and err.count("\n") == 1, err


def test_analyze_trace_layers_and_cdf_shown_are_what_was_used(capsys, tmp_path):
    trace = _trace(tmp_path)  # 2 layers at cdf 0.9
    code, out, err = _main(capsys, "analyze", "--no-plots", "--trace", trace, "--ranks", 2, "--layers", 1,
                           "--out", tmp_path / "o")
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "analysis.json").read_text())
    assert doc["layers"] == 1 and {r["cdf"] for r in doc["results"]} == {0.9}
    assert "1 layer(s)" in " ".join(out.split())


def test_analyze_skips_head_sharded_strategy_where_heads_do_not_divide(capsys, tmp_path):
    """2 heads at G = 3: ``ulysses`` cannot run, so analyze reports no bytes for it (as
    ``simulate`` skips it) and says why."""
    code, out, err = _main(capsys, "analyze", "--no-plots", "--trace", _trace(tmp_path), "--ranks", 3,
                           "--out", tmp_path / "o")
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "analysis.json").read_text())
    assert "ulysses" not in {r["strategy"] for r in doc["results"]}
    assert doc["skipped"] == [{"strategy": "ulysses", "ranks": 3,
                               "reason": "needs heads divisible by G: 2 heads, G=3"}]
    assert "skipped ulysses at G=3: needs heads divisible by G" in " ".join(out.split())
    assert all(v["strategy"] != "ulysses" or v["ranks"] % 2 == 0 for v in doc["sweep"]["volume"])


def test_analyze_says_why_ulysses_fewest_bytes_is_not_the_answer(capsys, tmp_path):
    code, out, err = _main(capsys, "analyze", "--no-plots", "--trace", _trace(tmp_path), "--ranks", 2,
                           "--out", tmp_path / "o")
    assert code == 0, err
    text = " ".join(out.split())
    assert "compute max/mean" in text
    assert "ulysses: its bytes are Q, K, V and the output once per call whatever the mask" in text
    assert "cannot overlap the kernel" in text and "runs only where G divides the heads" in text
    doc = json.loads((tmp_path / "o" / "analysis.json").read_text())
    assert all(r["compute_max_over_mean"] >= 1.0 for r in doc["results"])


# --- analyze plots ------------------------------------------------------------------------------


def _plot_labels(monkeypatch):
    """The titles and legend labels of every figure ``analysis_plots.plot`` saves."""
    from sparsp import analysis_plots as analysis

    seen = {}
    save = analysis._save

    def record(fig, path):
        saved = save(fig, path)  # tight_layout, then the file
        ax = fig.axes[0]
        legend = ax.get_legend()
        seen[path.name] = {"title": ax.get_title(), "labels": [t.get_text() for t in legend.get_texts()],
                           "size": tuple(fig.get_size_inches()),
                           "tight": __import__("matplotlib.backends.backend_agg").backends.backend_agg.FigureCanvasAgg(fig) and fig.get_tightbbox()}
        return saved

    monkeypatch.setattr(analysis, "_save", record)
    return seen


def test_analyze_plots_keep_every_strategy_and_skip_an_empty_plot(capsys, tmp_path, monkeypatch):
    seen = _plot_labels(monkeypatch)
    code, out, err = _main(capsys, "analyze", "--trace", _trace(tmp_path), "--ranks", 2, "--placement", "periodic",
                           "--strategy", "ring", "ring-sparse", "sparsp", "--out", tmp_path / "o")
    assert code == 0, err
    labels = " ".join(seen["volume_vs_ranks.png"]["labels"])
    for s in ("ring", "ring-sparse", "sparsp"):  # ring and ring-sparse share a line: both named
        assert s in labels.replace("ring-sparse", "").split() or s == "ring-sparse" and "ring-sparse" in labels
    assert not (tmp_path / "o" / "relay_amplification.png").exists()
    assert "relay_amplification.png" not in seen
    assert "not drawn: relay_amplification.png" in " ".join(out.split())


def test_analyze_plot_titles_say_what_they_show_and_fit(capsys, tmp_path, monkeypatch):
    seen = _plot_labels(monkeypatch)
    trace = tmp_path / "long.pt"
    n = SMALL.num_blocks
    save_trace(trace, torch.ones(1, SMALL.heads, n, n, dtype=torch.bool), SMALL, cdf_threshold=0.9,
               source="random weights, tiny wan2.1-1.3b config (seed 0) " * 3)
    code, out, err = _main(capsys, "analyze", "--trace", trace, "--ranks", 2, "--out", tmp_path / "o")
    assert code == 0, err
    assert set(seen) == {"volume_vs_ranks.png", "sharing_curve.png", "relay_amplification.png"}
    for name, fig in seen.items():
        assert "analogue" not in fig["title"] and "Figure" not in fig["title"], fig["title"]
        width, height = fig["size"]
        box = fig["tight"]
        assert box.x0 >= -0.01 and box.x1 <= width + 0.01 and box.y1 <= height + 0.01, (name, box, fig["title"])
    assert "versus the number of ranks" in " ".join(seen["volume_vs_ranks.png"]["title"].split())


# --- simulate: the bottleneck label agrees with the row -------------------------------------------


def test_simulate_bottleneck_is_the_largest_part_and_has_a_legend(capsys, tmp_path):
    code, out, err = _main(capsys, "simulate", "--model", "wan2.1-1.3b", "--ranks", 2, 4, "--no-plots",
                           "--fabric", "pcie4-8gpu-nop2p", "--out", tmp_path / "s")
    assert code == 0, err
    doc = json.loads((tmp_path / "s" / "simulate.json").read_text())
    for r in doc["results"]:
        parts = {"compute": r["compute_ms"], "transfer": r["exposed_ms"], "fixed": r["fixed_ms"]}
        assert r["bottleneck"] == max(parts, key=parts.get), r
    text = " ".join(out.split())
    assert "bottleneck: the largest part of the slowest rank's time" in text
    assert "fixed (per-call fixed costs" in text


def test_simulate_plot_titles_fit(capsys, tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure

    boxes = []
    savefig = matplotlib.figure.Figure.savefig

    def record(fig, *args, **kwargs):
        ax = fig.axes[0]
        boxes.append((ax.get_title(), tuple(fig.get_size_inches()), __import__("matplotlib.backends.backend_agg").backends.backend_agg.FigureCanvasAgg(fig) and fig.get_tightbbox()))
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    long_fabric = tmp_path / ("a-profile-with-a-long-name-" * 3 + ".json")
    import dataclasses

    from sparsp.cost import PROFILES

    profile = dataclasses.asdict(PROFILES["pcie4-8gpu-nop2p"])
    profile["name"] = "a-calibrated-profile-of-a-machine-with-a-long-name-" * 2
    long_fabric.write_text(json.dumps(profile))
    code, out, err = _main(capsys, "simulate", "--model", "wan2.1-1.3b", "--ranks", 2, 4, "--fabric", long_fabric,
                           "--out", tmp_path / "s")
    assert code == 0, err
    assert len(boxes) == 2
    for title, (width, height), box in boxes:
        assert "versus the number of ranks" in " ".join(title.split())
        assert box.x0 >= -0.01 and box.x1 <= width + 0.01 and box.y1 <= height + 0.01, (title, box)


@pytest.mark.parametrize("extra, match", [
    (["--strategy", "ring", "ulysses", "--prefetch", "2"], "--prefetch applies to direct-routed strategies"),
    (["--strategy", "ulysses", "--no-local-first"], "--no-local-first applies to strategies that can compute"),
])
def test_simulate_refuses_options_no_chosen_strategy_uses(capsys, tmp_path, extra, match):
    code, out, err = _main(capsys, "simulate", "--model", "wan2.1-1.3b", "--ranks", 2, "--no-plots",
                           "--out", tmp_path / "s", *extra)
    assert code == 2 and match in err and err.count("\n") == 1, err


def test_analyze_says_how_to_get_enough_blocks_from_a_trace(capsys, tmp_path):
    one_block = VideoGeometry(frames=3, height=4, width=4, text_tokens=0, block_size=128, heads=2, head_dim=8)
    code, out, err = _main(capsys, "analyze", "--no-plots", "--trace", _trace(tmp_path, one_block, 1), "--ranks", 2,
                           "--out", tmp_path / "o")
    assert code == 2 and err.count("\n") == 1, err
    assert "2 ranks exceed the 1 blocks" in err and "record it with a smaller --block-size" in err, err


def test_unknown_strategy_is_refused_with_the_registered_names(capsys, tmp_path):
    from sparsp.cli import main
    from sparsp.strategies import strategy_names

    for argv in (["analyze", "--model", "ltx-video", "--ranks", "2", "--layers", "1", "--strategy", "nope",
                  "--no-plots", "--out", str(tmp_path)],
                 ["simulate", "--model", "ltx-video", "--ranks", "2", "--strategy", "nope", "--no-plots",
                  "--out", str(tmp_path)],
                 ["bench", "attention", "--strategy", "sparsp", "nope", "--out", str(tmp_path)],  # before any GPU
                 ["bench", "e2e", "--tiny", "--device", "cpu", "--strategy", "nope", "--out", str(tmp_path)]):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2, (argv[0], err)
        assert "nope" in err and all(name in err for name in strategy_names()), (argv[0], err)
        assert "Traceback" not in err
