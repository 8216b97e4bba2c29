"""``sparsp analyze``: what would sparsity save on my model and GPU count? (CPU only)

For each CDF threshold and placement, the exact bytes every strategy moves per attention call
(summed over the analysed layers), the reduction against the dense ring, the mask density, how
evenly each strategy spreads the kept attention work over the ranks, and three plots: bytes
versus G, the sharing curve (how many local query blocks read each remote K block) and the
relay ring's bytes over direct routing. Masks come from the synthetic generator
(``sparsp.workloads.synthetic``), from the generator calibrated to a per-head density profile
(``--density-profile``, ``sparsp.workloads.calibration``: then also bytes and per-rank imbalance for
every layer, and a plot of both across layers) or from a recorded trace (``--trace``). A
head-sharded strategy (``ulysses``) is skipped, with a note, where the heads do not divide by
G, as it cannot run there; where it runs, its balance is also given with its heads assigned to
ranks by density (``cost.balance``), as it runs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import demand, masks as masks_mod, placement as placement_mod
from .cost.balance import balanced_heads, head_balance, max_over_mean
from .geometry import VideoGeometry, preset
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

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"--ranks must be >= 2, got {self.ranks}")
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
    if cfg.density_profile is not None:
        return _calibrated_masks(cfg, geom, progress)
    masks = workloads.synthetic_masks(geom, list(cfg.cdf), layers=cfg.layers, seed=cfg.seed)
    return geom, {float(c): m for c, m in masks.items()}, "synthetic"


def _calibrated_masks(cfg: AnalyzeConfig, geom: VideoGeometry, progress):
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
        written = cal.write(cfg.out / "calibration.json") if cfg.out is not None else None
    task = progress.add_task("calibrated masks", total=n) if progress else None
    masks = workloads.synthetic_masks(geom, list(cfg.cdf), layers=n, seed=cal.seed, mix=cal.mix,
                                      heads=cal.head_params()[:n], on_layer=lambda _: _advance(progress, task))
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


def notes(doc: dict) -> list[str]:
    """Lines printed under ``analyze``'s table: strategies skipped, and what bytes alone do not say."""
    lines = [f"skipped {s['strategy']} at G={s['ranks']}: {s['reason']}" for s in doc.get("skipped", [])]
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
                       each: list | None = None) -> dict:
    """Bytes summed over the layers of ``m``; each layer's own figures go to ``each`` if given."""
    total = None
    for layer in m:
        b = comm_bytes(layer, pl, strategy, head_dim=head_dim, dtype_bytes=dtype_bytes)
        if each is not None:
            each.append(b)
        total = b if total is None else {
            "total": total["total"] + b["total"],
            "per_rank": [x + y for x, y in zip(total["per_rank"], b["per_rank"])],
        }
    return total


