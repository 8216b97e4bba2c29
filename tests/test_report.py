"""``sparsp bench report``: the short table, the summary figure and the scaling figure of
attention result files (synthetic rows: what matters is which row lands where)."""

from __future__ import annotations

import json

import pytest

from cli_utils import run_cli
from sparsp.bench.report import scaling_plot, scaling_points, summary_plot


def _row(strategy, ranks, fabric, ms, transport="nccl", **extra):
    return {"model": "ltx-video", "ranks": ranks, "fabric": fabric, "strategy": strategy,
            "transport": transport, "placement": "periodic", "cdf": 0.9, "median_ms": ms,
            "bytes_moved": 1 << 30, "density": 0.5, "bound_ms": ms / 2, **extra}


def _file(tmp_path, machine, rows):
    path = tmp_path / f"attention-ltx-video-{machine}-2026-11-30.json"
    path.write_text(json.dumps({"kind": "attention", "machine": machine, "date": "2026-11-30",
                                "command": "sparsp bench attention", "rows": rows}))
    return str(path)


@pytest.fixture
def files(tmp_path):
    two = _file(tmp_path, "2xH200", [
        _row("sparsp", 2, "nvlink", 4.0), _row("sparsp", 2, "nvlink", 3.5, transport="ipc"),
        _row("ring", 2, "nvlink", 5.0), _row("sparsp", 2, "host", 6.0, transport="host"),
        _row("sparsp", 2, "nvlink", 1.0, ablation="+periodic placement"),  # not a strategy row
        _row("auto", 2, "nvlink", 1.0),  # auto is left out of the figures
        _row("1gpu-dense", 1, "nvlink", 8.0, transport="none"),
        _row("1gpu-sparse", 1, "nvlink", 6.5, transport="none")])
    four = _file(tmp_path, "4xH200", [
        _row("sparsp", 4, "nvlink", 2.5, transport="ipc"), _row("ring", 4, "nvlink", 3.0),
        _row("1gpu-dense", 1, "nvlink", 7.5, transport="none"),
        _row("sparsp", 4, "nvlink", 9.0, cdf=0.95)])  # another threshold
    return two, four


def test_scaling_points_take_each_strategys_fastest_transport_per_group_size(files):
    points = scaling_points(list(files))
    nv = points[("ltx-video", "nvlink")]
    assert nv["sparsp"] == {2: 3.5, 4: 2.5}  # ipc beat nccl at G = 2; cdf 0.95 and ablation ignored
    assert nv["ring"] == {2: 5.0, 4: 3.0}
    assert nv["1gpu-dense"] == {1: 7.5} and nv["1gpu-sparse"] == {1: 6.5}  # the fastest one-GPU row
    assert "auto" not in nv
    assert points[("ltx-video", "host")] == {"sparsp": {2: 6.0}}


def test_scaling_and_summary_figures_are_written(files, tmp_path):
    out = scaling_plot(list(files), tmp_path / "scaling.png")
    assert out.stat().st_size > 10_000
    assert summary_plot(list(files), tmp_path / "summary.png").stat().st_size > 10_000
    with pytest.raises(ValueError, match="no attention rows at cdf 0.5"):
        scaling_plot(list(files), tmp_path / "none.png", cdf=0.5)


def test_report_verb(files, tmp_path, capsys):
    """``sparsp bench report FILES [--plot OUT.png] [--scaling OUT.png]``: the table and the
    figures; what cannot be drawn or written is refused in one line (exit 2) before anything
    is printed."""
    code, out, err = run_cli(capsys, ["bench", "report", *files, "--scaling", tmp_path / "s.png",
                                      "--plot", tmp_path / "p.png"])
    assert code == 0, err
    assert "attention-ltx-video-2xH200-2026-11-30.json" in out and out.count("wrote") == 2
    assert (tmp_path / "s.png").exists() and (tmp_path / "p.png").exists()
    transport = tmp_path / "transport-all-x-2026-11-30.json"
    transport.write_text(json.dumps({"kind": "transport", "machine": "x", "date": "d", "rows": []}))
    with pytest.raises(ValueError, match="not a bench attention result"):
        scaling_points([str(transport)])
    for argv, message in (([*files, "--scaling"], "argument --scaling: expected one argument"),
                          ([], "the following arguments are required: RESULT.json"),
                          ([transport, "--scaling", tmp_path / "t.png"], "--scaling: " + str(transport)
                           + ": not a bench attention result"),
                          ([*files, "--plot", tmp_path], f"--plot {tmp_path} is a directory; give a file name"),
                          ([*files, "--plot", transport / "x.png"], f"{transport} is a file, not a directory")):
        code, out, err = run_cli(capsys, ["bench", "report", *argv])
        assert code == 2 and out == "" and message in err.strip().splitlines()[-1], (argv, err)
    code, out, _ = run_cli(capsys, ["bench", "report", "--help"])
    assert code == 0 and "--scaling OUT.png" in out and "--plot OUT.png" in out


def test_the_old_module_main_is_gone():
    """The report and the timeline are ``sparsp bench`` sub-verbs: no ``python -m`` main of their own."""
    from pathlib import Path

    import sparsp.bench

    for name in ("report", "timeline", "transport"):
        assert "__main__" not in (Path(sparsp.bench.__file__).parent / f"{name}.py").read_text(), name
