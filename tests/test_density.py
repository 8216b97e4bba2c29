"""sparsp.density: reading per-head density profiles (published CSV, sparsp JSON), checking them
against presets, and the summary figures, on small profiles generated here."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

from sparsp.workloads.density import (
    PROFILE_FORMAT,
    DensityProfile,
    read_csv,
    read_json,
    read_profile,
    write_json,
)
from sparsp.geometry import VideoGeometry, preset

STEPS, LAYERS, HEADS = 2, 3, 4


def value(s: int, ly: int, hd: int) -> float:
    """A distinct density per cell, so a cell read into the wrong place shows."""
    return round(0.01 * hd + 0.1 * ly + 0.001 * s + 0.0001 * (hd * ly), 6)


def rows(steps=STEPS, layers=LAYERS, heads=HEADS):
    return [(s, ly, hd, value(s, ly, hd)) for s in range(1, steps + 1)
            for ly in range(layers) for hd in range(heads)]


def write(path, data_rows, header="Step,Layer,Head,Sparsity"):
    lines = [header] + [",".join(str(c) for c in r) for r in data_rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_published_layout(tmp_path):
    # Rows shuffled and an extra column: the reader goes by column names and by (step, layer, head).
    data = rows()[::-1]
    path = tmp_path / "p.csv"
    path.write_text("Head,Step,Extra,Layer,Sparsity\n"
                    + "".join(f"{hd},{s},x,{ly},{d}\n" for s, ly, hd, d in data))
    p = read_csv(path)
    assert (p.steps, p.layers, p.heads, p.mass, p.source) == (STEPS, LAYERS, HEADS, 0.95, "p.csv")
    for s, ly, hd, d in data:
        assert p.densities[s - 1][ly][hd] == d
        assert p.step(s)[ly][hd] == d


def test_methods_against_reference(tmp_path):
    p = read_csv(write(tmp_path / "p.csv", rows()))
    assert p.step(2) == tuple(tuple(value(2, ly, hd) for hd in range(HEADS)) for ly in range(LAYERS))
    over = p.mean_over_steps()
    for ly in range(LAYERS):
        for hd in range(HEADS):
            assert over[ly][hd] == pytest.approx((value(1, ly, hd) + value(2, ly, hd)) / 2)
    for ly, m in enumerate(p.layer_means(step=1)):
        assert m == pytest.approx(sum(value(1, ly, hd) for hd in range(HEADS)) / HEADS)
    for ly, m in enumerate(p.layer_means()):
        assert m == pytest.approx(sum(over[ly]) / HEADS)
    for bad in (0, 3, True, 1.0):
        with pytest.raises(ValueError, match="step"):
            p.step(bad)

    flat = [d for *_, d in rows()]
    summary = p.summary(step=1)
    assert summary.mean == pytest.approx(sum(flat) / len(flat))
    assert summary.median == statistics.median(flat)
    assert (summary.min, summary.max) == (min(flat), max(flat))
    assert (summary.layer_mean_min, summary.layer_mean_max) == (min(p.layer_means()), max(p.layer_means()))
    ratios = [max(r) / (sum(r) / HEADS) for r in p.step(1)]
    assert summary.densest_over_layer_mean == pytest.approx(statistics.median(ratios))
    assert p.densest_over_layer_mean(2) == pytest.approx([max(r) / (sum(r) / HEADS) for r in p.step(2)])
    assert p.densest_over_layer_mean() == p.densest_over_layer_mean(1)
    # Step 2 is step 1 shifted by a constant: perfectly correlated; no later pair with 2 steps.
    assert summary.corr_first == pytest.approx(1.0)
    assert math.isnan(summary.corr_later_min)
    assert p.summary().step == 1  # the middle of 2 steps
    assert len(summary.lines()) == 5


def test_step_correlation_against_reference():
    grid = [[[0.1, 0.2], [0.3, 0.4]], [[0.4, 0.3], [0.2, 0.1]], [[0.2, 0.2], [0.3, 0.5]]]
    p = DensityProfile(source="t", steps=3, layers=2, heads=2, densities=grid)
    assert p.step_correlation(1, 2) == pytest.approx(-1.0)
    x, y = [0.4, 0.3, 0.2, 0.1], [0.2, 0.2, 0.3, 0.5]
    mx, my = sum(x) / 4, sum(y) / 4
    ref = (sum((a - mx) * (b - my) for a, b in zip(x, y))
           / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y)))
    assert p.summary().corr_later_min == pytest.approx(ref)
    assert p.summary().step == 2


def test_json_round_trip(tmp_path):
    p = read_csv(write(tmp_path / "p.csv", rows()), source="toy model", mass=0.9)
    write_json(p, tmp_path / "p.json")
    back = read_json(tmp_path / "p.json")
    assert back == p
    assert read_profile(tmp_path / "p.json") == p and read_profile(tmp_path / "p.csv") == \
        DensityProfile(source="p.csv", steps=p.steps, layers=p.layers, heads=p.heads, densities=p.densities)
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["format"] == PROFILE_FORMAT and doc["mass"] == 0.9 and doc["source"] == "toy model"
    # Lists in, tuples kept: equal whatever nesting type was passed.
    assert DensityProfile(source="toy model", steps=2, layers=3, heads=4, mass=0.9,
                          densities=doc["densities"]) == p


def test_check_preset(tmp_path):
    wan = preset("wan2.1-1.3b")
    grid = [[[0.5] * wan.heads for _ in range(wan.layers)]]
    p = DensityProfile(source="wan", steps=1, layers=wan.layers, heads=wan.heads, densities=grid)
    assert p.check_preset("wan2.1-1.3b") is p and p.check_preset(wan) is p
    with pytest.raises(
            ValueError,
            match=r"^wan: 30 layers x 12 heads, but preset wan2.1-14b has 40 layers x 40 heads$"):
        p.check_preset("wan2.1-14b")
    small = VideoGeometry(frames=2, height=2, width=2, heads=HEADS, layers=LAYERS, name="toy")
    path = write(tmp_path / "p.csv", rows())
    assert read_csv(path, expected=small).layers == LAYERS
    with pytest.raises(ValueError, match=r"p\.csv: 3 layers x 4 heads, but preset hunyuan-video"):
        read_csv(path, expected="hunyuan-video")
    write_json(read_csv(path), tmp_path / "p.json")
    with pytest.raises(ValueError, match=r"p\.json: 3 layers x 4 heads, but preset ltx-2"):
        read_json(tmp_path / "p.json", expected="ltx-2")


def one_line_error(call, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        call()
    assert "\n" not in str(info.value)
    return str(info.value)


CSV_ERRORS = [
    # (what is done to the rows, the header, the expected message)
    ("missing column", lambda r: [(s, ly, hd) for s, ly, hd, _ in r], "Step,Layer,Head",
     r"p\.csv:1: missing column 'Sparsity'"),
    ("non-numeric density", lambda r: r[:5] + [(1, 1, 1, "n/a")] + r[6:], None,
     r"p\.csv:7: column Sparsity is not a number: 'n/a'"),
    ("empty cell", lambda r: r[:2] + [(1, 0, 2, "")] + r[3:], None,
     r"p\.csv:4: column Sparsity is not a number: ''"),
    ("non-numeric index", lambda r: r[:3] + [(1, "zero", 3, 0.5)] + r[4:], None,
     r"p\.csv:5: column Layer is not a number: 'zero'"),
    ("fractional index", lambda r: r[:3] + [(1, 0, 2.5, 0.5)] + r[4:], None,
     r"p\.csv:5: column Head must be an integer >= 0, got '2.5'"),
    ("step 0", lambda r: [(0, 0, 0, 0.5)] + r, None,
     r"p\.csv:2: column Step must be an integer >= 1, got '0'"),
    ("nan", lambda r: r[:1] + [(1, 0, 1, "nan")] + r[2:], None,
     r"p\.csv:3: column Sparsity is not a finite number: 'nan'"),
    ("above 1", lambda r: r[:7] + [(1, 1, 3, 1.5)] + r[8:], None,
     r"p\.csv:9: Sparsity 1\.5 outside \[0, 1\]"),
    ("below 0", lambda r: r[:7] + [(1, 1, 3, -0.01)] + r[8:], None,
     r"p\.csv:9: Sparsity -0\.01 outside \[0, 1\]"),
    ("duplicate", lambda r: r + [r[4]], None,
     r"p\.csv:26: duplicate step 1, layer 1, head 0 \(first on line 6\)"),
    ("missing row", lambda r: r[:13] + r[14:], None,
     r"p\.csv: no row for step 2, layer 0, head 1 \(the file spans steps 1-2, layers 0-2, heads 0-3\)"),
    ("short row", lambda r: r[:2] + [(1, 0, 2)] + r[3:], None, r"p\.csv:4: 3 cells, the header has 4"),
    ("no data", lambda r: [], None, r"p\.csv: no data rows after the header"),
]


@pytest.mark.parametrize("name, edit, header, pattern", CSV_ERRORS, ids=[e[0] for e in CSV_ERRORS])
def test_csv_errors(tmp_path, name, edit, header, pattern):
    path = write(tmp_path / "p.csv", edit(rows()), header=header or "Step,Layer,Head,Sparsity")
    one_line_error(lambda: read_csv(path), pattern)


def test_not_csv_text(tmp_path):
    (tmp_path / "p.csv").write_text("")
    one_line_error(lambda: read_csv(tmp_path / "p.csv"), r"p\.csv:1: empty file")
    (tmp_path / "p.csv").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    one_line_error(lambda: read_csv(tmp_path / "p.csv"), r"p\.csv: not UTF-8 text")
    (tmp_path / "p.csv").write_text("Step,Layer,Head,Sparsity\n1,0,0,0.5\n1,0,\"1\n")
    one_line_error(lambda: read_csv(tmp_path / "p.csv"), r"p\.csv:3: not CSV \(unexpected end of data\)")
    # A byte-order mark before the header is not part of the first column's name.
    write(tmp_path / "bom.csv", rows(1, 1, 2), header="\ufeffStep,Layer,Head,Sparsity")
    assert read_csv(tmp_path / "bom.csv").heads == 2


def test_json_errors(tmp_path):
    good = read_csv(write(tmp_path / "p.csv", rows()))
    write_json(good, tmp_path / "good.json")
    doc = json.loads((tmp_path / "good.json").read_text())

    def case(change, pattern):
        path = tmp_path / "bad.json"
        path.write_text(change if isinstance(change, str) else json.dumps(change(dict(doc))))
        return one_line_error(lambda: read_json(path), r"bad\.json: " + pattern)

    case("{not json", r"not JSON")
    case(lambda d: {**d, "format": "other"}, r"not a sparsp-density-profile file")
    case(lambda d: {**d, "version": 9}, r"version 9")
    case(lambda d: {k: v for k, v in d.items() if k != "mass"}, r"missing keys mass")
    case(lambda d: {**d, "steps": 3}, r"2 steps of densities, expected 3")
    case(lambda d: {**d, "heads": 5}, r"step 1 layer 0 has 4 heads, expected 5")
    bad = json.loads(json.dumps(doc["densities"]))
    bad[1][2][3] = 1.25
    case(lambda d: {**d, "densities": bad}, r"step 2 layer 2 head 3: density 1\.25 outside \[0, 1\]")
    for wrong in ("x", "0.5", True, None):
        bad[1][2][3] = wrong
        case(lambda d: {**d, "densities": bad}, r"densities must be numbers nested \[step\]\[layer\]\[head\]")
    case(lambda d: {**d, "densities": "abc"}, r"densities must be numbers")
    case(lambda d: {**d, "source": 3}, r"source must be a string")
    case(lambda d: {**d, "mass": 0}, r"mass 0 outside")


def test_cli(tmp_path, capsys):
    from cli_utils import run_cli

    path = write(tmp_path / "p.csv", rows())
    code, _, err = run_cli(capsys, ["density", path, "--preset", "wan2.1-14b"])
    assert code == 2 and err.strip().splitlines() == [
        f"sparsp density: error: {path}: 3 layers x 4 heads, but preset wan2.1-14b has 40 layers x 40 heads"]
    code, out, _ = run_cli(capsys, ["density", path, "--write-json", tmp_path / "p.json"])
    assert code == 0 and out.startswith("p.csv: 2 steps x 3 layers x 4 heads, token-level density at 0.95")
    assert read_json(tmp_path / "p.json") == read_csv(path)
    bad = write(tmp_path / "bad.csv", rows()[:1] + [(1, 0, 1, 2.0)])
    code, _, err = run_cli(capsys, ["density", bad])
    assert code == 2 and err.count("\n") == 1 and "bad.csv:3: Sparsity 2.0 outside [0, 1]" in err


def test_imports_no_torch():
    # The profile tools run where torch is absent or slow to load; only the stdlib and the presets.
    import ast

    from sparsp.workloads import density

    tree = ast.parse(Path(density.__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    assert names <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)
