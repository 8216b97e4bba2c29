"""What ``sparsp analyze`` and ``sparsp trace`` (and ``sparsp.parallelize``) settle before their
work: a bad ``--out``, a missing optional package, a strategy that cannot run there — each one
line, exit status 2, before any work; and Ctrl-C: one line, exit 130, no partial output file.

The work itself is replaced by a stand-in that fails the test if it runs, and Ctrl-C by a
``KeyboardInterrupt`` raised where the command writes its files (in this process: fast).
The recipes' own checks are in ``test_examples.py``.
"""

from __future__ import annotations

import sys

import pytest
import torch

from cli_utils import run_cli
from sparsp.geometry import VideoGeometry
from sparsp.workloads.traces import save_trace

GEOM = VideoGeometry(frames=2, height=4, width=4, text_tokens=0, block_size=8, heads=2, head_dim=8)


def _small_trace(tmp_path):
    path = tmp_path / "small.pt"
    n = GEOM.num_blocks
    save_trace(path, torch.eye(n, dtype=torch.bool).expand(1, GEOM.heads, n, n), GEOM, cdf_threshold=0.9,
               source="test")
    return path


def _no_work(*args, **kwargs):
    raise AssertionError("the work ran before the check")


def _one_line(code, err, match):
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and match in err, err


def _left(tmp_path, keep=("small.pt", "file")) -> list[str]:
    """Every path under ``tmp_path`` the command wrote (temporary ones included)."""
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name not in keep)


# --- a bad --out, before the work ----------------------------------------------------------------


def test_analyze_bad_out_is_found_before_the_analysis(capsys, tmp_path, monkeypatch):
    from sparsp import analysis

    monkeypatch.setattr(analysis, "analyze", _no_work)
    (tmp_path / "file").write_text("x")
    for out, match in ((tmp_path / "file", "is a file; give a directory"),
                       (tmp_path / "file" / "sub", f"{tmp_path / 'file'} is a file, not a directory")):
        code, _, err = run_cli(capsys, ["analyze", "--no-plots", "--out", out])
        _one_line(code, err, match)
        assert err.startswith(f"sparsp analyze: error: --out {out}"), err


def test_trace_bad_out_is_found_before_the_model(capsys, tmp_path, monkeypatch):
    from sparsp.integrations import models

    monkeypatch.setattr(models, "build_transformer", _no_work)
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, ["trace", "--tiny", "--device", "cpu", "--out", tmp_path / "file" / "t.pt"])
    _one_line(code, err, "is a file, not a directory")


# --- a missing extra: one line naming it ---------------------------------------------------------


def test_trace_without_diffusers_names_the_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` fails as if not installed
    code, _, err = run_cli(capsys, ["trace", "--tiny", "--device", "cpu", "--out", tmp_path / "t.pt"])
    _one_line(code, err, 'sparsp trace needs diffusers, which is not installed: pip install -e ".[diffusers]"')


# --- Ctrl-C: one line, exit 130, nothing half-written --------------------------------------------


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_analyze_interrupted_during_the_work(capsys, tmp_path, monkeypatch):
    from sparsp import analysis

    monkeypatch.setattr(analysis, "analyze", _interrupt)
    code, out, err = run_cli(capsys, ["analyze", "--out", tmp_path / "o"])
    assert (code, err) == (130, "sparsp analyze: interrupted\n"), (out, err)
    assert _left(tmp_path) == []


def test_analyze_interrupted_while_writing_leaves_no_file(capsys, tmp_path, monkeypatch):
    """analysis.json is written before the plots: an interrupt in the plots takes it away too."""
    from sparsp import analysis_plots

    trace = _small_trace(tmp_path)

    def plot_then_interrupt(doc, out):
        (out / "volume_vs_ranks.png").write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(analysis_plots, "plot", plot_then_interrupt)
    out = tmp_path / "o"
    out.mkdir()
    code, _, err = run_cli(capsys, ["analyze", "--trace", trace, "--ranks", 2, "--out", out])
    assert (code, err) == (130, "sparsp analyze: interrupted\n"), err
    assert _left(tmp_path) == ["o"]  # the directory it was given, empty


def test_trace_interrupted_while_writing_leaves_no_file(capsys, tmp_path, monkeypatch):
    from sparsp.workloads import traces

    def save_then_interrupt(path, *args, **kwargs):
        path.write_bytes(b"PK\x03\x04 half")
        raise KeyboardInterrupt

    monkeypatch.setattr(traces, "save_trace", save_then_interrupt)
    code, _, err = run_cli(capsys, ["trace", "--tiny", "--device", "cpu", "--out", tmp_path / "t.pt"])
    assert (code, err) == (130, "sparsp trace: interrupted\n"), err
    assert _left(tmp_path) == []


# --- parallelize: auto needs a process group -----------------------------------------------------


def test_parallelize_refuses_auto_in_one_process():
    """``auto`` chooses per call from the group's demand; in one process it used to be accepted
    and fail at the first forward, inside the model."""
    pytest.importorskip("diffusers")
    import sparsp
    from sparsp.integrations.diffusers import runtime_of
    from sparsp.integrations.models import TINY, build_transformer

    model = build_transformer("wan", config=TINY["wan"], seed=0)
    processors = {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}
    for kwargs in ({}, {"emulate_ranks": 2}):
        with pytest.raises(ValueError, match=r"strategy='auto' picks a strategy per call .* one process "
                                             r"\(no process group, or emulate_ranks\) runs a fixed one: ring, "):
            sparsp.parallelize(model, strategy="auto", **kwargs)
    assert processors == {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}
    assert runtime_of(model) is None
