"""The ``sparsp simulate`` job: sweep G per strategy on a profile, fit it, validate.

Masks are ``sparsp analyze``'s (``workloads.synthetic_masks``, same seed) on the geometry the
attention benchmark runs (video tokens only unless ``text``), and every strategy runs with the
placement it registered for the benchmarks (``placement="auto"``). ``--fit-profile`` fits a
machine profile to ``bench transport`` and ``bench kernel`` results only; ``--validate`` predicts every
strategy row of ``bench attention`` results with the 2×H200 profiles (widened to the row's G,
``Profile.widened``), each in its own order (its ``local_first``; rows written before the flag
existed ran in order), and never fits on them. Every row adds each kind of step's call and a
run under the schedule asked for (``step_fields``; ``cost.schedule``). What the run is asked
(``SimulateConfig``) is in ``options``, its outputs in ``plots``.
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..analysis import DTYPE_BYTES, read_table
from ..cost.balance import contiguous_heads
from ..cost.figures import Blocks, measure, pair_flops
from ..cost.model import LOCAL_FIRST, SCHEDULES, build_work
from ..cost.profiles import Profile, get_profile
from ..cost.schedule import Schedule, call_works, run_cost
from ..cost.timeline import bottleneck, mask_phase_ms, timeline
from ..geometry import PRESETS, VideoGeometry, preset
from ..placement import make_placement
from ..strategies.registry import strategies_where, strategy_names, strategy_spec
from .calibrate import calibrate, newest, read_result
from .options import MaskCache, SimulateConfig, default_ranks, geometry, modelled, placement_for

BOTTLENECK_LEGEND = ("bottleneck: the largest part of the slowest rank's time: compute (its kernels), "
                     "transfer (transfer time not hidden behind compute: exposed), fixed (per-call fixed "
                     "costs: launches, host ops and syncs; the fixed column)")


def bottleneck_label(compute_ms: float, exposed_ms: float, fixed_ms: float) -> str:
    """The largest part of the slowest rank's time: ``compute``, ``transfer`` (exposed, i.e. not
    hidden behind compute) or ``fixed``, so the label agrees with the row's columns.
    (``savings_ms`` keeps the other question: what each cost, made free, would save.)"""
    parts = {"compute": compute_ms, "transfer": exposed_ms, "fixed": fixed_ms}
    return max(parts, key=parts.get)


def simulate_one(masks: torch.Tensor, geom: VideoGeometry, strategy: str, G: int, profile: Profile, *,
                 placement: str = "auto", transport: str | None = None, prefetch: int = 1,
                 dtype_bytes: int = 2, chunking: Profile | None = None,
                 local_first: bool | None = LOCAL_FIRST, head_order: tuple[int, ...] | None = None,
                 schedule: Schedule | None = None, calls: int = 1) -> dict:
    """One configuration → its JSON row (prediction, breakdown of the slowest rank, bottleneck).

    ``chunking``: the profile a chunking strategy decides its drain units from, and an automatic
    ``local_first`` its order (``cost/chunks.py`` reads the profile ``env.profile()`` names, else the
    built-in 2×H200 profile of the path); default ``profile``, the machine's own.
    ``local_first``: the calls' ``SparspConfig.local_first`` (the row's ``local_first`` says
    whether ``strategy`` then runs local first). ``head_order``: a head-sharded strategy's heads
    in rank order (``cost.model.work``; None: by density, as it runs). ``schedule``: with it,
    the row adds each kind of step's call and the run (``step_fields``; ``calls`` per step)."""
    kind = placement_for(strategy, placement)
    pl = make_placement(kind, geom, G)
    spec = strategy_spec(strategy)
    if schedule is None:
        work = build_work(masks, pl, spec, head_dim=geom.head_dim, dtype_bytes=dtype_bytes,
                          profile=chunking or profile, transport=transport, local_first=local_first,
                          head_order=head_order)
        return row_of(work, profile, placement=kind, transport=transport, prefetch=prefetch, head_dim=geom.head_dim)
    d = measure(masks, Blocks.of(pl), relay=spec.byte_rule == "relay")
    works = call_works(spec, d, baseline=strategy_spec(strategies_where(baseline=True)[0]), head_dim=geom.head_dim,
                       dtype_bytes=dtype_bytes, profile=chunking or profile, transport=transport,
                       local_first=local_first, head_order=head_order)
    row = row_of(works["plan"], profile, placement=kind, transport=transport, prefetch=prefetch,
                 head_dim=geom.head_dim)
    return {**row, **step_fields(works, row["predicted_ms"], profile, schedule, calls, transport=transport,
                                 prefetch=prefetch, head_dim=geom.head_dim)}


