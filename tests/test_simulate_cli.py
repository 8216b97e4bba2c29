"""``sparsp simulate``'s command line: the renamed ``--fit-profile`` and the machines it fits
to, the G a profile holds by default, the columns' names, ``--count-ops``."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_utils import run_cli
from test_simulate import _kernel_file, _transport_file

from sparsp.cost import PROFILES
from sparsp.simulate import calibrate as fit
from sparsp.simulate.job import default_ranks

LTX = ["--model", "ltx-video", "--no-plots"]


def _results(tmp_path, names: dict[str, str]):
    """``bench/results`` under ``tmp_path`` with a transport or kernel file under each name
    (``names``: file name → ``machine`` field, or "" for a file that records none)."""
    root = tmp_path / "bench" / "results"
    root.mkdir(parents=True)
    for name, machine in names.items():
        made = (_transport_file if name.startswith("transport") else _kernel_file)(tmp_path)
        doc = json.loads(made.read_text())
        if machine:
            doc["machine"] = machine
        else:
            doc.pop("machine")
        (root / name).write_text(json.dumps(doc))
        made.unlink()
    return root


# --- --fit-profile ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [[], ["t.json"], ["t.json", "k.json"]])
def test_the_old_spelling_is_refused_naming_the_new_one(capsys, tmp_path, tail):
    code, out, err = run_cli(capsys, ["simulate", *LTX, "--calibrate", *tail, "--out", tmp_path / "o"])
    assert code == 2 and err == "sparsp simulate: error: --calibrate is now --fit-profile (CHANGELOG.md)\n", err
    assert not (tmp_path / "o").exists()
    code, out, err = run_cli(capsys, ["simulate", "--help"])
    assert code == 0 and "--fit-profile" in out and "--calibrate" not in out


@pytest.mark.parametrize("name, machine, shown", [
    ("kernel-all-cpu-2026-12-05.json", "cpu", "cpu"),  # a CPU run of bench kernel
    ("kernel-all-1xH100-2026-12-05.json", "", "1xH100"),  # no field: the name says it
    ("kernel.json", "1xH10080GBHBM3", "1xH10080GBHBM3"),
])
def test_a_result_of_another_machine_is_refused_naming_the_file(capsys, tmp_path, name, machine, shown):
    root = _results(tmp_path, {"transport-all-2xH200-2026-11-30.json": "2xH200", name: machine})
    transport, other = root / "transport-all-2xH200-2026-11-30.json", root / name
    code, out, err = run_cli(capsys, ["simulate", *LTX, "--fabric", "h200x2-host", "--ranks", 2,
                                      "--fit-profile", transport, other, "--out", tmp_path / "o"])
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err == (f"sparsp simulate: error: --fit-profile {other}: measured on {shown}, but profile h200x2-host "
                   f"describes H200 GPUs; fit a profile to results of its own machine\n"), err
    assert not (tmp_path / "o").exists()  # refused before any work
    with pytest.raises(ValueError, match=f"{other}: measured on {shown}"):  # the library refuses too
        fit.calibrate(PROFILES["h200x2-host"], [transport, other])


def test_the_fit_prints_its_files_and_finds_only_the_profiles_machine(capsys, tmp_path, monkeypatch):
    """No file named: the newest transport and kernel files of the profile's GPU; a newer CPU
    kernel file (``bench kernel --device cpu``) and an H100 one are passed over, and every
    file used is printed."""
    root = _results(tmp_path, {"transport-all-2xH200-2026-11-30.json": "2xH200",
                               "kernel-all-1xH200-2026-12-01.json": "1xH200",
                               "kernel-all-cpu-2026-12-05.json": "cpu",
                               "kernel-all-1xH100-2026-12-04.json": "1xH100"})
    # what was taken before: the newest kernel file of any machine
    assert [p.name for p in fit.discover_calibration(root)][-1] == "kernel-all-cpu-2026-12-05.json"
    want = ["transport-all-2xH200-2026-11-30.json", "kernel-all-1xH200-2026-12-01.json"]
    assert [p.name for p in fit.discover_calibration(root, PROFILES["h200x2-host"])] == want
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, ["simulate", *LTX, "--fabric", "h200x2-host", "--ranks", 2, "--fit-profile",
                                      "--out", tmp_path / "o"])
    assert code == 0, err
    lines = [line for line in out.splitlines() if line.startswith("fitting ")]
    assert lines == ["fitting h200x2-host to bench/results/transport-all-2xH200-2026-11-30.json (transport, 2xH200)",
                     "fitting h200x2-host to bench/results/kernel-all-1xH200-2026-12-01.json (kernel, 1xH200)"]
    doc = json.loads((tmp_path / "o" / "simulate.json").read_text())
    assert [p.rsplit("/", 1)[-1] for p in doc["calibration"]["files"]] == want
    shutil.rmtree(root)
    root.mkdir()
    (root / "kernel-all-cpu-2026-12-05.json").write_text("{}")
    code, out, err = run_cli(capsys, ["simulate", *LTX, "--fabric", "h200x2-host", "--ranks", 2, "--fit-profile",
                                      "--out", tmp_path / "o2"])
    assert code == 2 and "--fit-profile found no transport-*.json of H200 GPUs (profile h200x2-host)" in err


def test_machines_and_gpus():
    assert fit.profile_gpu(PROFILES["h200x2-nvlink"]) == "H200"
    assert fit.profile_gpu(PROFILES["pcie5-8gpu-p2p"]) == "RTX PRO 6000 Blackwell"
    assert fit.same_gpu("8xRTXPRO6000BlackwellServerEdition", "RTX PRO 6000 Blackwell")
    assert fit.same_gpu("2xH200", "H200") and fit.same_gpu("1xH10080GBHBM3", "H100")
    assert not fit.same_gpu("1xH200", "H20") and not fit.same_gpu("cpu", "H200")
    assert not fit.same_gpu("4xH100", "H200")
    assert fit.machine_of("bench/results/kernel-all-4xH100-2026-12-05.json") == "4xH100"
    assert fit.machine_of("kernel.json") is None
    assert fit.machine_of("kernel.json", {"machine": "cpu"}) == "cpu"


# --- the G a profile holds, the columns -----------------------------------------------------------


def test_default_ranks_are_those_the_profile_holds(capsys, tmp_path):
    assert default_ranks(2) == (2,) and default_ranks(4) == (2, 4) and default_ranks(8) == (2, 4, 8)
    with pytest.raises(ValueError, match="a profile of 1 GPU"):
        default_ranks(1)
    code, out, err = run_cli(capsys, ["simulate", *LTX, "--fabric", "h200x2-nvlink", "--strategy", "ring", "sparsp",
                                      "--out", tmp_path / "o"])
    assert code == 0, err
    doc = json.loads((tmp_path / "o" / "simulate.json").read_text())
    assert doc["ranks"] == [2] and {r["ranks"] for r in doc["results"]} == {2}


def test_the_one_gpu_column_says_what_it_is_relative_to(capsys, tmp_path):
    code, out, err = run_cli(capsys, ["simulate", *LTX, "--fabric", "h200x2-nvlink", "--strategy", "sparsp",
                                      "--out", tmp_path / "o"])
    assert code == 0, err
    header = next(line for line in out.splitlines() if "strategy" in line and "┃" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]][4:6] == ["vs ring", "vs 1-GPU sparse"]
    text = " ".join(out.split())
    assert "vs 1-GPU sparse: the one-GPU sparse call's ms (below) over this row's, not dense attention's" in text
    assert "one GPU, cdf 0.9: sparse (sparsp on a group of one)" in text


# --- --count-ops -----------------------------------------------------------------------------------


def test_count_ops_prints_the_counts_at_the_ranks_asked(capsys, monkeypatch):
    from sparsp.simulate import opcount

    asked = []
    monkeypatch.setattr(opcount, "report", lambda ranks: asked.append(ranks) or iter(["MASK_OPS = (1, 2, 3)"]))
    code, out, err = run_cli(capsys, ["simulate", "--count-ops"])
    assert code == 0 and out == "MASK_OPS = (1, 2, 3)\n" and asked == [(2, 3, 4, 6)], err
    code, out, err = run_cli(capsys, ["simulate", "--count-ops", "--ranks", 2, 4])
    assert code == 0 and asked[-1] == (2, 4)


@pytest.mark.parametrize("extra, message", [
    (["--model", "ltx-video"], "--model cannot apply with --count-ops"),
    (["--fabric", "h200x2-host", "--no-plots"], "--fabric --no-plots cannot apply with --count-ops"),
    (["--ranks", "5"], "--ranks 5: --count-ops counts on 12 heads; each G must divide them"),
])
def test_count_ops_refuses_what_cannot_apply(capsys, extra, message):
    code, out, err = run_cli(capsys, ["simulate", "--count-ops", *extra])
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_count_ops_report_fits_every_constant(monkeypatch):
    """``opcount.report`` on counts made up so each point grows by a known polynomial in G − 1:
    every constant comes out fitted and exact; the all-to-all, which runs in order whatever the
    config, has no early ops (the report once failed on its None)."""
    from sparsp.simulate import opcount
    from sparsp.strategies.registry import strategy_spec

    def counts(G: int, jobs):
        out = []
        for s, units, lf in jobs:
            early = lf and strategy_spec(s).local_first
            read = 100 + 10 * (G - 1) + units
            out.append({"read": read, "wait": read + 3, "resolved": read + 7 + (G - 1), "stage": 20,
                        "kernels": ([read + 1] if early else []) + [read + 9 + G, read + 30 + 5 * G],
                        "fetches": [read + 8 + G], "total": read + 40 + 5 * G})
        return out

    monkeypatch.setattr(opcount, "count", counts)
    lines = list(opcount.report((2, 3, 4, 6)))
    fitted = [line for line in lines if line.startswith(("MASK_OPS", "FINISH_OPS", "EARLY_OPS", "RUN_OPS"))]
    assert fitted and not [line for line in lines if "NOT exact" in line or "three G or more" in line]
    assert "MASK_OPS['direct'] (in order) = (101, 10, 0)" in lines
    assert "FINISH_OPS['dense'] (local first) = (4, 1, 0)" in lines
    assert "EARLY_OPS['direct'] before the local launch = (1, 0, 0)" in lines
    assert not [line for line in lines if line.startswith("EARLY_OPS['all-to-all']")]
