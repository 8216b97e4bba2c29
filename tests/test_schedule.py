"""The denoising schedule of ``sp_attention`` (``strategies/schedule.py``): dense first steps,
plans solved every few steps and reused in between.

A scheduled run on 2-4 gloo ranks equals the single-process reference under the same schedule
(dense steps exact, reuse steps under the mask of the step that solved the plan), for every
strategy; a reuse step moves exactly the kept plan's bytes and issues no collective; plans are
kept per layer and branch, bounded by ``kept_plans``, and freed by ``close_transports``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dist_utils import ScheduleReference, count_collectives, run_distributed, structured_inputs

B, H, D, BS = 1, 4, 16, 16


def test_step_kinds_follow_the_config():
    from sparsp import SparspConfig

    cfg = SparspConfig(dense_steps=2, replan_every=3)
    assert [cfg.step_kind(s) for s in range(9)] == ["dense", "dense", "plan", "reuse", "reuse", "plan", "reuse",
                                                     "reuse", "plan"]
    assert SparspConfig().step_kind(0) == "plan" and not SparspConfig().scheduled
    assert SparspConfig(replan_every=1, dense_steps=0).step_kind(7) == "plan"


@pytest.mark.parametrize("fields, message", [
    ({"dense_steps": -1}, "dense_steps must be an int >= 0, got -1"),
    ({"dense_steps": 1.5}, "dense_steps must be an int >= 0, got 1.5"),
    ({"replan_every": 0}, "replan_every must be an int >= 1 (1 = plan every step), got 0"),
    ({"replan_every": True}, "replan_every must be an int >= 1 (1 = plan every step), got True"),
    ({"kept_plans": 0}, "kept_plans must be an int >= 1, got 0"),
])
def test_bad_schedule_fields_are_one_line(fields, message):
    from sparsp import SparspConfig

    with pytest.raises(ValueError) as e:
        SparspConfig(**fields)
    assert str(e.value) == message


def _step_inputs(steps, S, seed=0):
    """q, k, v per step: a base drawn once plus a small change per step (masks move little)."""
    base = structured_inputs(seed, B, S, H, D)
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.stack([t + 0.05 * s * torch.randn(t.shape, generator=g) for s in range(steps)]) for t in base]


def _scheduled_worker(rank, world, lens, strategies, fields, steps, dtype):
    import torch.distributed as dist

    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import auto, close_transports, get_transport, schedule

    S = sum(lens)
    a = sum(lens[:rank])
    q, k, v = _step_inputs(steps, S)
    results = {}
    for strategy in strategies:
        cfg = SparspConfig(cdf_threshold=0.8, block_size=BS, transport="nccl", kernel="torch", **fields)
        ref = ScheduleReference(lens, cfg)
        transport = get_transport("nccl", None, torch.device("cpu"), cfg.timeout_s)
        counted = count_collectives()
        errs, moved, collectives = [], [], []
        plans_before = schedule.kept()[0]
        for s in range(steps):
            x = [t[s, :, a:a + lens[rank]].to(dtype).contiguous() for t in (q, k, v)]
            transport.reset_counters()
            before = counted["n"] + counted["reads"]
            out = sp_attention(*x, strategy=strategy, config=cfg, layer=0, step=s)
            collectives.append(counted["n"] + counted["reads"] - before)
            moved.append(transport.total_received)
            # auto: the reference of the strategy its plan step chose (a dense one ignores the mask)
            decided = auto.last_decision()
            ran = strategy if strategy != "auto" or decided is None else decided.strategy
            want = ref.step(s, *(t[s].to(dtype).double() for t in (q, k, v)), ran)
            errs.append((out.double() - want[:, a:a + lens[rank]]).abs().max().item())
        counted["undo"]()
        results[strategy] = (errs, moved, collectives, schedule.kept()[0] - plans_before)
        dist.barrier()
    close_transports()
    return results, schedule.kept()


STRATEGIES = ["sparsp", "ring-sparse", "ring-relay", "ulysses", "ring", "auto"]


@pytest.mark.parametrize("world, lens, dtype", [
    (2, [64, 64], torch.float32),
    (3, [48, 40, 56], torch.float32),
    (4, [32, 48, 32, 40], torch.bfloat16),
])
def test_scheduled_run_equals_the_reference_and_reuse_moves_the_plan(world, lens, dtype):
    steps, fields = 6, {"dense_steps": 1, "replan_every": 2}  # dense, plan, reuse, plan, reuse, plan
    strategies = [s for s in STRATEGIES if s != "ulysses" or H % world == 0]
    if world == 3:
        strategies = ["sparsp", "ring-relay"]  # the uneven case: the direct and relay plans
    results = run_distributed(_scheduled_worker, world, lens, strategies, fields, steps, dtype, timeout=400)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for rank, (per_strategy, left) in enumerate(results):
        assert left == (0, 0), "close_transports frees the kept plans"
        for strategy, (errs, moved, collectives, kept) in per_strategy.items():
            assert max(errs) < tol, (rank, strategy, errs)
            # steps 2 and 4 reuse the plans of steps 1 and 3: no collective, the plan's bytes
            assert collectives[2] == collectives[4] == 0, (strategy, collectives)
            assert collectives[1] > 0 and collectives[3] > 0, (strategy, collectives)
            if strategy != "auto":  # auto may pick another strategy per plan
                assert moved[2] == moved[1] and moved[4] == moved[3], (strategy, moved)
            assert kept == 1, (strategy, kept)  # one layer, one branch: one plan


def _branches_worker(rank, world):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import close_transports, schedule

    lens = [48, 48]
    S = sum(lens)
    a = sum(lens[:rank])
    cfg = SparspConfig(cdf_threshold=0.8, block_size=BS, transport="nccl", kernel="torch", replan_every=4,
                       kept_plans=3)
    counts = []
    for step in range(2):
        for layer in (0, 1):
            for seed in (0, 100):  # two branches per (layer, step), told apart by their order
                q, k, v = structured_inputs(seed + step, B, S, H, D)
                x = [t[:, a:a + lens[rank]].contiguous() for t in (q, k, v)]
                sp_attention(*x, config=cfg, layer=layer, step=step)
                counts.append(schedule.kept()[0])
    keys = sorted((key[1], key[2]) for key in schedule._PLANS)
    close_transports()
    return counts, keys


def test_plans_are_kept_per_layer_and_branch_and_bounded():
    """Without ``branch`` the i-th call of one (layer, step) is branch i; at most ``kept_plans``
    plans, the least recently used dropped first, the same on every rank."""
    results = run_distributed(_branches_worker, 2, timeout=180)
    assert results[0] == results[1]
    counts, keys = results[0]
    # step 0 plans layer 0's branches 0 and 1, then layer 1's: 4 plans for a store of 3, so
    # (0, 0) goes; step 1 finds each plan gone in turn (the store is too small to reuse) and
    # plans again, dropping the least recently used each time
    assert counts == [1, 2, 3, 3, 3, 3, 3, 3]
    assert keys == [(0, 1), (1, 0), (1, 1)]


def test_sp_attention_refuses_a_bad_step_or_branch():
    msgs = run_distributed(_refusal_worker, 1, timeout=60)[0]
    assert msgs == ["step must be an int >= 0 or None, got -1", "step must be an int >= 0 or None, got 1.0",
                    "branch must be None, an int or a str, got list"]


def _refusal_worker(rank, world):
    from sparsp import sp_attention

    q = torch.randn(1, 32, 2, 8)
    out = []
    for kw in ({"step": -1}, {"step": 1.0}, {"branch": [1]}):
        try:
            sp_attention(q, q, q, **kw)
        except ValueError as e:
            out.append(str(e))
    return out


def _nonfinite_worker(rank, world):
    from sparsp import SparspConfig, sp_attention
    from sparsp.strategies import close_transports

    lens = [48, 48]
    a = sum(lens[:rank])
    cfg = SparspConfig(cdf_threshold=0.8, block_size=BS, transport="nccl", kernel="torch", replan_every=3,
                       timeout_s=5)
    q, k, v = structured_inputs(3, B, sum(lens), H, D)
    x = [t[:, a:a + lens[rank]].contiguous() for t in (q, k, v)]
    sp_attention(*x, config=cfg, layer=0, step=0)  # plans
    if rank == 1:
        x[1] = x[1].clone()
        x[1][0, 3, 1, 2] = float("nan")
    try:
        sp_attention(*x, config=cfg, layer=0, step=1)  # reuses: rank 1 finds its NaN itself
        got = "no error"
    except (ValueError, TimeoutError) as e:
        got = f"{type(e).__name__}: {e}"
    with contextlib.suppress(Exception):  # the peer is gone: closing may say so too
        close_transports()
    return got


def test_a_reuse_call_checks_its_own_inputs():
    """``check_finite`` on a reuse call is local: the rank with the NaN raises, its peer ends
    with the transport's timeout message."""
    got = run_distributed(_nonfinite_worker, 2, timeout=120)
    assert got[1].startswith("ValueError: non-finite inputs on rank 1 in a call that reuses a kept plan "
                             "(k has 1 NaN/Inf value)"), got
    assert got[0].startswith("TimeoutError"), got
