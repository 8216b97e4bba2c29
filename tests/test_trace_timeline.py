"""``sparsp bench timeline``: a profiled call's trace as host ranges and per-stream GPU work."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from cli_utils import run_cli


def _trace(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "call-r0.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _ev(name, cat, ts, dur, stream=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}
    if stream is not None:
        e["args"] = {"stream": stream}
    return e


def test_timeline_orders_each_streams_work_from_the_call_start(tmp_path, capsys):
    path = _trace(tmp_path, [
        _ev("bench.call", "user_annotation", 1000.0, 9000.0),
        _ev("sparsp.run", "user_annotation", 3000.0, 5000.0),
        _ev("flash_fwd", "kernel", 6500.0, 1200.0, stream=7),  # listed: ≥ 20 µs
        _ev("tiny", "kernel", 4000.0, 5.0, stream=7),  # counted, not listed
        _ev("Memcpy HtoD", "gpu_memcpy", 4200.0, 500.0, stream=37),
        _ev("aten::add", "cpu_op", 3100.0, 3.0),  # not a range: left out
    ])
    code, out, err = run_cli(capsys, ["bench", "timeline", path])
    assert code == 0, err
    assert "2.000 +   5.000  sparsp.run" in out
    assert "stream 7: 2 ops, busy 1.205 ms, span 3.000..6.700 ms" in out
    assert "5.500 +   1.200  flash_fwd" in out and "tiny" not in out
    assert "stream 37: 1 ops" in out and "aten::add" not in out
    # the tiny op is listed once the threshold allows it
    code, out, _ = run_cli(capsys, ["bench", "timeline", path, "--min-us", "1"])
    assert code == 0 and "tiny" in out


def test_timeline_rejects_what_is_not_a_call_trace(tmp_path, capsys):
    """One line naming the file and why, exit status 2, before any trace is printed."""
    good = _trace(tmp_path, [_ev("bench.call", "user_annotation", 0.0, 10.0)])
    empty = tmp_path / "empty-r0.json.gz"
    with gzip.open(empty, "wt") as f:
        json.dump({"traceEvents": [_ev("aten::add", "cpu_op", 0.0, 1.0)]}, f)
    text = tmp_path / "notes.json"
    text.write_text("not json")
    for argv, message in (([good, empty], f"{empty}: no bench.call range and no GPU events: not a profiled "
                                          "call's trace"),
                          ([good, text], f"{text}: not a readable Chrome trace (Expecting value"),
                          ([good, tmp_path / "missing.json.gz"], f"{tmp_path / 'missing.json.gz'}: no such file"),
                          ([good, "--min-us", "-1"], "--min-us must be >= 0, got -1")):
        code, out, err = run_cli(capsys, ["bench", "timeline", *argv])
        assert code == 2 and out == "" and err.count("\n") == 1, (argv, out, err)
        assert err.startswith("sparsp bench timeline: error: ") and message in err, err