def analyze(cfg: AnalyzeConfig, progress=None) -> dict:
    """Run the analysis and return the ``analysis.json`` document."""
    t0 = time.perf_counter()
    geom, masks_by_cdf, source, *calibrated = load_masks(cfg, progress)
    dtype_bytes = DTYPE_BYTES[cfg.dtype]
    hd = geom.head_dim
    try:
        placements = {k: placement_mod.make_placement(k, geom, cfg.ranks) for k in cfg.placements}
    except ValueError as e:
        if cfg.trace is None or cfg.ranks <= geom.num_blocks:
            raise
        raise ValueError(f"{e}: the trace {cfg.trace} has {geom.num_tokens} tokens in {geom.block_size}-token "
                         f"blocks; record it with a smaller --block-size (sparsp trace --block-size N) "
                         f"or use fewer --ranks") from None
    strategies, skipped = runnable(cfg.strategies, geom.heads, cfg.ranks)
    steps = len(masks_by_cdf) * (len(placements) * len(strategies) + 1)
    task = progress.add_task("bytes per strategy", total=steps) if progress else None
    results, stats = [], []
    by_layer: dict[tuple, list] = {}  # (cdf, placement, strategy) -> bytes of each layer
    head_sharded = [s for s in strategies if strategy_spec(s).heads_divisible]
    for cdf, m in masks_by_cdf.items():
        orders = head_orders(m, cfg.ranks) if head_sharded else None
        dens = masks_mod.density(m)
        stats.append({
            "cdf": cdf, "density": dens,
            "head_density": masks_mod.head_density(m).tolist(),
            "patterns": masks_mod.pattern_shares(m[0], geom),
        })
        _advance(progress, task)
        for pname, pl in placements.items():
            for strategy in strategies:
                each = by_layer.setdefault((cdf, pname, strategy), []) if calibrated else None
                b = _bytes_over_layers(m, pl, strategy, hd, dtype_bytes, each)
                results.append({
                    "cdf": cdf, "placement": pname, "strategy": strategy,
                    "bytes_total": b["total"], "bytes_max_rank": max(b["per_rank"]),
                    "bytes_per_rank": b["per_rank"], "density": dens,
                    "compute_max_over_mean": compute_balance(m, pl, strategy),
                })
                if strategy in head_sharded:  # the same bytes; heads given to ranks by density
                    results[-1]["balanced_compute_max_over_mean"] = compute_balance(m, pl, strategy, orders)
                _advance(progress, task)
    # ``reduction_vs_ring``: against the dense baseline (registered ``baseline``), if analysed
    baseline = next((s for s in strategies_where(baseline=True) if s in strategies), None)
    for r in results:
        ring = next(x for x in results if x["cdf"] == r["cdf"] and x["placement"] == r["placement"]
                    and x["strategy"] == baseline) if baseline else None
        r["reduction_vs_ring"] = 1.0 - r["bytes_total"] / ring["bytes_total"] if ring else None
    doc = {
        "model": geom.name, "ranks": cfg.ranks, "dtype": cfg.dtype, "head_dim": hd, "heads": geom.heads,
        "tokens": geom.num_tokens, "blocks": geom.num_blocks, "block_size": geom.block_size,
        "layers": int(next(iter(masks_by_cdf.values())).shape[0]), "masks": source,
        "results": results, "mask_stats": stats, "skipped": skipped,
    }
    if calibrated:
        doc["calibration"] = calibrated[0]
        doc["per_layer"], doc["imbalance"] = _per_layer(masks_by_cdf, placements, strategies, by_layer)
    doc["sweep"] = _sweep(geom, masks_by_cdf, cfg, dtype_bytes, progress)
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    return doc


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


