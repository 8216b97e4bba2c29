"""The schedule in the benchmarks: ``bench e2e``'s schedule rows (``--schedule``, ``total_ms``,
``composed_ms``, the timed steps counted from 0 after the warm-up, synthetic q/k that move
from step to step), ``bench attention``'s reuse rows (their plan figures), and both verbs'
``--thresholds`` refused for another model before anything starts."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from dist_utils import run_distributed

pytest.importorskip("diffusers")


def _e2e_worker(rank, world, cwd):
    from sparsp.cli import main
    from sparsp.integrations import steps

    seen = []
    advance = steps.StepCounter.advance

    def record(self, *args, **kwargs):
        step, branch = advance(self, *args, **kwargs)
        seen.append(step)
        return step, branch

    steps.StepCounter.advance = record
    os.chdir(cwd)
    code = main(["bench", "e2e", "--tiny", "--device", "cpu", "--dtype", "fp32", "--steps", "3", "--warmup", "0",
                 "--weights", "synthetic-structure", "--strategy", "1gpu-sparse", "--schedule", "dense=1,replan=2",
                 "--no-plot"])
    return code, seen


def test_e2e_schedule_rows(tmp_path):
    """``--schedule dense=1,replan=2`` adds a row of ``1gpu-sparse`` under it: every row says
    its schedule and the sum of its timed steps; the scheduled row warms up through every kind
    of step (1 dense + 2 + 1 steps) and its timed steps count from step 0 again."""
    from sparsp.strategies import one_gpu

    ((code, seen),) = run_distributed(_e2e_worker, 1, tmp_path, timeout=240)
    assert code == 0
    (path,) = tmp_path.glob("results/bench/e2e-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [(r["strategy"], r["schedule"]) for r in rows] == [
        ("1gpu-sparse", {"dense_steps": 0, "replan_every": 1}), ("1gpu-sparse", {"dense_steps": 1, "replan_every": 2})]
    for r in rows:
        assert "error" not in r, r.get("error")
        assert r["total_ms"] == pytest.approx(sum(r["step_ms_all"])) and len(r["step_ms_all"]) == 3
    assert [r["warmup"] for r in rows] == [one_gpu.MEASURE_AT, 4]
    warm = list(range(one_gpu.MEASURE_AT))
    assert seen == [*warm, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2]  # each row's warm-up, then its timed steps from 0
    assert rows[1].get("composed_ms") is None  # no 1gpu-dense row to compose it from


def test_row_plan_labels_and_composed_time():
    from sparsp.bench.e2e_rows import compose, row_label, row_plan

    args = argparse.Namespace(strategy=["1gpu-dense", "1gpu-sparse", "diffusers-ring", "sparsp"], dense_steps=0,
                              replan_every=1, schedule=[(10, 5), (0, 1), (0, 10)])
    assert row_plan(args) == [("1gpu-dense", None), ("1gpu-sparse", (0, 1)), ("1gpu-sparse", (10, 5)),
                              ("1gpu-sparse", (0, 10)), ("diffusers-ring", None), ("sparsp", (0, 1)),
                              ("sparsp", (10, 5)), ("sparsp", (0, 10))]
    sched = lambda d, k: {"dense_steps": d, "replan_every": k}  # noqa: E731
    rows = [{"strategy": "1gpu-dense", "schedule": None, "step_ms": 10.0, "steps": 50},
            {"strategy": "1gpu-sparse", "schedule": sched(0, 1), "step_ms": 6.0, "steps": 50},
            {"strategy": "1gpu-sparse", "schedule": sched(10, 5), "step_ms": 5.0, "steps": 50},
            {"strategy": "sparsp", "schedule": sched(10, 5), "step_ms": 3.0, "steps": 50}]
    assert [row_label(r) for r in rows] == ["1gpu-dense", "1gpu-sparse", "1gpu-sparse dense=10,replan=5",
                                            "sparsp dense=10,replan=5"]
    compose(rows)
    assert rows[2]["composed_ms"] == 10 * 10.0 + 40 * 6.0
    assert "composed_ms" not in rows[1] and "composed_ms" not in rows[3]


@pytest.mark.parametrize("text, want", [("dense=10,replan=5", (10, 5)), ("replan=3", (0, 3)), ("dense=2", (2, 1))])
def test_schedule_spelling(text, want):
    from sparsp.bench.args import schedule_arg

    assert schedule_arg(text) == want


@pytest.mark.parametrize("text", ["dense=-1", "replan=0", "dense=1;replan=2", "dense=x", "every=2", ""])
def test_bad_schedule_is_refused(text):
    from sparsp.bench.args import schedule_arg

    with pytest.raises(argparse.ArgumentTypeError, match=f"expected dense=N,replan=K .*got {text!r}"):
        schedule_arg(text)


def test_synthetic_qk_move_a_little_each_step():
    """Each ``advance`` moves the synthetic q and k by one offset per run of ``DRIFT_TOKENS``
    tokens (the same draw in every process), so a kept plan meets new inputs."""
    from types import SimpleNamespace

    import torch

    from sparsp.bench.e2e_model import DRIFT, DRIFT_TOKENS, synthetic_qk
    from sparsp.geometry import VideoGeometry
    from sparsp.integrations.models import TINY, build_transformer

    model = build_transformer("wan", config=TINY["wan"], seed=0)
    geom = VideoGeometry(frames=2, height=8, width=16, heads=2, head_dim=12)
    layouts = [SimpleNamespace(geometry=geom, attn_tokens=torch.randperm(geom.num_tokens), cache={}) for _ in range(2)]
    layouts[1].attn_tokens = layouts[0].attn_tokens
    like = torch.empty(1, geom.num_tokens, 2, 12)
    one, two = synthetic_qk(model, 0), synthetic_qk(model, 0)
    q0 = one(layouts[0], like)[0].clone()
    two(layouts[1], like)
    one.advance()
    two.advance()
    q1, k1 = one(layouts[0], like)
    assert torch.equal(q1, two(layouts[1], like)[0])
    step = q1 - q0
    region = layouts[0].attn_tokens // DRIFT_TOKENS
    for r in region.unique():
        rows = step[0, region == r]
        assert torch.allclose(rows, rows[:1].expand_as(rows), atol=1e-6)  # one offset per run of tokens
    assert 0.5 * DRIFT < step.std().item() < 2 * DRIFT


def test_e2e_thresholds_of_another_model_refused(tmp_path, capsys):
    from sparsp.bench.args import add_e2e
    from sparsp.bench.e2e import settle_arguments
    from sparsp.thresholds import write_thresholds

    path = tmp_path / "t.json"
    write_thresholds(path, layers=40, heads=40, cdf=[0.9])
    p = argparse.ArgumentParser()
    add_e2e(p)
    args = p.parse_args(["--tiny", "--device", "cpu", "--thresholds", str(path)])
    with pytest.raises(SystemExit) as e:
        settle_arguments(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err == (f"sparsp bench e2e: error: --thresholds {path}: the table is for 40 layers x 40 heads; "
                   "wan2.1-14b --tiny (2 self-attention layers) has 2 layers x 2 heads\n")
    write_thresholds(path, layers=2, heads=2, cdf=[0.9])
    settle_arguments(p.parse_args(["--tiny", "--device", "cpu", "--thresholds", str(path)]))


def test_attention_thresholds_of_another_model_refused_before_anything(tmp_path, capsys):
    from sparsp.cli import main
    from sparsp.thresholds import write_thresholds

    path = tmp_path / "t.json"
    write_thresholds(path, layers=2, heads=2, cdf=[0.9])
    with pytest.raises(SystemExit) as e:
        main(["bench", "attention", "--model", "ltx-video", "--thresholds", str(path), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"sparsp bench attention: error: --thresholds {path}: the table is for 2 "
                                         "layers x 2 heads; ltx-video (28 self-attention layers) has 28 layers x 32 "
                                         "heads\n")


def _row(strategy, call, median, mask, transport="nccl", **kw):
    from sparsp.bench.attention_rows import AttentionRow

    return AttentionRow(model="m", tokens=1, heads=1, head_dim=1, ranks=1, fabric="nvlink", cdf=0.9,
                        strategy=strategy, call=call, transport=transport, placement="periodic", kernel="fa4",
                        median_ms=median, timing="interleaved", density=0.5, mask_ms=mask, link_gbps=1.0,
                        dense_tflops=1.0, dense_kernel="fa4", compute_bound_ms=1.0, bound_ms=1.0, **kw)


def test_attention_reuse_rows_carry_their_plan_figures():
    """A reuse row's ``reuse_ratio`` is its median over its plan row's (same strategy,
    transport, placement, cdf) median less that row's mask phase; the one-GPU rows have none of
    a call's fields, the reuse rows all of them."""
    from sparsp.bench.attention_rows import with_reuse_figures

    rows = with_reuse_figures([_row("sparsp", "plan", 6.0, 2.0), _row("sparsp", "plan", 9.0, 3.0, transport="ipc"),
                               _row("sparsp (reuse)", "reuse", 4.2, 0.0), _row("sparsp (reuse)", "reuse", 6.0, 0.0,
                                                                               transport="ipc"),
                               _row("1gpu-sparse", None, 5.0, 0.0)])
    plan, _, reuse, reuse_ipc, one = rows
    assert (reuse.plan_median_ms, reuse.plan_mask_ms, reuse.reuse_ratio) == (6.0, 2.0, pytest.approx(4.2 / 4.0))
    assert reuse_ipc.reuse_ratio == pytest.approx(1.0) and plan.reuse_ratio is None
    assert {"call", "reuse_ratio", "plan_mask_ms"} <= set(reuse.as_json())
    assert not {"call", "reuse_ratio"} & set(one.as_json())
