"""``sparsp analyze``: what would sparsity save on my model and GPU count? (CPU only)

For each CDF threshold and placement, the exact bytes every strategy moves per attention call
(summed over the analysed layers), the reduction against the dense ring, the mask density, how
evenly each strategy spreads the kept attention work over the ranks, a run's bytes under a
schedule, and three plots (``analysis_plots``): bytes versus G, the sharing curve (how many
local query blocks read each remote K block) and the relay ring's bytes over direct routing.
Masks come from the synthetic generator (``sparsp.workloads.synthetic``; ``--thresholds``:
each layer at its own), from the generator calibrated to a per-head density profile
(``--density-profile``, ``sparsp.workloads.calibration``: then also bytes and per-rank
imbalance for every layer, and a plot of both across layers) or from a recorded trace
(``--trace``). A head-sharded strategy (``ulysses``) is skipped, with a note, where the heads
do not divide by G, as it cannot run there; where it runs, its balance is also given with its
heads assigned to ranks by density (``cost.balance``), as it runs. With ``--mesh``, the bytes
of one call on one half of a cfg × ulysses × sp mesh (``cost.mesh``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import demand, masks as masks_mod, placement as placement_mod
from .cost.balance import balanced_heads, head_balance, max_over_mean
from .cost.mesh import Mesh
from .cost.schedule import Schedule
from .geometry import VideoGeometry, preset
from .preflight import staged
from .strategies import comm_bytes, strategy_names
from .strategies.registry import strategies_where, strategy_spec

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
SWEEP_RANKS = (2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True, slots=True)
class AnalyzeConfig:
    model: str = "hunyuan-video"
    """Preset name (``sparsp.geometry.PRESETS``); not read when a trace is given (the command
    line refuses ``--model`` with ``--trace``)."""
    ranks: int = 8
    """Sequence-parallel degree G."""
    cdf: tuple[float, ...] = (0.85, 0.9, 0.95)
    """SpargeAttn CDF thresholds to analyse (synthetic masks only)."""
    placements: tuple[str, ...] = ("contiguous", "periodic")
    strategies: tuple[str, ...] = ()
    """Strategies to account (empty: every registered one)."""
    trace: Path | None = None
    layers: int | None = 1
    """How many synthetic layers (different seeds and head mixes) to sum over; with a trace,
    its first ``layers`` (None: all; more than the trace holds is an error)."""
    dtype: str = "bf16"
    seed: int = 0
    out: Path | None = None
    plots: bool = True
    density_profile: Path | None = None
    """A per-(step, layer, head) density profile (``sparsp.workloads.density``) whose layers and heads match
    the preset: the synthetic heads are calibrated to it (``sparsp.workloads.calibration``)."""
    step: int | None = None
    """The profile's step (1-based) to calibrate to; None: the mean over steps."""
    calibration: Path | None = None
    """Fitted parameters to reuse (``sparsp.workloads.calibration`` JSON); None: fit them now and write
    them to ``out``/calibration.json."""
    calibration_rows: int = 128
    """Sampled query rows per head when fitting."""
    thresholds: Path | None = None
    """A per-(layer, head) thresholds table (``sparsp.thresholds``): each layer's masks at its
    own thresholds, the layers it leaves out at each ``cdf`` (not with a trace)."""
    steps: int = 50
    """Denoising steps of the run whose bytes are reported (``run_bytes``)."""
    dense_steps: int = 0
    """``SparspConfig.dense_steps`` of the run: its first steps move the dense path's bytes."""
    replan_every: int = 1
    """``SparspConfig.replan_every`` of the run (a reuse step moves its kept plan's bytes)."""
    mesh: str | None = None
    """``cfg=C,ulysses=U`` (``cost.mesh.Mesh.parse``; sp = ``ranks`` / (C·U)): bytes of one call
    on one half of that mesh, the sp strategy's on each Ulysses rank's heads and the
    all-to-alls' apart (``cost.mesh.mesh_comm_bytes``)."""

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"--ranks must be >= 2, got {self.ranks}")
        if self.thresholds is not None and self.trace is not None:
            raise ValueError("--thresholds cannot apply with --trace: the trace's masks were made at its own "
                             "thresholds; drop one of them")
        if self.thresholds is not None:
            read_table(self.thresholds, preset(self.model))  # a bad table: one line, before any work
        Schedule(steps=self.steps, dense_steps=self.dense_steps, replan_every=self.replan_every)
        if self.mesh is not None:
            Mesh.parse(self.mesh, self.ranks)
        if self.density_profile is not None and self.trace is not None:
            raise ValueError("--density-profile cannot apply with --trace: a trace holds real masks already")
        for name, value in (("--step", self.step), ("--calibration", self.calibration)):
            if value is not None and self.density_profile is None:
                raise ValueError(f"{name} needs --density-profile")
        if self.layers is None and self.trace is None and self.density_profile is None:
            raise ValueError("layers=None (all of them) needs a trace or a density profile")
        if self.layers is not None and self.layers < 1:
            raise ValueError(f"--layers must be >= 1, got {self.layers}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        for c in self.cdf:
            if not 0.0 <= c <= 1.0:
                raise ValueError(f"--cdf values must lie in [0, 1], got {c}")
        for p in self.placements:
            if p not in placement_mod.PLACEMENTS:
                raise ValueError(f"unknown placement {p!r}; choose from {list(placement_mod.PLACEMENTS)}")
        known = strategy_names()
        for s in self.strategies:
            if s not in known:
                raise ValueError(f"unknown strategy {s!r}; choose from {list(known)}")
        if not self.strategies:
            object.__setattr__(self, "strategies", known)


def read_table(path, geom: VideoGeometry):
    """The thresholds table at ``path`` (``--thresholds``) checked against ``geom``'s layers and
    heads: a ``sparsp.thresholds.ThresholdTable``, or one ``ValueError`` line naming the file."""
    from .thresholds import read_thresholds

    table = read_thresholds(path, option="--thresholds")
    table.check(layers=geom.layers, heads=geom.heads, what=geom.name)
    return table


def load_masks(cfg: AnalyzeConfig, progress=None) -> tuple:
    """Masks per CDF threshold, bool [layers, heads, nB, nB], where they came from, and with a
    density profile a fourth item: the calibration's summary."""
    from . import workloads

    if cfg.trace is not None:
        from .workloads.traces import load_trace

        trace = load_trace(cfg.trace)
        have = trace.masks.shape[0]
        if cfg.layers is not None and cfg.layers > have:
            raise ValueError(f"--layers {cfg.layers}: the trace {cfg.trace} holds {have} layer(s)")
        return (trace.geometry, {float(trace.cdf_threshold): trace.masks[: cfg.layers or have]},
                f"trace:{trace.source}")
    geom = preset(cfg.model)
    table = None if cfg.thresholds is None else read_table(cfg.thresholds, geom)
    if cfg.density_profile is not None:
        return _calibrated_masks(cfg, geom, table, progress)
    masks = workloads.synthetic_masks(geom, list(cfg.cdf), layers=cfg.layers, seed=cfg.seed, thresholds=table)
    return geom, {float(c): m for c, m in masks.items()}, "synthetic" + (f", thresholds {table.path}" if table else "")


def _calibrated_masks(cfg: AnalyzeConfig, geom: VideoGeometry, table, progress):
    """Masks of the generator calibrated to ``cfg.density_profile`` (fitted now, or read from
    ``cfg.calibration``), where they came from, and the calibration's summary."""
    from .workloads import calibration as cal_mod, synthetic as workloads
    from .workloads.density import read_profile

    profile = read_profile(cfg.density_profile, expected=geom)
    if cfg.step is not None:
        profile.step(cfg.step)  # a step outside the profile: its one-line error, before any work
    n = geom.layers if cfg.layers is None else cfg.layers
    if n > geom.layers:
        raise ValueError(f"--layers {n}: {geom.name} has {geom.layers} layers")
    if cfg.calibration is not None:
        cal = cal_mod.read_calibration(cfg.calibration, geometry=geom, source=profile.source, step=cfg.step)
        if len(cal.layers) < n:
            raise ValueError(f"{cfg.calibration}: fitted {len(cal.layers)} layer(s), {n} asked for")
        written = None
    else:
        cal = cal_mod.calibrate(geom, profile, step=cfg.step, layers=n, seed=cfg.seed, rows=cfg.calibration_rows,
                                on_layer=_fit_progress(progress, n))
        # Written at once, so a later failure does not lose the fit: calibrate once, load many.
        written = None
        if cfg.out is not None:
            with staged(cfg.out) as temp:
                cal.write(temp / "calibration.json")
            written = cfg.out / "calibration.json"
    task = progress.add_task("calibrated masks", total=n) if progress else None
    masks = workloads.synthetic_masks(geom, list(cfg.cdf), layers=n, seed=cal.seed, mix=cal.mix,
                                      heads=cal.head_params()[:n], on_layer=lambda _: _advance(progress, task),
                                      thresholds=table)
    fits = cal.summary_rows()[:n]
    heads = [h for ly in cal.layers[:n] for h in ly.heads]
    info = {
        "profile": str(cfg.density_profile), "source": profile.source, "step": cfg.step,
        "mass": profile.mass, "seed": cal.seed, "rows": cal.rows,
        "file": str(written or cfg.calibration) if (written or cfg.calibration) else None,
        "fitted_now": cfg.calibration is None,
        "within": sum(h.within for h in heads) / len(heads),
        "unreachable": sum(not h.reachable for h in heads), "per_layer": fits,
    }
    where = "mean over steps" if cfg.step is None else f"step {cfg.step}"
    where += f", thresholds {table.path}" if table else ""
    return geom, {float(c): m for c, m in masks.items()}, f"calibrated:{profile.source} ({where})", info


def runnable(strategies, heads: int, ranks: int) -> tuple[tuple[str, ...], list[dict]]:
    """The strategies that can run with ``heads`` at G = ``ranks``, and a skip record for each
    other one (a head-sharded strategy needs heads % G == 0; ``sparsp simulate`` skips it alike)."""
    keep, skipped = [], []
    for s in strategies:
        if strategy_spec(s).heads_divisible and heads % ranks:
            skipped.append({"strategy": s, "ranks": ranks,
                            "reason": f"needs heads divisible by G: {heads} heads, G={ranks}"})
        else:
            keep.append(s)
    return tuple(keep), skipped


def compute_balance(m: torch.Tensor, pl, strategy: str, head_orders=None) -> float:
    """Attention work of the busiest rank over the mean (1.0: balanced), from ``m`` (bool
    [layers, heads, nB, nB]). Work is the token pairs a rank's kernel computes: every pair of a
    dense strategy, the kept pairs of a sparse one; a sequence-sharded strategy computes its
    own query blocks for every head, a head-sharded one (``ulysses``) every query block of its
    H/G heads, so the heads' different densities decide its balance. ``head_orders``: per
    layer, a head-sharded strategy's heads in rank order (``cost.balance.balanced_heads``);
    None: contiguous head groups."""
    spec = strategy_spec(strategy)
    lengths = pl.geometry.block_lengths().double()
    G = pl.ranks
    per_rank = torch.zeros(G, dtype=torch.float64)
    for i, layer in enumerate(m):  # one layer at a time: a whole model's masks in float64 would not fit
        kept = layer.double() if spec.sparse else torch.ones_like(layer, dtype=torch.float64)
        work = (kept @ lengths) * lengths  # [heads, nQ]: token pairs per query block
        if spec.heads_divisible:
            per_head = work.sum(dim=1)
            if head_orders is not None:
                per_head = per_head[list(head_orders[i])]
            per_rank += per_head.reshape(G, -1).sum(dim=1)
        else:
            per_rank.index_add_(0, pl.owner.long(), work.sum(dim=0))
    return max_over_mean(per_rank.tolist())


def head_orders(m: torch.Tensor, ranks: int) -> list[tuple[int, ...]]:
    """Per layer of ``m`` (bool [layers, heads, nB, nB]): the balanced head order of a
    head-sharded strategy at G = ``ranks`` (``cost.balance.balanced_heads`` of each head's kept
    blocks)."""
    return [balanced_heads(layer.sum(dim=(1, 2)).tolist(), ranks) for layer in m]


def placement_choice(results: list[dict]) -> list[dict]:
    """Per (cdf, strategy) analysed under several placements: its default placement
    (``StrategySpec.placement``, what ``parallelize(placement="auto")`` runs), the placement
    that moves the fewest bytes over all ranks (the default where they tie), each placement's
    bytes, and the default's bytes over the fewest (None where the fewest are 0)."""
    by: dict[tuple, dict[str, int]] = {}
    for r in results:
        by.setdefault((r["cdf"], r["strategy"]), {})[r["placement"]] = r["bytes_total"]
    rows = []
    for (cdf, strategy), sizes in by.items():
        if len(sizes) < 2:
            continue
        default = strategy_spec(strategy).placement
        fewest = min(sizes, key=lambda p: (sizes[p], p != default))
        ratio = sizes[default] / sizes[fewest] if default in sizes and sizes[fewest] else None
        rows.append({"cdf": cdf, "strategy": strategy, "default": default, "fewest_bytes": fewest,
                     "bytes_total": sizes, "default_over_fewest": ratio})
    return rows


def placement_lines(doc: dict) -> list[str]:
    """Which placement moves the fewest bytes: per cdf for the primary strategy (with the
    placement to pass where its default loses), one line for the others."""
    rows = doc.get("placement_choice", [])
    primary = strategies_where(primary=True)[0]
    reduction = {(r["cdf"], r["placement"], r["strategy"]): r["reduction_vs_ring"] for r in doc["results"]}

    def vs_ring(c, placement, suffix=" vs ring"):
        red = reduction.get((c["cdf"], placement, c["strategy"]))
        return "" if red is None else f" ({-100 * red:+.1f}%{suffix})"

    lines = []
    for c in (c for c in rows if c["strategy"] == primary):
        head, fewest, default = f"placement for {primary}, cdf {c['cdf']:.2f}: ", c["fewest_bytes"], c["default"]
        if fewest == default:
            lines.append(f"{head}its default, {default}, moves the fewest bytes{vs_ring(c, default)}")
            continue
        times = "" if c["default_over_fewest"] is None else f" {c['default_over_fewest']:.2f}x as many"
        lines.append(f"{head}{fewest} moves the fewest bytes{vs_ring(c, fewest)}, the default {default}{times}"
                     f"{vs_ring(c, default, '')}: pass placement=\"{fewest}\" to sparsp.parallelize for this "
                     f"workload")
    others: dict[str, dict] = {}
    for c in (c for c in rows if c["strategy"] != primary):
        seen = others.setdefault(c["strategy"], {"default": c["default"], "wins": set(), "ties": True})
        seen["wins"].add(c["fewest_bytes"])
        seen["ties"] &= len(set(c["bytes_total"].values())) == 1
    parts, same = [], [s for s, seen in others.items() if seen["ties"]]
    for s, seen in ((s, seen) for s, seen in others.items() if not seen["ties"]):
        if seen["wins"] == {seen["default"]}:
            parts.append(f"{s} {seen['default']} (its default)")
        else:
            parts.append(f"{s} {' or '.join(sorted(seen['wins']))}{' by cdf' if len(seen['wins']) > 1 else ''} "
                         f"(default {seen['default']})")
    if same:
        parts.append(f"{', '.join(same)}: the same under every placement")
    if parts:
        lines.append("fewest bytes, other strategies: " + "; ".join(parts))
    return lines


def notes(doc: dict) -> list[str]:
    """Lines printed under ``analyze``'s table: strategies skipped, which placement moves the
    fewest bytes, and what bytes alone do not say."""
    lines = [f"skipped {s['strategy']} at G={s['ranks']}: {s['reason']}" for s in doc.get("skipped", [])]
    lines += placement_lines(doc)
    head_sharded = set(strategies_where(heads_divisible=True))
    shown = {r["strategy"] for r in doc["results"]}
    for s in sorted(head_sharded & shown):
        lines.append(
            f"{s}: its bytes are Q, K, V and the output once per call whatever the mask (so it can move "
            f"the fewest at larger G), but sparsity never shrinks them, its all-to-all cannot overlap "
            f"the kernel, each rank computes whole heads (compute max/mean: the heads' densities differ), "
            f"and it runs only where G divides the heads; the sequence-sharded strategies overlap their "
            f"transfers with the kernel and shrink with the mask. `sparsp simulate` predicts the time.")
        seen = set()  # a head-sharded strategy's balance does not depend on the placement
        for r in doc["results"]:
            if r["strategy"] == s and "balanced_compute_max_over_mean" in r and r["cdf"] not in seen:
                seen.add(r["cdf"])
                lines.append(f"  {s}, cdf {r['cdf']:.2f}: compute max/mean "
                             f"{r['balanced_compute_max_over_mean']:.2f}x as it runs (heads given to ranks "
                             f"by density, cost.balance), {r['compute_max_over_mean']:.2f}x with contiguous "
                             f"head groups")
    return lines


def print_run(doc: dict, console, fmt) -> None:
    """With a schedule (some dense steps or plans reused), the bytes of a run under it beside
    a run whose every step plans, per row (``fmt``: how bytes are written)."""
    sched = doc["schedule"]
    if not sched["scheduled"]:
        return
    from rich.table import Table

    table = Table(title=f"bytes of a run of {sched['steps']} steps over the {doc['layers']} analysed layer(s): "
                        f"{sched['summary']}")
    for col in ("cdf", "placement", "strategy", "plan step", "dense step", "run", "every step plans", "change"):
        table.add_column(col, justify="left" if col in ("placement", "strategy") else "right")
    for r in doc["results"]:
        b = r["run_bytes"]
        change = b["total"] / b["every_step_plans"] - 1 if b["every_step_plans"] else 0.0
        table.add_row(f"{r['cdf']:.2f}", r["placement"], r["strategy"], fmt(b["plan_step"]), fmt(b["dense_step"]),
                      fmt(b["total"]), fmt(b["every_step_plans"]), f"{100 * change:+.1f}%")
    console.print(table)
    console.print("a dense step moves the strategy's dense path's bytes (the ring's for a sequence-sharded strategy, "
                  "its own all-to-all for a head-sharded one); a reuse step moves its kept plan's, the plan step's",
                  markup=False, highlight=False)


def calibration_lines(doc: dict) -> list[str]:
    """Lines printed under ``analyze``'s table for calibrated masks: how well the heads fit, and
    per placement the model's per-rank imbalance."""
    cal = doc.get("calibration")
    if not cal:
        return []
    how = "fitted now" if cal["fitted_now"] else "read"
    where = f", {cal['file']}" if cal["file"] else ""
    lines = [(f"calibration ({how}{where}): {100 * cal['within']:.0f}% of heads within tolerance of the "
              f"profile's token density (verified on other rows and noise), {cal['unreachable']} head(s) "
              f"out of the knob's reach")]
    worst = min(cal["per_layer"], key=lambda r: r["within"])
    lines.append(f"  fewest within: layer {worst['layer']} ({100 * worst['within']:.0f}%); its worst head "
                 f"{worst['worst_head']} ({worst['worst_kind']}) target {worst['worst_target']:.4f}, "
                 f"measured {worst['worst_density']:.4f}")
    groups: dict[tuple, list[dict]] = {}
    for r in doc.get("imbalance", []):
        groups.setdefault((r["cdf"], r["placement"]), []).append(r)
    for (cdf, pname), rows in groups.items():
        recv = ", ".join(f"{r['strategy']} {r['recv_max_over_mean']:.2f}x" for r in rows)
        seq = [r for r in rows if "balanced_kept_max_over_mean" not in r]
        kept = f"kept blocks {seq[0]['kept_max_over_mean']:.2f}x; " if seq else ""
        lines.append(f"cdf {cdf:.2f}, {pname}: busiest rank / mean over the model: {kept}received bytes {recv}")
        for r in rows:
            if "balanced_kept_max_over_mean" in r:
                lines.append(f"  {r['strategy']}: kept blocks of the busiest rank / mean "
                             f"{r['kept_max_over_mean']:.2f}x with contiguous heads, "
                             f"{r['balanced_kept_max_over_mean']:.2f}x with heads given to ranks by density "
                             f"(how ulysses runs)")
    layers = [r for r in doc.get("per_layer", []) if "balanced_kept_max_over_mean" in r]
    if layers:
        worst = max(layers, key=lambda r: r["kept_max_over_mean"])
        lines.append(f"  {worst['strategy']}'s most unbalanced layer: {worst['layer']} (cdf {worst['cdf']:.2f}): "
                     f"rank {worst['densest_rank']} holds the densest heads, {worst['kept_max_over_mean']:.2f}x "
                     f"the mean; balanced {worst['balanced_kept_max_over_mean']:.2f}x")
    return lines


def _bytes_over_layers(m: torch.Tensor, pl, strategy: str, head_dim: int, dtype_bytes: int,
                       each: list | None = None, mesh: Mesh | None = None) -> dict:
    """Bytes summed over the layers of ``m`` (with ``mesh``: its ``sp`` and ``ulysses`` parts
    too); each layer's own figures go to ``each`` if given."""
    total = None
    for layer in m:
        b = comm_bytes(layer, pl, strategy, head_dim=head_dim, dtype_bytes=dtype_bytes, mesh=mesh)
        if each is not None:
            each.append(b)
        if total is None:
            total = {k: b[k] for k in ("total", "per_rank", "sp", "ulysses") if k in b}
            continue
        for key in [k for k in ("sp", "ulysses") if k in b]:
            total[key] = _summed(total[key], b[key])
        total.update(_summed(total, b))
    return total


def _summed(a: dict, b: dict) -> dict:
    return {"total": a["total"] + b["total"], "per_rank": [x + y for x, y in zip(a["per_rank"], b["per_rank"])]}


def run_bytes(schedule: Schedule, *, plan: int, dense: int) -> dict:
    """Bytes of a run under ``schedule`` from one step's (the analysed layers' calls): a dense
    step moves the dense path's, a plan step and a reuse step the plan's (the kept plan moves
    the same bytes); and the same run with every step planning."""
    n = schedule.counts()
    total = n["dense"] * dense + (n["plan"] + n["reuse"]) * plan
    return {"total": total, "every_step_plans": schedule.steps * plan, "dense_step": dense, "plan_step": plan}


def analyze(cfg: AnalyzeConfig, progress=None) -> dict:
    """Run the analysis and return the ``analysis.json`` document."""
    t0 = time.perf_counter()
    geom, masks_by_cdf, source, *calibrated = load_masks(cfg, progress)
    mesh = None if cfg.mesh is None else Mesh.parse(cfg.mesh, cfg.ranks)
    if mesh is not None:
        mesh.check(geom.heads, geom.num_blocks)
    ranks = cfg.ranks if mesh is None else mesh.sp
    try:
        placements = {k: placement_mod.make_placement(k, geom, ranks) for k in cfg.placements}
    except ValueError as e:
        if cfg.trace is None or ranks <= geom.num_blocks:
            raise
        raise ValueError(f"{e}: the trace {cfg.trace} has {geom.num_tokens} tokens in {geom.block_size}-token "
                         f"blocks; record it with a smaller --block-size (sparsp trace --block-size N) "
                         f"or use fewer --ranks") from None
    strategies, skipped = runnable(cfg.strategies, geom.heads // (mesh.ulysses if mesh else 1), ranks)
    task = progress.add_task("bytes per strategy", total=len(masks_by_cdf) * (len(placements) * len(strategies) + 1)) \
        if progress else None
    results, stats, by_layer = [], [], {}  # by_layer: (cdf, placement, strategy) -> bytes of each layer
    for cdf, m in masks_by_cdf.items():
        stats.append({"cdf": cdf, "density": masks_mod.density(m), "head_density": masks_mod.head_density(m).tolist(),
                      "patterns": masks_mod.pattern_shares(m[0], geom)})
        _advance(progress, task)
        results += _rows(cfg, m, cdf, placements, strategies, geom, mesh, by_layer if calibrated else None,
                         lambda: _advance(progress, task))
    # ``reduction_vs_ring``: against the dense baseline (registered ``baseline``), if analysed
    baseline = next((s for s in strategies_where(baseline=True) if s in strategies), None)
    for r in results:
        ring = next(x for x in results if x["cdf"] == r["cdf"] and x["placement"] == r["placement"]
                    and x["strategy"] == baseline) if baseline else None
        r["reduction_vs_ring"] = 1.0 - r["bytes_total"] / ring["bytes_total"] if ring else None
    doc = {
        "model": geom.name, "ranks": cfg.ranks, "dtype": cfg.dtype, "head_dim": geom.head_dim, "heads": geom.heads,
        "tokens": geom.num_tokens, "blocks": geom.num_blocks, "block_size": geom.block_size,
        "layers": int(next(iter(masks_by_cdf.values())).shape[0]), "masks": source,
        "schedule": _schedule(cfg).to_dict(), "mesh": None if mesh is None else _mesh_doc(mesh, geom, cfg),
        "results": results, "mask_stats": stats, "skipped": skipped,
        "placement_choice": placement_choice(results),
    }
    if calibrated:
        doc["calibration"] = calibrated[0]
        doc["per_layer"], doc["imbalance"] = _per_layer(masks_by_cdf, placements, strategies, by_layer)
    doc["sweep"] = _sweep(geom, masks_by_cdf, cfg, DTYPE_BYTES[cfg.dtype], progress)
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    return doc


def _schedule(cfg: AnalyzeConfig) -> Schedule:
    return Schedule(steps=cfg.steps, dense_steps=cfg.dense_steps, replan_every=cfg.replan_every)


def _mesh_doc(mesh: Mesh, geom: VideoGeometry, cfg: AnalyzeConfig) -> dict:
    """The mesh analysed, and what its CFG halves exchange per step (each rank its
    counterpart's prediction, ``cost.mesh_step.prediction_bytes``)."""
    from .cost.mesh_step import prediction_bytes

    each = prediction_bytes(geom, DTYPE_BYTES[cfg.dtype]) if mesh.cfg > 1 else 0
    return {**mesh.to_dict(), "label": mesh.label, "cfg_exchange_bytes_per_rank_per_step": each,
            "cfg_exchange_bytes_per_step": each * mesh.world}


def _rows(cfg: AnalyzeConfig, m: torch.Tensor, cdf: float, placements: dict, strategies, geom, mesh, by_layer,
          advance) -> list[dict]:
    """The result rows of one cdf's masks ``m`` (bool [layers, heads, nB, nB]): per placement
    and strategy the bytes of one call summed over the layers (``bytes_*``; with a mesh also
    its ``sp_*`` and ``ulysses_*`` parts), the compute balance, and the run's bytes under the
    schedule (``run_bytes``); ``by_layer`` collects each layer's bytes where given."""
    from .cost.schedule import dense_path

    hd, dtype_bytes, schedule = geom.head_dim, DTYPE_BYTES[cfg.dtype], _schedule(cfg)
    ranks = next(iter(placements.values())).ranks
    orders = head_orders(m, ranks) if any(strategy_spec(s).heads_divisible for s in strategies) else None
    base = strategy_spec(strategies_where(baseline=True)[0])
    dens, out = masks_mod.density(m), []
    for pname, pl in placements.items():
        for strategy in strategies:
            each = by_layer.setdefault((cdf, pname, strategy), []) if by_layer is not None else None
            b = _bytes_over_layers(m, pl, strategy, hd, dtype_bytes, each, mesh)
            dense = _bytes_over_layers(m[:1], pl, dense_path(strategy_spec(strategy), base).name, hd, dtype_bytes,
                                       mesh=mesh)["total"] * m.shape[0]  # a dense call's bytes: the same each layer
            row = {"cdf": cdf, "placement": pname, "strategy": strategy,
                   "bytes_total": b["total"], "bytes_max_rank": max(b["per_rank"]),
                   "bytes_per_rank": b["per_rank"], "density": dens,
                   "compute_max_over_mean": compute_balance(m, pl, strategy),
                   "run_bytes": run_bytes(schedule, plan=b["total"], dense=dense)}
            for part in ("sp", "ulysses"):
                if part in b:
                    row[f"{part}_bytes_total"] = b[part]["total"]
                    row[f"{part}_bytes_max_rank"] = max(b[part]["per_rank"])
            if strategy_spec(strategy).heads_divisible:  # the same bytes; heads given to ranks by density
                row["balanced_compute_max_over_mean"] = compute_balance(m, pl, strategy, orders)
            out.append(row)
            advance()
    return out


def _per_layer(masks_by_cdf, placements, strategies, by_layer) -> tuple[list, list]:
    """Per layer, cdf, placement and strategy: the bytes (``by_layer``, already counted) and the
    per-rank imbalance (max/mean) of the kept blocks and of the received bytes; and the same
    imbalances of the whole model (kept blocks and bytes summed over the layers). A
    sequence-sharded strategy's kept blocks on a rank are those of the query blocks it owns,
    over heads; a head-sharded one's (``ulysses``) those of its H/G heads, over every query
    block — contiguous head groups (its ``densest_rank``: the rank whose heads are densest)
    and, beside them (``balanced_*``, ``head_order``), heads given to ranks by density
    (``cost.balance``)."""
    rows, model = [], []
    for cdf, m in masks_by_cdf.items():
        kept_q = m.sum(dim=(1, 3)).double()  # [layers, nQ]: kept blocks per query block, over heads
        kept_h = m.sum(dim=(2, 3)).tolist()  # [layers][heads]: kept blocks per head
        for pname, pl in placements.items():
            kept = torch.zeros(m.shape[0], pl.ranks, dtype=torch.float64).index_add_(1, pl.owner.long(), kept_q)
            seq = [[int(x) for x in row] for row in kept.tolist()]
            heads = None
            for strategy in strategies:
                per_rank = torch.tensor([b["per_rank"] for b in by_layer[(cdf, pname, strategy)]],
                                        dtype=torch.float64)  # [layers, G]
                sharded = strategy_spec(strategy).heads_divisible
                if sharded and heads is None:
                    heads = [head_balance(k, pl.ranks) for k in kept_h]
                mine = [h["kept_per_rank"] for h in heads] if sharded else seq
                for layer, b in enumerate(by_layer[(cdf, pname, strategy)]):
                    row = {
                        "layer": layer, "cdf": cdf, "placement": pname, "strategy": strategy,
                        "density": masks_mod.density(m[layer:layer + 1]),
                        "bytes_total": b["total"], "bytes_max_rank": max(b["per_rank"]),
                        "kept_per_rank": mine[layer], "kept_max_over_mean": max_over_mean(mine[layer]),
                        "densest_rank": mine[layer].index(max(mine[layer])),
                        "recv_max_over_mean": max_over_mean(per_rank[layer].tolist()),
                    }
                    if sharded:
                        row.update({k: heads[layer][k] for k in
                                    ("balanced_kept_per_rank", "balanced_kept_max_over_mean", "head_order")})
                    rows.append(row)
                total = [sum(col) for col in zip(*mine)]
                entry = {"cdf": cdf, "placement": pname, "strategy": strategy,
                         "kept_per_rank": total, "kept_max_over_mean": max_over_mean(total),
                         "recv_max_over_mean": max_over_mean(per_rank.sum(0).tolist()),
                         "bytes_total": int(per_rank.sum().item())}
                if sharded:
                    even = [sum(col) for col in zip(*(h["balanced_kept_per_rank"] for h in heads))]
                    entry.update(balanced_kept_per_rank=even, balanced_kept_max_over_mean=max_over_mean(even))
                model.append(entry)
    rows.sort(key=lambda r: (r["layer"], r["cdf"]))
    return rows, model


def _sweep(geom, masks_by_cdf, cfg, dtype_bytes, progress) -> dict:
    """Bytes versus G (first layer), the sharing curves at G = ranks, and the relay ring's bytes
    over direct routing versus G (the paper's Figures 4 and 5)."""
    cdf = sorted(masks_by_cdf)[len(masks_by_cdf) // 2]
    m = masks_by_cdf[cdf][0]
    ranks_list = [G for G in SWEEP_RANKS if G <= geom.num_blocks]
    task = progress.add_task("sweep over G", total=len(ranks_list) * len(cfg.placements)) if progress else None
    volume = []
    for G in ranks_list:
        for pname in cfg.placements:
            pl = placement_mod.make_placement(pname, geom, G)
            for strategy in runnable(cfg.strategies, geom.heads, G)[0]:
                b = comm_bytes(m, pl, strategy, head_dim=geom.head_dim, dtype_bytes=dtype_bytes)
                volume.append({"ranks": G, "placement": pname, "strategy": strategy, "bytes_total": b["total"]})
            _advance(progress, task)
    sharing = {}
    for pname in cfg.placements:
        xs, ys = demand.sharing_curve(m, placement_mod.make_placement(pname, geom, cfg.ranks))
        sharing[pname] = {"x": xs.tolist(), "y": ys.tolist()}
    # Figure 5: the first analysed strategy with relay routing over the first with direct
    relay = next((s for s in strategies_where(byte_rule="relay") if s in cfg.strategies), None)
    direct = next((s for s in strategies_where(byte_rule="direct") if s in cfg.strategies), None)
    amp = {}
    for pname in cfg.placements:
        rows = {v["ranks"]: {} for v in volume}
        for v in volume:
            if v["placement"] == pname:
                rows[v["ranks"]][v["strategy"]] = v["bytes_total"]
        amp[pname] = [
            {"ranks": G, "relay_over_direct": r[relay] / r[direct] if r.get(direct) else None}
            for G, r in rows.items() if relay in r and direct in r
        ]
    return {"cdf": cdf, "volume": volume, "sharing": sharing, "amplification": amp,
            "relay": relay, "direct": direct}


def _fit_progress(progress, layers: int):
    """``on_layer`` of a fit: a bar on a terminal, else a line per layer (a fit takes minutes)."""
    from .workloads.calibration import layer_lines

    if progress is None:
        return None
    if progress.console.is_terminal:
        task = progress.add_task("calibrating layers", total=layers)
        return lambda _: progress.advance(task)
    return layer_lines(layers, lambda line: progress.console.print(line, markup=False, highlight=False))


def _advance(progress, task) -> None:
    if progress is not None and task is not None:
        progress.advance(task)
