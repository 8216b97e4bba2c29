"""The ``sparsp simulate`` job: sweep G per strategy on a profile, fit it, validate, write.

Masks are ``sparsp analyze``'s (``workloads.synthetic_masks``, same seed) on the geometry the
attention benchmark runs (video tokens only unless ``text``), and every strategy runs with the
placement it registered for the benchmarks (``placement="auto"``). ``--fit-profile`` fits a
machine profile to ``bench transport`` and ``bench kernel`` results only; ``--validate`` predicts every
strategy row of ``bench attention`` results with the 2×H200 profiles (widened to the row's G,
``Profile.widened``), each in its own order (its ``local_first``; rows written before the flag
existed ran in order), and never fits on them.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..analysis import DTYPE_BYTES, read_table
from ..geometry import PRESETS, VideoGeometry, preset
from ..cost.balance import contiguous_heads
from ..cost.figures import Blocks, measure, pair_flops
from ..cost.mesh import Mesh
from ..cost.model import LOCAL_FIRST, SCHEDULES, build_work
from ..cost.profiles import Profile, get_profile
from ..cost.schedule import Schedule, call_works, run_cost
from ..cost.timeline import bottleneck, mask_phase_ms, timeline
from ..placement import make_placement
from ..strategies.registry import strategies_where, strategy_names, strategy_spec
from .calibrate import calibrate, newest, read_result

PLACEMENTS = ("auto", "contiguous", "periodic")
RANKS = (2, 4, 8)
"""The G simulated when none are given: those of them the profile holds (``default_ranks``)."""
BRANCHES = {"wan2.1-14b": 2, "wan2.1-1.3b": 2, "ltx-video": 2, "ltx-video-161f": 2, "ltx-2": 3, "hunyuan-video": 1}
"""Guidance branches per denoising step of each preset's Diffusers 0.42.1 pipeline at its
defaults: Wan's cond and uncond forwards; LTX-Video's batched [uncond, cond] pair (two branches
in one call, priced here as two calls); LTX-2's cond/uncond pair, STG and modality forwards;
HunyuanVideo's one (a second only with ``true_cfg_scale`` > 1 and a negative prompt)."""