def step_fields(works: dict, plan_ms: float, profile: Profile, schedule: Schedule, calls: int, **kw) -> dict:
    """A row's steps (``cost.schedule``): the plan call's mask phase, a reuse call and a dense
    step's call (``dense_strategy``: the path it runs) predicted on ``profile``, and the run
    (``run``: ``cost.schedule.run_cost``); ``kw``: ``timeline``'s."""
    reuse = timeline(works["reuse"], profile, **kw).latency_ms
    dense = timeline(works["dense"], profile, **kw).latency_ms
    return {"mask_phase_ms": round(max(mask_phase_ms(works["plan"], profile)), 4), "reuse_ms": round(reuse, 4),
            "dense_ms": round(dense, 4), "dense_strategy": works["dense"].strategy,
            "run": run_cost(schedule, plan_ms=plan_ms, reuse_ms=reuse, dense_ms=dense, calls=calls)}


def row_of(work, profile: Profile, *, placement: str, transport: str | None, prefetch: int, head_dim: int,
           rounds: bool = True, savings: bool = True) -> dict:
    """A ``Work`` scheduled on ``profile`` → its JSON row (``simulate_one``); ``rounds``: with
    the slowest rank's task-by-task rounds; ``savings``: with what each cost, made free, would
    save (``savings_ms``: the timeline again per cost)."""
    strategy, G, kind = work.strategy, work.ranks, placement
    kw = dict(transport=transport, head_dim=head_dim, prefetch=prefetch)
    tl = timeline(work, profile, **kw)
    r = tl.critical_rank
    compute = tl.busy(r, "compute")
    fixed = tl.busy(r, "fixed")
    exposed = max(0.0, tl.finish[r] - compute - fixed)
    label = bottleneck_label(compute, exposed, fixed)
    per_rank = work.bytes_per_rank
    row = {
        "strategy": strategy, "ranks": G, "placement": kind,
        "transport": profile.transport(transport).name, "local_first": work.local_first,
        "predicted_ms": round(tl.latency_ms, 4), "bottleneck": label,
        "critical_rank": r, "compute_ms": round(compute, 4), "fixed_ms": round(fixed, 4),
        "transfer_ms": round(tl.busy(r, "transfer"), 4),
        "exposed_ms": round(exposed, 4),
        "finish_ms": [round(f, 4) for f in tl.finish],
        "bytes_max_rank": max(per_rank), "bytes_total": sum(per_rank),
    }
    if savings:
        row["savings_ms"] = {k: round(v, 4) for k, v in bottleneck(work, profile, tl, **kw)[1].items()}
    if rounds:
        row["rounds"] = [{"kind": t.kind, "round": t.round, "phase": t.phase, "from": t.sender,
                          "bytes": int(t.nbytes), "start_ms": round(t.start, 4), "end_ms": round(t.end, 4)}
                         for t in sorted((t for t in tl.tasks if t.rank == r), key=lambda t: (t.start, t.end))]
    return row


