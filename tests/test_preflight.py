"""What ``sparsp analyze`` and ``sparsp trace`` (and ``sparsp.parallelize``) settle before their
work: a bad ``--out``, a missing optional package, a strategy that cannot run there — each one
line, exit status 2, before any work.

The work itself is replaced by a stand-in that fails the test if it runs (in this process: fast).
The recipes' own checks are in ``test_examples.py``.
"""

from __future__ import annotations

import sys

import pytest

from cli_utils import run_cli


def _no_work(*args, **kwargs):
    raise AssertionError("the work ran before the check")


def _one_line(code, err, match):
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err and match in err, err


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