def default_ranks(gpus: int) -> tuple[int, ...]:
    """``RANKS`` up to ``gpus`` (the profile's, or the largest of several): ``sparsp simulate
    --fabric h200x2-nvlink`` simulates G = 2 without being told."""
    held = tuple(G for G in RANKS if G <= gpus)
    if not held:
        raise ValueError(f"a profile of {gpus} GPU(s) holds no G of {', '.join(map(str, RANKS))}; give --ranks")
    return held


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulateConfig:
    model: str = "hunyuan-video"
    """Preset name (``sparsp.geometry.PRESETS``)."""
    ranks: tuple[int, ...] = ()
    """Sequence-parallel degrees G to simulate; empty: ``default_ranks`` of the profile(s)."""
    fabric: str = "pcie4-8gpu-nop2p"
    """A built-in profile name or a profile JSON file."""
    cdf: tuple[float, ...] = (0.9,)
    strategies: tuple[str, ...] = ()
    """Empty: every registered strategy."""
    placement: str = "auto"
    """``auto``: each strategy's registered placement (as ``bench attention`` runs it)."""
    transport: str | None = None
    """A transport of the profile; None = its default (the copy-engine one)."""
    text: bool = False
    """Include the model's text tokens (``bench attention`` leaves them out by default)."""
    dtype: str = "bf16"
    prefetch: int = 1
    local_first: bool | None = LOCAL_FIRST
    """``SparspConfig.local_first`` of the simulated calls: strategies registered
    ``local_first`` launch the local kernel before the host read — None (the config's default,
    automatic): where ``model.local_first_pays`` says so on the simulated profile and transport,
    as ``Call.local_first_pays`` decides; True: always —; False: every strategy in order
    (``--no-local-first``)."""
    seed: int = 0
    fit_profile: tuple[Path, ...] = ()
    """``bench transport`` / ``bench kernel`` result files to fit the profile to (of its GPU:
    ``calibrate.check_machine``)."""
    validate: tuple[Path, ...] | None = None
    """``bench attention`` result files to predict; () = discover ``bench/results/attention-*.json``;
    None = no validation."""
    density_profile: Path | None = None
    """A per-(step, layer, head) density profile (``sparsp.workloads.density``) matching the preset: the
    whole model's step is predicted, each layer on its own calibrated masks (``simulate.layers``)."""
    step: int | None = None
    """With ``density_profile``: the profile's step (1-based); None: the mean over steps."""
    calibration: Path | None = None
    """With ``density_profile``: fitted parameters to reuse (``sparsp.workloads.calibration`` JSON);
    None: fit them now (and write ``out``/calibration.json)."""
    layers: int | None = None
    """With ``density_profile``: the model's first N layers; None: all of them."""
    fabrics: tuple[str, ...] = ()
    """With ``density_profile``: the profiles to predict on (names, profile JSON files, or
    ``all``: every built-in one); empty: ``fabric`` alone."""
    out: Path | None = None
    """Where a calibration fitted now is written (``density_profile``)."""
    steps: int = 50
    """Denoising steps of the run whose cost is reported (``cost.schedule``)."""
    dense_steps: int = 0
    """``SparspConfig.dense_steps`` of the run."""
    replan_every: int = 1
    """``SparspConfig.replan_every`` of the run."""
    branches: int | None = None
    """Guidance branches per step (the model's calls per step are its layers × these); None:
    the preset's pipeline default (``BRANCHES``)."""
    thresholds: Path | None = None
    """A per-(layer, head) thresholds table (``sparsp.thresholds``): each layer's masks at its
    own thresholds (the one-call sweep simulates layer 0's call)."""
    mesh: str | None = None
    """``auto`` or ``cfg=C,ulysses=U`` (``cost.mesh.Mesh.parse``; sp takes the rest of each G):
    the step of a device mesh (``simulate.meshes``) instead of the one-call sweep."""

    @property
    def schedule(self) -> Schedule:
        return Schedule(steps=self.steps, dense_steps=self.dense_steps, replan_every=self.replan_every)

    @property
    def calls_per_step(self) -> int:
        """Attention calls per denoising step: the model's layers × its branches."""
        return preset(self.model).layers * (BRANCHES[self.model] if self.branches is None else self.branches)

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"unknown --model {self.model!r}; choose one of {', '.join(PRESETS)}")
        for G in self.ranks:
            if not isinstance(G, int) or isinstance(G, bool) or G < 2:
                raise ValueError(f"--ranks must be ints >= 2, got {G!r}")
        for c in self.cdf:
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"--cdf values must lie in [0, 1], got {c}")
        for s in self.strategies:
            if s not in strategy_names():
                raise ValueError(f"unknown --strategy {s!r}; choose from {', '.join(strategy_names())}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"--placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"--prefetch must be an int >= 1, got {self.prefetch!r}")
        if self.local_first is not None and not isinstance(self.local_first, bool):
            raise ValueError(f"local_first must be None (automatic), True or False, got {self.local_first!r}")
        self.schedule  # noqa: B018  (its checks: ValueError before any work)
        if self.mesh is not None and self.mesh != "auto":
            for G in self.ranks:
                Mesh.parse(self.mesh, G)
        if self.branches is not None and (not isinstance(self.branches, int) or self.branches < 1):
            raise ValueError(f"--branches must be an int >= 1, got {self.branches!r}")
        if self.density_profile is None:
            for name, value in (("--step", self.step), ("--calibration", self.calibration),
                                ("--layers", self.layers),
                                ("several --fabric", None if self.mesh is not None else self.fabrics or None)):
                if value is not None:
                    raise ValueError(f"{name} needs --density-profile")
        else:
            if self.validate is not None:
                raise ValueError("--validate cannot apply with --density-profile: it predicts bench attention "
                                 "rows, measured on synthetic masks; drop one of them")
            if self.text:
                raise ValueError("--text cannot apply with --density-profile: the calibrated masks are those of "
                                 "`sparsp analyze`, on the preset's whole sequence; drop --text")
            if self.fit_profile and len(self.fabric_names()) > 1:
                raise ValueError("--fit-profile fits one profile: give one --fabric with it")
            given = [name for name, on in (("--steps", self.steps != 50), ("--dense-steps", self.dense_steps != 0),
                                           ("--replan-every", self.replan_every != 1),
                                           ("--branches", self.branches is not None), ("--mesh", self.mesh is not None))
                     if on]
            if given:
                raise ValueError(f"{' and '.join(given)} cannot apply with --density-profile: it predicts one step "
                                 f"of every layer; drop {'it' if len(given) == 1 else 'them'}")
            if self.layers is not None and self.layers < 1:
                raise ValueError(f"--layers must be >= 1, got {self.layers}")

    def fabric_names(self) -> tuple[str, ...]:
        """The profiles asked for: ``fabrics`` (``all``: every built-in one), else ``fabric``."""
        from ..names import PROFILE_NAMES

        names = self.fabrics or (self.fabric,)
        out = tuple(dict.fromkeys(n for f in names for n in (PROFILE_NAMES if f == "all" else (f,))))
        return out


