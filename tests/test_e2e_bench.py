"""CPU smoke run of ``sparsp bench e2e`` (2 gloo processes, tiny model): its plumbing — result
file name and kind, one row per strategy with the issue's fields, a failing baseline recorded
as an error row, the PNG."""

import json

import pytest

from dist_utils import run_distributed

pytest.importorskip("diffusers")

FIELDS = {"model", "ranks", "fabric", "strategy", "transport", "cdf", "density", "weights", "layers", "steps",
          "step_ms", "per_layer_ms", "attention_ms"}
STRATEGIES = ["1gpu-dense", "1gpu-sparse", "diffusers-ring", "ring-sparse", "ulysses", "sparsp"]


def _bench_worker(rank, world, out, weights):
    from sparsp.cli import main

    return main(["bench", "e2e", "--model", "hunyuan-video", "--tiny", "--device", "cpu", "--dtype", "fp32",
                 "--steps", "2", "--warmup", "1", "--block-size", "8", "--weights", weights,
                 "--strategy", *STRATEGIES, "--out", str(out)])


@pytest.mark.parametrize("weights", ["random", "synthetic-structure"])
def test_bench_e2e_cpu_smoke(tmp_path, weights):
    assert run_distributed(_bench_worker, 2, tmp_path, weights, timeout=240) == [0, 0]
    (path,) = tmp_path.glob("e2e-hunyuan-video-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["kind"] == "e2e" and doc["machine"] == "cpu"
    rows = {r["strategy"]: r for r in doc["rows"]}
    assert list(rows) == STRATEGIES
    for name, r in rows.items():
        assert FIELDS <= set(r), (name, FIELDS - set(r))
        assert r["weights"] == weights and r["fabric"] == "nvlink" and r["steps"] == 2
    # Diffusers' own context parallelism needs an accelerator: on CPU the row records why.
    assert rows["diffusers-ring"]["step_ms"] is None and rows["diffusers-ring"]["error"]
    for name in ("1gpu-dense", "1gpu-sparse", "ring-sparse", "ulysses", "sparsp"):
        r = rows[name]
        assert r["step_ms"] > 0 and r["attention_ms"] > 0 and r["layers"] == 2, (name, r)
        assert r["per_layer_ms"] == pytest.approx(r["step_ms"] / 2)
        assert r["ranks"] == (1 if name.startswith("1gpu") else 2)
    densities = {rows[n]["density"] for n in ("1gpu-sparse", "ring-sparse", "ulysses", "sparsp")}
    assert len(densities) == 1 and 0 < densities.pop() < 1  # the masks every sparse row shares
    assert rows["1gpu-dense"]["density"] is None
    assert (rows["sparsp"].get("qk") == "synthetic") == (weights == "synthetic-structure")
    assert path.with_suffix(".png").stat().st_size > 1000