def one_gpu(masks: torch.Tensor, geom: VideoGeometry, profile: Profile,
            local_first: bool | None = LOCAL_FIRST, schedule: Schedule | None = None, calls: int = 1) -> dict:
    """The same call on one GPU: the primary strategy (registered ``primary``) on a group of one
    (what ``bench attention``'s ``1gpu-sparse`` row runs: the mask phase, then the kernel over the whole mask, no payload;
    ``local_first``: that kernel launched before the host read — automatic, never: the row runs
    over ``nccl``), and dense attention (kernel time only). With ``schedule``, the same call
    reusing its plan (``reuse_ms``: no mask phase), its mask phase, and the run whose dense
    steps run the dense kernel (``run``, ``calls`` per step)."""
    pl = make_placement("contiguous", geom, 1)
    kf = profile.kernel(geom.head_dim)
    primary = strategy_spec(strategies_where(primary=True)[0])
    work = build_work(masks, pl, primary, head_dim=geom.head_dim, profile=profile, transport="nccl",
                      local_first=local_first)
    sparse = timeline(work, profile, head_dim=geom.head_dim).latency_ms
    dense = float(pair_flops(masks, pl, geom.head_dim, dense=True).sum()) / (kf.dense_tflops * 1e9) + profile.launch_ms
    out = {"sparse_ms": round(sparse, 4), "dense_ms": round(dense, 4)}
    if schedule is not None:
        reuse = timeline(work.reused(), profile, head_dim=geom.head_dim).latency_ms
        out.update(mask_phase_ms=round(max(mask_phase_ms(work, profile)), 4), reuse_ms=round(reuse, 4),
                   run=run_cost(schedule, plan_ms=sparse, reuse_ms=reuse, dense_ms=dense, calls=calls))
    return out


def simulate(cfg: SimulateConfig, progress=None) -> dict:
    """Run the sweep (and calibration, validation) → the ``simulate.json`` document."""
    if cfg.density_profile is not None:
        raise ValueError("a density profile's whole-model step is simulate.layers.simulate_model's")
    t0 = time.perf_counter()
    geom = geometry(cfg.model, cfg.text)
    table = read_table(cfg.thresholds, preset(cfg.model)) if cfg.thresholds is not None else None
    profile = get_profile(cfg.fabric)
    calibration = None
    if cfg.fit_profile:
        profile, calibration = calibrate(profile, cfg.fit_profile)
    cfg = replace(cfg, ranks=cfg.ranks or default_ranks(profile.gpus))
    if cfg.transport is not None:
        profile.transport(cfg.transport)  # unknown transport: ValueError before any work
    for G in cfg.ranks:
        if G > profile.gpus:
            raise ValueError(f"--ranks {G} exceeds the {profile.gpus} GPUs of profile {profile.name}")
        if G > geom.num_blocks:
            raise ValueError(f"--ranks {G} exceeds the {geom.num_blocks} blocks of {geom.name}")
    cache = MaskCache(cfg.seed, table)
    results, skipped, single = _sweep(cfg, cache, geom, profile, progress)
    doc = {
        "kind": "simulate", "model": geom.name, "tokens": geom.num_tokens, "heads": geom.heads,
        "head_dim": geom.head_dim, "dtype": cfg.dtype, "masks": f"synthetic (seed {cfg.seed})"
        + (f", layer 0 of {table.path}" if table else ""), "thresholds": table.path if table else None,
        "fabric": profile.name, "profile": profile.to_dict(), "ranks": list(cfg.ranks),
        "cdf": list(cfg.cdf), "prefetch": cfg.prefetch, "local_first": cfg.local_first, "one_gpu": single,
        "schedule": cfg.schedule.to_dict(), "calls_per_step": cfg.calls_per_step, "results": results,
        "skipped": skipped, "calibration": calibration,
    }
    if cfg.validate is not None:
        paths = list(cfg.validate) or discover_attention()
        cache = MaskCache(cfg.seed) if table else cache  # the rows ran without a table
        doc["validation"], doc["validation_notes"] = validate(paths, cfg.fit_profile, cache, progress)
        doc["validation_sources"] = {str(p): _commit(Path(p)) for p in paths}
        doc["validation_summary"] = validation_summary(doc["validation"])
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    return doc


