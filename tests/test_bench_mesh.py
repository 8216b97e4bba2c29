"""``--mesh`` of ``bench attention`` and ``bench e2e`` on this CPU (gloo).

``--mesh`` is parsed without torch and refused in one line where it cannot apply, before any
process group: cfg for one attention call, sizes that do not make the world, Ulysses groups
that do not divide the heads, ``diffusers-unified`` without a mesh. ``bench attention --mesh
ulysses=2`` on 2 ranks (its GPU-only pieces stood in for, as ``test_bench_failures`` does)
writes mesh rows named apart, with the all-to-alls' bytes; ``--mesh ulysses=1`` on one rank
times the mesh path on a mesh of one beside the flat one-GPU call. ``bench e2e --tiny --mesh
cfg=2`` on 2 ranks runs the sparsp rows on the mesh with every row's step carrying two
branches, and records why ``diffusers-unified`` cannot run on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os

import pytest

from cli_utils import run_cli
from dist_utils import run_distributed

pytest.importorskip("diffusers")


def test_mesh_argument_parses_names_and_sizes():
    from sparsp.bench.args import mesh_arg

    assert mesh_arg("cfg=2,ulysses=4") == {"cfg": 2, "ulysses": 4}
    assert mesh_arg(" ulysses=1 ") == {"ulysses": 1}
    assert mesh_arg("sp=2,ulysses=2") == {"sp": 2, "ulysses": 2}
    for bad in ("ulysses", "ring=2", "ulysses=0", "ulysses=two", "cfg=2,cfg=2", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME=SIZE pairs of cfg, ulysses, sp"):
            mesh_arg(bad)


@pytest.mark.parametrize("verb, argv, world, message", [
    ("attention", ["--model", "ltx-video", "--mesh", "cfg=2,ulysses=2"], 4,
     "--mesh cfg: one attention call has no guidance branches to spread"),
    ("attention", ["--model", "ltx-video", "--mesh", "ulysses=3"], 3,
     "--mesh ulysses=3 does not divide the 32 heads of ltx-video"),
    ("attention", ["--model", "ltx-video", "--mesh", "ulysses=2"], 3,
     "--mesh cfg=1 x ulysses=2 does not divide the 3 ranks"),
    ("e2e", ["--tiny", "--device", "cpu", "--mesh", "cfg=3"], 3,
     "--mesh cfg=3: a step's guidance branches go over 1 or 2 halves"),
    ("e2e", ["--tiny", "--device", "cpu", "--mesh", "ulysses=4"], 4,
     "--mesh ulysses=4 does not divide the 2 heads of wan2.1-14b --tiny"),
    ("e2e", ["--tiny", "--device", "cpu", "--mesh", "cfg=2,sp=4"], 4,
     "--mesh cfg=2 x ulysses=1 x sp=4 = 8 ranks, not the 4 of this run"),
    ("e2e", ["--tiny", "--device", "cpu", "--strategy", "diffusers-unified"], 2,
     "diffusers-unified runs Diffusers' ring x Ulysses attention at the sizes of --mesh: give --mesh"),
])
def test_a_mesh_that_cannot_apply_is_one_line_before_anything(capsys, monkeypatch, tmp_path, verb, argv, world,
                                                             message):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", str(world))
    code, printed, err = run_cli(capsys, ["bench", verb, *argv, "--out", tmp_path / "o"])
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"sparsp bench {verb}: error: {message}"), err
    assert not dist.is_initialized() and not (tmp_path / "o").exists()


def _attention(rank, world, out, mesh):
    from sparsp.cli import main
    from test_bench_failures import _attention_on_cpu

    _attention_on_cpu(rank)  # a small geometry of 2 heads, the GPU-only pieces stood in for
    return main(["bench", "attention", "--model", "ltx-video", "--kernel", "torch", "--link-gbps", "100",
                 "--strategy", "sparsp", "ring", "--no-copy-engine", "--warmup", "1", "--iters", "10",
                 "--mesh", mesh, "--out", str(out)])


def _rows(out) -> dict:
    (path,) = out.glob("**/*.json")
    return {r["strategy"]: r for r in json.loads(path.read_text())["rows"]}


@pytest.mark.parametrize("world, mesh, label", [(2, "ulysses=2", "ulysses 2 x sp 1"),
                                                (1, "ulysses=1", "ulysses 1 x sp 1")])
def test_bench_attention_runs_its_strategy_rows_on_the_mesh(tmp_path, world, mesh, label):
    assert run_distributed(_attention, world, tmp_path, mesh, timeout=300) == [0] * world
    rows = _rows(tmp_path)
    names = [f"sparsp [{label}]", f"ring [{label}]", f"sparsp [{label}] (reuse)", f"ring [{label}] (reuse)"]
    assert list(rows) == [*names, "1gpu-dense", "1gpu-sparse"]
    for name in names:
        r = rows[name]
        assert r["mesh"] == label and r["ranks"] == world and r["median_ms"] > 0, r
        # ulysses 2: the all-to-alls move q, k, v and the output of every token, whatever the mask keeps
        assert (r["bytes_moved"] > 0) == (world == 2), r
    assert rows[f"sparsp [{label}]"]["call"] == "plan" and rows[f"sparsp [{label}] (reuse)"]["reuse_ratio"] is not None
    assert "mesh" not in rows["1gpu-sparse"]  # the flat one-GPU call, timed in the same rounds


def _e2e(rank, world, cwd):
    from sparsp.cli import main

    os.chdir(cwd)
    return main(["bench", "e2e", "--tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "1", "--warmup", "1",
                 "--no-plot", "--mesh", "cfg=2", "--strategy", "1gpu-sparse", "diffusers-unified", "sparsp"])


def test_bench_e2e_runs_the_sparsp_rows_on_the_mesh(tmp_path):
    import torch

    from sparsp.bench.e2e import diffusers_refusal

    assert run_distributed(_e2e, 2, tmp_path, timeout=300) == [0, 0]
    rows = _rows(tmp_path)
    assert list(rows) == ["1gpu-sparse", "diffusers-unified", "sparsp"]
    sparse, one = rows["sparsp"], rows["1gpu-sparse"]
    assert sparse["mesh"] == {"cfg": 2, "ulysses": 1, "sp": 1} and one["mesh"] is None
    assert "error" not in sparse and sparse["ranks"] == 2
    assert sparse["density"] == one["density"]  # the same masks: a half's sample is the sample
    unified = rows["diffusers-unified"]
    assert unified["error"] == diffusers_refusal("diffusers-unified", "wan", torch.device("cpu"), (2, 1, 1))
