"""A denoising schedule in the cost model (``cost.schedule``): a reuse call is the plan call
without its mask phase, a dense step runs the strategy's dense path, a run is the sum of its
steps; per-layer thresholds in the masks ``analyze`` and ``simulate`` make, and a bad table
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
from cli_utils import run_cli

from sparsp.config import SparspConfig
from sparsp.cost import Blocks, KernelFigure, Profile, TransportFigure, measure, timeline
from sparsp.cost.figures import full_demand
from sparsp.cost.schedule import Schedule, call_works, dense_path, run_cost
from sparsp.cost.timeline import mask_phase_ms
from sparsp.geometry import VideoGeometry, preset
from sparsp.placement import make_placement
from sparsp.strategies.registry import strategies_where, strategy_names, strategy_spec
from sparsp.thresholds import write_thresholds
from sparsp.workloads.synthetic import synthetic_masks

GEOM = VideoGeometry(name="toy", frames=2, height=8, width=16, heads=8, head_dim=64, block_size=32, layers=2)
PROFILE = Profile(name="toy", gpus=8, peer_access=False, link_gbps=20.0, host_gbps=60.0, hbm_gbps=500.0,
                  transports=(TransportFigure(name="host", latency_ms=0.2),
                              TransportFigure(name="nccl", efficiency=0.6)),
                  kernels=(KernelFigure(head_dim=64, sparse_tflops=50.0, dense_tflops=80.0),))
BASE = strategy_spec(strategies_where(baseline=True)[0])


@pytest.fixture(scope="module")
def masks():
    return synthetic_masks(GEOM, [0.9], layers=1)[0.9][0]


@pytest.mark.parametrize("dense, every", [(0, 1), (10, 5), (3, 1), (0, 7), (50, 4)])
def test_schedule_counts_follow_the_config_rule(dense, every):
    config = SparspConfig(dense_steps=dense, replan_every=every)
    sched = Schedule(steps=50, dense_steps=dense, replan_every=every)
    kinds = [config.step_kind(s) for s in range(50)]
    assert [sched.kind(s) for s in range(50)] == kinds
    assert sched.counts() == {k: kinds.count(k) for k in ("dense", "plan", "reuse")}


def test_a_run_is_its_dense_plan_and_reuse_steps():
    sched = Schedule(steps=50, dense_steps=10, replan_every=5)  # 10 dense, 8 plan, 32 reuse
    run = run_cost(sched, plan_ms=3.0, reuse_ms=2.0, dense_ms=7.0, calls=4)
    assert run["total_ms"] == pytest.approx(4 * (10 * 7.0 + 8 * 3.0 + 32 * 2.0))
    assert run["every_step_plans_total_ms"] == pytest.approx(4 * 50 * 3.0)
    assert run["per_step_ms"] == pytest.approx(run["total_ms"] / 50)
    with pytest.raises(ValueError, match="--dense-steps 60 exceeds the run's --steps 50"):
        Schedule(steps=50, dense_steps=60)
    with pytest.raises(ValueError, match="--replan-every must be an int >= 1, got 0"):
        Schedule(replan_every=0)


@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("G", [2, 4])
def test_a_reuse_call_is_the_plan_call_without_its_mask_phase(masks, strategy, G):
    spec = strategy_spec(strategy)
    d = measure(masks, Blocks.of(make_placement(spec.placement, GEOM, G)), relay=spec.byte_rule == "relay")
    works = call_works(spec, d, baseline=BASE, head_dim=GEOM.head_dim, profile=PROFILE, local_first=False)
    plan, reuse = works["plan"], works["reuse"]
    assert not reuse.mask_phase and plan.mask_phase and reuse.recv == plan.recv and reuse.flops == plan.flops
    phase = mask_phase_ms(plan, PROFILE)
    assert min(phase) > 0 and mask_phase_ms(reuse, PROFILE) == (0.0,) * G
    want = timeline(plan, PROFILE, head_dim=GEOM.head_dim).latency_ms - max(phase)
    assert timeline(reuse, PROFILE, head_dim=GEOM.head_dim).latency_ms == pytest.approx(want, rel=1e-9)


def test_a_dense_step_runs_the_dense_path(masks):
    placement = make_placement("periodic", GEOM, 4)
    d = measure(masks, Blocks.of(placement), relay=True)
    ones = measure(torch.ones_like(masks), Blocks.of(placement), relay=True)
    assert full_demand(d) == ones
    sparsp, ulysses = strategy_spec("sparsp"), strategy_spec("ulysses")
    assert dense_path(sparsp, BASE) is BASE  # a sequence-sharded strategy runs the dense ring, on its placement
    dense = call_works(sparsp, d, baseline=BASE, head_dim=64)["dense"]
    assert dense.strategy == BASE.name and dense.recv == call_works(BASE, d, baseline=BASE, head_dim=64)["plan"].recv
    own = call_works(ulysses, d, head_dim=64)["dense"]  # its all-to-all, every pair computed, no mask read
    assert own.strategy == "ulysses" and own.schedule == "all-to-all" and own.density == (1.0,) * 4
    assert own.recv == call_works(ulysses, d, head_dim=64)["plan"].recv
    assert own.mask_bytes[0] < call_works(ulysses, d, head_dim=64)["plan"].mask_bytes[0]


def test_simulate_prices_each_kind_of_step_and_the_run(tmp_path, capsys):
    code, out, err = run_cli(capsys, ["simulate", "--model", "ltx-video", "--ranks", "2", "--strategy", "sparsp",
                                      "ulysses", "--dense-steps", "4", "--replan-every", "3", "--steps", "20",
                                      "--no-plots", "--out", tmp_path])
    assert code == 0, err
    doc = json.loads((tmp_path / "simulate.json").read_text())
    assert doc["schedule"]["dense_steps_run"] == 4 and doc["schedule"]["reuse_steps_run"] == 10
    calls = preset("ltx-video").layers * 2  # its pipeline's two branches
    for r in [*doc["results"], *doc["one_gpu"].values()]:
        plan = r.get("predicted_ms", r.get("sparse_ms"))
        assert r["reuse_ms"] < plan and r["run"]["calls_per_step"] == calls
        assert r["run"]["total_ms"] == pytest.approx(calls * (4 * r["dense_ms"] + 6 * plan + 10 * r["reuse_ms"]),
                                                     rel=1e-5)
    assert {r["strategy"]: r["dense_strategy"] for r in doc["results"]} == {"sparsp": "ring", "ulysses": "ulysses"}
    assert "a run of 20 steps, 56 attention calls each: 4 dense, 6 plan, 10 reuse steps" in " ".join(out.split())


# --- thresholds per layer ----------------------------------------------------------------------------


def test_each_layer_takes_its_own_thresholds(tmp_path):
    table = tmp_path / "t.json"
    write_thresholds(table, layers=2, heads=8, cdf=[1.0, None])
    from sparsp.thresholds import read_thresholds

    m = synthetic_masks(GEOM, [0.5], layers=2, thresholds=read_thresholds(table))[0.5]
    plain = synthetic_masks(GEOM, [0.5], layers=2)[0.5]
    assert m[0].all() and not plain[0].all()  # layer 0 at cdf 1.0: every block
    assert torch.equal(m[1], plain[1])  # layer 1 left out: the scalar


def test_analyze_makes_each_layer_at_its_thresholds(tmp_path, capsys):
    n = preset("ltx-video").layers
    write_thresholds(tmp_path / "t.json", layers=n, heads=32, cdf=[1.0])
    code, out, err = run_cli(capsys, ["analyze", "--model", "ltx-video", "--ranks", "2", "--cdf", "0.9",
                                      "--strategy", "sparsp", "--thresholds", tmp_path / "t.json", "--no-plots",
                                      "--out", tmp_path / "a"])
    assert code == 0, err
    doc = json.loads((tmp_path / "a" / "analysis.json").read_text())
    assert doc["mask_stats"][0]["density"] == 1.0 and "thresholds" in doc["masks"]


@pytest.mark.parametrize("verb", ["analyze", "simulate"])
@pytest.mark.parametrize("table, message", [
    (dict(layers=3, heads=32), "the table is for 3 layers x 32 heads; ltx-video has 28 layers x 32 heads"),
    (dict(layers=28, heads=8), "the table is for 28 layers x 8 heads; ltx-video has 28 layers x 32 heads"),
    (dict(layers=28, heads=32, cdf=[1.5]), "cdf[0]: 1.5 lies outside [0, 1]"),
])
def test_a_bad_thresholds_table_is_refused_in_one_line(verb, table, message, tmp_path, capsys):
    path = tmp_path / "t.json"
    doc = {"format": "sparsp-thresholds", "version": 1, "cdf": None, "sim": None, **table}
    path.write_text(json.dumps(doc))
    code, out, err = run_cli(capsys, [verb, "--model", "ltx-video", "--ranks", "2", "--thresholds", path,
                                      "--no-plots", "--out", tmp_path / "o"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--thresholds {path}: {message}" in err and not (tmp_path / "o").exists()


def test_a_schedule_cannot_apply_to_one_step_of_every_layer(tmp_path, capsys):
    code, _, err = run_cli(capsys, ["simulate", "--model", "ltx-video", "--density-profile", tmp_path / "p.csv",
                                    "--dense-steps", "3", "--branches", "2", "--out", tmp_path / "o"])
    assert code == 2 and "--dense-steps and --branches cannot apply with --density-profile" in err
