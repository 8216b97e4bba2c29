"""``sparsp.bench.timeline``: a profiled call's trace as host ranges and per-stream GPU work."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sparsp.bench import timeline as tt


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
    assert tt.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "2.000 +   5.000  sparsp.run" in out
    assert "stream 7: 2 ops, busy 1.205 ms, span 3.000..6.700 ms" in out
    assert "5.500 +   1.200  flash_fwd" in out and "tiny" not in out
    assert "stream 37: 1 ops" in out and "aten::add" not in out
    # the tiny op is listed once the threshold allows it
    assert tt.main([str(path), "--min-us", "1"]) == 0
    assert "tiny" in capsys.readouterr().out


def test_timeline_rejects_what_is_not_a_call_trace(tmp_path, capsys):
    empty = _trace(tmp_path, [_ev("aten::add", "cpu_op", 0.0, 1.0)])
    assert tt.main([str(empty)]) == 1
    assert "not a profiled call's trace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tt.main([str(tmp_path / "missing.json.gz")])
    with pytest.raises(SystemExit):
        tt.main([str(empty), "--min-us", "-1"])