def geometry(model: str, text: bool = False) -> VideoGeometry:
    g = preset(model)
    return g if text else replace(g, text_tokens=0)


class MaskCache:
    """Synthetic masks bool [heads, nB, nB] of layer 0 per (geometry, cdf), made once per run;
    ``table``: a ``sparsp.thresholds.ThresholdTable`` whose layer-0 values replace the cdf."""

    def __init__(self, seed: int = 0, table=None) -> None:
        self.seed, self.table = seed, table
        self._masks: dict = {}

    def get(self, geom: VideoGeometry, cdf: float) -> torch.Tensor:
        from ..workloads.synthetic import synthetic_masks

        key = (geom, float(cdf))
        if key not in self._masks:
            self._masks[key] = synthetic_masks(geom, [float(cdf)], seed=self.seed,
                                               thresholds=self.table)[float(cdf)][0]
        return self._masks[key]


def modelled(strategy: str) -> bool:
    """Whether the cost model schedules ``strategy``: its byte rule is one of ``SCHEDULES`` (a
    strategy registered with a byte-rule function is accounted by ``sparsp analyze`` only)."""
    rule = strategy_spec(strategy).byte_rule
    return isinstance(rule, str) and rule in SCHEDULES


def placement_for(strategy: str, kind: str) -> str:
    return strategy_spec(strategy).placement if kind == "auto" else kind


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


# --- outputs -----------------------------------------------------------------------------------


def write_outputs(doc: dict, out: Path, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "simulate.json"
    path.write_text(json.dumps(doc, indent=1))
    paths = [path]
    if doc.get("calibration"):
        prof = out / f"profile-{doc['fabric']}.json"
        prof.write_text(json.dumps(doc["profile"], indent=1))
        paths.append(prof)
    return paths + (plot(doc, out) if plots else [])


def plot(doc: dict, out: Path) -> list[Path]:
    """Latency and speedup versus G per strategy (the paper's Figures 17–18, attention level)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["results"]
    fabric = doc["fabric"] if len(str(doc["fabric"])) <= 40 else "…" + str(doc["fabric"])[-39:]
    about = f"{doc['model']} on {fabric}, {doc['masks']} masks (simulated)"
    styles = ["-", "--", ":", "-."]
    paths = []
    for what, ylabel, name, heading in (
        ("predicted_ms", "predicted ms per attention call (slowest rank)", "latency_vs_ranks.png",
         "Predicted attention latency versus the number of ranks"),
        ("speedup_vs_ring", "speedup over the dense ring at the same G", "speedup_vs_ranks.png",
         "Predicted speedup over the dense ring versus the number of ranks"),
    ):
        title = "\n".join(textwrap.wrap(heading, 66) + textwrap.wrap(about, 66))
        fig, ax = plt.subplots(figsize=(7.5, 5))
        for ci, cdf in enumerate(doc["cdf"]):
            for s in dict.fromkeys(r["strategy"] for r in rows):
                pts = [(r["ranks"], r[what]) for r in rows if r["strategy"] == s and r["cdf"] == cdf
                       and r[what] is not None]
                if pts:
                    ax.plot(*zip(*pts), marker="o", linestyle=styles[ci % len(styles)],
                            label=s if len(doc["cdf"]) == 1 else f"{s}, cdf {cdf}")
            if what == "predicted_ms":
                one = doc["one_gpu"][str(cdf)]["sparse_ms"]
                ax.axhline(one, color="grey", lw=0.8, linestyle=styles[ci % len(styles)])
                ax.annotate(f"1 GPU, {strategies_where(primary=True)[0]} (cdf {cdf})", (min(doc["ranks"]), one), fontsize=7,
                            color="grey", va="bottom")
        if what == "speedup_vs_ring":
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="ranks G", ylabel=ylabel, title=title, xscale="log", xticks=doc["ranks"])
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if what == "predicted_ms":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        paths.append(out / name)
    return paths