def write_outputs(doc: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "analysis.json"
    path.write_text(json.dumps(doc, indent=1))
    return [path] + plot(doc, out)


def _source(doc: dict) -> str:
    """The masks' origin for a plot title: ``synthetic`` or the trace's source, shortened."""
    masks = doc["masks"]
    if masks.startswith("trace:"):
        src = masks[len("trace:"):]
        return "trace: " + (src if len(src) <= 40 else src[:39] + "…")
    return masks


def plot(doc: dict, out: Path) -> list[Path]:
    """The PNGs; a plot that has nothing to show is not written, and ``doc["plots_skipped"]``
    says why."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, paths = doc["sweep"], []
    doc["plots_skipped"] = []
    placed = list(sweep["sharing"])
    about = (f"{doc['model']}, {_source(doc)} masks, cdf {sweep['cdf']}, {doc['dtype']}, first layer"
             + (f", {placed[0]} placement" if len(placed) == 1 else ""))

    def title(what: str) -> str:
        return "\n".join(textwrap.wrap(what, 60) + textwrap.wrap(about, 60))

    fig, ax = plt.subplots(figsize=(7.5, 5))
    top = max((v["bytes_total"] for v in sweep["volume"]), default=1)
    unit, scale = next(((u, 2**e) for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if top >= 2**e), ("B", 1))
    drawn: dict[tuple, list[str]] = {}
    placements = list(dict.fromkeys(v["placement"] for v in sweep["volume"]))
    for pname in placements:
        for strategy in dict.fromkeys(v["strategy"] for v in sweep["volume"]):
            pts = tuple((v["ranks"], v["bytes_total"] / scale) for v in sweep["volume"]
                        if v["placement"] == pname and v["strategy"] == strategy)
            if pts:
                drawn.setdefault(pts, []).append(f"{strategy} ({pname})" if len(placements) > 1 else strategy)
    for i, (pts, labels) in enumerate(drawn.items()):
        # curves with the same bytes (the same byte rule, or bytes that do not depend on the
        # placement) are one line whose label names them all, so none is lost from the legend
        label = "\n".join(textwrap.wrap(" = ".join(labels), 48))
        ax.plot(*zip(*pts), marker="o", label=label, linestyle="-" if i % 2 == 0 else "--")
    ax.set(xlabel="ranks G", ylabel=f"{unit} of K/V received per attention call, all ranks",
           title=title("K/V bytes each strategy moves versus the number of ranks"), xscale="log")
    ax.set_xticks(sorted({v["ranks"] for v in sweep["volume"]}), labels=None)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "volume_vs_ranks.png"))

    fig, ax = plt.subplots(figsize=(7, 5))
    curves: dict[tuple, list[str]] = {}
    for pname, c in sweep["sharing"].items():  # identical curves: one line naming both placements
        curves.setdefault((tuple(c["x"]), tuple(c["y"])), []).append(pname)
    for (xs, ys), names in curves.items():
        ax.plot([100 * x for x in xs], [100 * y for y in ys], marker=".", label=f"{' = '.join(names)} placement")
    ax.set(xlabel="x: % of the receiving rank's Q blocks that read the K block",
           ylabel="% of received remote K blocks read by at least x",
           title=title(f"How widely each received K block is read at G={doc['ranks']} "
                       "(higher: less of each transfer wasted)"))
    ax.legend()
    paths.append(_save(fig, out / "sharing_curve.png"))

    if doc.get("per_layer"):
        paths.append(_plot_layers(doc, out))

    relay, direct = sweep.get("relay"), sweep.get("direct")
    if not any(sweep["amplification"].values()):
        doc["plots_skipped"].append(
            "relay_amplification.png: it compares a relay-routed strategy (ring-relay) with a direct-routed "
            "one (sparsp); give both to --strategy to draw it")
        return paths
    fig, ax = plt.subplots(figsize=(7, 5))
    for pname, rows in sweep["amplification"].items():
        ax.plot([r["ranks"] for r in rows], [r["relay_over_direct"] for r in rows], marker="o",
                label=f"{pname} placement")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="ranks G", ylabel=f"{relay} bytes / {direct} bytes",
           title=title(f"Bytes a relay ring ({relay}) moves over direct routing ({direct}): "
                       "what forwarding through ranks adds"))
    ax.legend()
    paths.append(_save(fig, out / "relay_amplification.png"))
    return paths


def _plot_layers(doc: dict, out: Path) -> Path:
    """Bytes per layer of every strategy, and the per-rank imbalance of kept blocks and of
    received bytes, across layers, at the sweep's cdf."""
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cdf = doc["sweep"]["cdf"]
    about = f"{doc['model']}, {_source(doc)} masks, {doc['dtype']}, G={doc['ranks']}"
    rows = [r for r in doc["per_layer"] if r["cdf"] == cdf]
    placements = list(dict.fromkeys(r["placement"] for r in rows))
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    top = max((r["bytes_total"] for r in rows), default=1)
    unit, scale = next(((u, 2**e) for u, e in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if top >= 2**e), ("B", 1))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    styles = ["-", "--", ":", "-."]
    for i, pname in enumerate(placements):
        for strategy in strategies:
            pts = [(r["layer"], r["bytes_total"] / scale) for r in rows
                   if r["placement"] == pname and r["strategy"] == strategy]
            ax1.plot(*zip(*pts), marker=".", linestyle=styles[i % 4], label=f"{strategy} ({pname})")
        first = [r for r in rows if r["placement"] == pname and r["strategy"] == strategies[0]]
        ax2.plot([r["layer"] for r in first], [r["kept_max_over_mean"] for r in first], marker=".",
                 linestyle=styles[i % 4], label=f"kept blocks ({pname})")
        for strategy in strategies:
            pts = [(r["layer"], r["recv_max_over_mean"]) for r in rows
                   if r["placement"] == pname and r["strategy"] == strategy]
            ax2.plot(*zip(*pts), marker="x", linestyle=styles[i % 4], label=f"received bytes, {strategy} ({pname})")
    ax1.set(ylabel=f"{unit} of K/V received per call, all ranks",
            title="\n".join(textwrap.wrap(f"Bytes and per-rank imbalance per layer, cdf {cdf}", 60)
                             + textwrap.wrap(about, 60)))
    ax1.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: the lines stay visible
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set(xlabel="layer", ylabel="busiest rank / mean rank")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    return _save(fig, out / "layers.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