def _sweep(cfg: SimulateConfig, cache: MaskCache, geom: VideoGeometry, profile: Profile, progress) -> tuple:
    """Every (cdf, G, strategy) row of the one-call sweep with its steps and run (``step_fields``),
    the strategies skipped and why, and the one-GPU call per cdf."""
    strategies = cfg.strategies or strategy_names()
    dtype_bytes, schedule, calls = DTYPE_BYTES[cfg.dtype], cfg.schedule, cfg.calls_per_step
    task = progress.add_task("simulate", total=len(cfg.cdf) * len(cfg.ranks) * len(strategies)) if progress else None
    results, skipped, single = [], [], {}
    for cdf in cfg.cdf:
        masks = cache.get(geom, cdf)
        single[str(cdf)] = one_gpu(masks, geom, profile, cfg.local_first, schedule, calls)
        for G in cfg.ranks:
            for s in strategies:
                if strategy_spec(s).heads_divisible and geom.heads % G:
                    skipped.append({"strategy": s, "ranks": G, "cdf": cdf,
                                    "reason": f"needs heads divisible by G: H={geom.heads}"})
                elif not modelled(s):
                    skipped.append({"strategy": s, "ranks": G, "cdf": cdf,
                                    "reason": f"byte rule {strategy_spec(s).byte_rule!r} has no schedule "
                                              f"in the cost model ({', '.join(SCHEDULES)})"})
                else:
                    row = simulate_one(masks, geom, s, G, profile, placement=cfg.placement,
                                       transport=cfg.transport, prefetch=cfg.prefetch, dtype_bytes=dtype_bytes,
                                       local_first=cfg.local_first, schedule=schedule, calls=calls)
                    row["cdf"] = cdf
                    row["density"] = round(float(masks.float().mean()), 4)
                    results.append(row)
                if progress is not None:
                    progress.advance(task)
    baseline = strategies_where(baseline=True)  # ``speedup_vs_ring``: against the dense baseline
    for row in results:
        ring = next((x for x in results if x["strategy"] in baseline and x["ranks"] == row["ranks"]
                     and x["cdf"] == row["cdf"]), None)
        row["speedup_vs_ring"] = round(ring["predicted_ms"] / row["predicted_ms"], 4) if ring else None
        row["speedup_vs_one_gpu"] = round(single[str(row["cdf"])]["sparse_ms"] / row["predicted_ms"], 4)
    return results, skipped, single


# --- validation --------------------------------------------------------------------------------


def discover_attention(root: Path = Path("bench/results")) -> list[Path]:
    """The newest ``bench attention`` result per model and machine under ``root``."""
    paths = newest("attention", root, per_subject=True)
    if not paths:
        raise ValueError(f"--validate found no attention-*.json under {root}; name the files")
    return paths


def _commit(path: Path) -> str | None:
    """The last commit that touched ``path`` (None outside git or when uncommitted)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h", "--", Path(path).name], cwd=Path(path).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def validate(paths, calibrate_paths=(), cache: MaskCache | None = None, progress=None) -> tuple[list, list]:
    """Predict every strategy row of ``bench attention`` result files with the 2×H200 profiles
    (calibrated on ``calibrate_paths`` when given — never on these rows; widened to the row's G
    for rows of more GPUs), each row in its own order (``row_local_first``) → (rows, notes)."""
    cache = cache or MaskCache()
    profiles, notes = {}, []
    for fabric in ("nvlink", "host"):
        p = get_profile(f"h200x2-{fabric}")
        profiles[fabric] = p
        if calibrate_paths:
            try:
                profiles[fabric] = calibrate(p, calibrate_paths)[0]
            except ValueError as e:  # e.g. the transport file covers the other fabric only
                notes.append(f"{p.name} kept uncalibrated: {e}")
    out = []
    docs = [(Path(p), read_result(p, ("attention",))) for p in paths]
    task = progress.add_task("validate", total=sum(len(d["rows"]) for _, d in docs)) if progress else None
    for path, doc in docs:
        commit = _commit(path)
        for i, row in enumerate(doc["rows"]):
            if progress is not None:
                progress.advance(task)
            where = f"{path.name} row {i}"
            if int(row.get("ranks", 0)) < 2:
                notes.append(f"{where}: {row.get('ranks')} rank(s), not a multi-GPU row")
                continue
            if row.get("ablation"):
                notes.append(f"{where}: ablation step {row['ablation']!r}, not a strategy row")
                continue
            if row.get("env"):
                notes.append(f"{where}: a variant run with {row['env']}, not the code's default")
                continue
            if row.get("call") == "reuse":
                notes.append(f"{where}: a reuse call of a kept plan, not a plan call")
                continue
            if row.get("strategy") not in strategy_names():
                notes.append(f"{where}: {row.get('strategy')!r} is not a registered strategy")
                continue
            try:
                pred = _predict_row(row, profiles, cache)
            except (KeyError, ValueError) as e:
                notes.append(f"{where}: not predicted ({e})")
                continue
            measured = float(row["median_ms"])
            entry = {"model": row["model"], "ranks": int(row["ranks"]), "fabric": row["fabric"],
                     "strategy": row["strategy"], "transport": row["transport"], "cdf": row["cdf"],
                     "local_first": pred["local_first"],
                     "predicted_ms": pred["predicted_ms"], "measured_ms": measured,
                     "error": round(pred["predicted_ms"] / measured - 1.0, 4),
                     "predicted_compute_ms": pred["compute_ms"], "bottleneck": pred["bottleneck"],
                     "source": str(path), "commit": commit}
            for key in SPLIT_KEYS:  # the newer rows' own split
                if key in row:
                    entry[f"measured_{key}"] = row[key]
            entry["predicted_fixed_ms"] = pred["fixed_ms"]
            out.append(entry)
    return out, notes


SPLIT_KEYS = ("mask_ms", "pack_ms", "compute_ms", "merge_ms", "transfer_ms", "exposed_comm_ms")
TOLERANCE = 0.15


def validation_summary(rows: list[dict], tolerance: float = TOLERANCE) -> dict:
    """How many rows the model predicts within ``tolerance``, in all and per fabric: of the
    2-GPU rows (the profiles' own machine) at the top level, of rows of G GPUs under
    ``"ranks_G"``."""
    def count(rs):
        return {"rows": len(rs), "within": sum(abs(r["error"]) <= tolerance for r in rs),
                "median_error": round(statistics.median(r["error"] for r in rs), 4) if rs else None}

    def counts(rs):
        out = count(rs)
        for fabric in sorted({r["fabric"] for r in rs}):
            out[fabric] = count([r for r in rs if r["fabric"] == fabric])
        return out

    out = {"tolerance": tolerance, **counts([r for r in rows if r.get("ranks", 2) == 2])}
    for G in sorted({r.get("ranks", 2) for r in rows} - {2}):
        out[f"ranks_{G}"] = counts([r for r in rows if r.get("ranks") == G])
    return out


def row_local_first(row: dict) -> bool:
    """The ``SparspConfig.local_first`` a ``bench attention`` row ran with: its own field; rows
    written before the field existed (commit 252ebdb) ran in order."""
    value = row.get("local_first", False)
    if not isinstance(value, bool):
        raise ValueError(f"local_first must be true or false, got {value!r}")
    return value


def row_head_order(row: dict, heads: int) -> tuple[int, ...] | None:
    """The head order a ``bench attention`` row's head-sharded strategy ran: by density (None,
    the model's default) where the row says ``head_order: "density"``; rows written before
    ``ulysses`` balanced its heads ran contiguous head groups."""
    value = row.get("head_order")
    if value not in (None, "density"):
        raise ValueError(f"head_order must be \"density\" or absent, got {value!r}")
    return None if value == "density" else contiguous_heads(heads)


def _predict_row(row: dict, profiles: dict, cache: MaskCache) -> dict:
    if row["model"] not in PRESETS:
        raise ValueError(f"unknown model {row['model']!r}")
    profile = profiles[row["fabric"]]
    geom = geometry(row["model"], text=False)
    if "tokens" in row and int(row["tokens"]) != geom.num_tokens:
        geom = geometry(row["model"], text=True)
        if int(row["tokens"]) != geom.num_tokens:
            raise ValueError(f"{row['tokens']} tokens match neither geometry of {row['model']}")
    if row["strategy"] not in strategy_names():
        raise ValueError(f"unknown strategy {row['strategy']!r}")
    masks = cache.get(geom, float(row["cdf"]))
    # the benchmark's calls chose their chunks with the built-in profile of its fabric
    # (``chunks.fabric`` with no ``env.profile()``), not with the calibrated one
    G = int(row["ranks"])
    return simulate_one(masks, geom, row["strategy"], G, profile.widened(G),
                        placement=row.get("placement", "auto"), transport=row["transport"],
                        chunking=get_profile(f"h200x2-{row['fabric']}").widened(G),
                        local_first=row_local_first(row), head_order=row_head_order(row, geom.heads))
