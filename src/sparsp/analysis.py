"""``sparsp analyze``: what would sparsity save on my model and GPU count? (CPU only)

For each CDF threshold and placement, the exact bytes every strategy moves per attention call
(summed over the analysed layers), the reduction against the dense ring, the mask density, and
the paper's Figure 4 / Figure 5 analogues. Masks come from the synthetic generator
(``sparsp.workloads``) or from a recorded trace (``--trace``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import demand, masks as masks_mod, placement as placement_mod
from .geometry import VideoGeometry, preset
from .strategies import comm_bytes, strategy_names

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}
SWEEP_RANKS = (2, 4, 8, 16)


@dataclass(frozen=True, kw_only=True, slots=True)
class AnalyzeConfig:
    model: str = "hunyuan-video"
    """Preset name (``sparsp.geometry.PRESETS``); ignored when a trace is given."""
    ranks: int = 8
    """Sequence-parallel degree G."""
    cdf: tuple[float, ...] = (0.85, 0.9, 0.95)
    """SpargeAttn CDF thresholds to analyse (synthetic masks only)."""
    placements: tuple[str, ...] = ("contiguous", "periodic")
    strategies: tuple[str, ...] = ()
    """Strategies to account (empty: every registered one)."""
    trace: Path | None = None
    layers: int = 1
    """How many synthetic layers (different seeds and head mixes) to sum over."""
    dtype: str = "bf16"
    seed: int = 0
    out: Path | None = None
    plots: bool = True

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"--ranks must be >= 2, got {self.ranks}")
        if self.layers < 1:
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


def load_masks(cfg: AnalyzeConfig, progress=None) -> tuple[VideoGeometry, dict[float, torch.Tensor], str]:
    """Masks per CDF threshold, bool [layers, heads, nB, nB], and where they came from."""
    from . import workloads

    if cfg.trace is not None:
        from .traces import load_trace

        trace = load_trace(cfg.trace)
        return trace.geometry, {float(trace.cdf_threshold): trace.masks[: cfg.layers]}, f"trace:{trace.source}"
    geom = preset(cfg.model)
    masks = workloads.synthetic_masks(geom, list(cfg.cdf), layers=cfg.layers, seed=cfg.seed)
    return geom, {float(c): m for c, m in masks.items()}, "synthetic"


def _bytes_over_layers(m: torch.Tensor, pl, strategy: str, head_dim: int, dtype_bytes: int) -> dict:
    total = None
    for layer in m:
        b = comm_bytes(layer, pl, strategy, head_dim=head_dim, dtype_bytes=dtype_bytes)
        total = b if total is None else {
            "total": total["total"] + b["total"],
            "per_rank": [x + y for x, y in zip(total["per_rank"], b["per_rank"])],
        }
    return total


def analyze(cfg: AnalyzeConfig, progress=None) -> dict:
    """Run the analysis and return the ``analysis.json`` document."""
    t0 = time.perf_counter()
    geom, masks_by_cdf, source = load_masks(cfg)
    dtype_bytes = DTYPE_BYTES[cfg.dtype]
    hd = geom.head_dim
    placements = {k: placement_mod.make_placement(k, geom, cfg.ranks) for k in cfg.placements}
    steps = len(masks_by_cdf) * (len(placements) * len(cfg.strategies) + 1)
    task = progress.add_task("bytes per strategy", total=steps) if progress else None
    results, stats = [], []
    for cdf, m in masks_by_cdf.items():
        dens = masks_mod.density(m)
        stats.append({
            "cdf": cdf, "density": dens,
            "head_density": masks_mod.head_density(m).tolist(),
            "patterns": masks_mod.pattern_shares(m[0], geom),
        })
        _advance(progress, task)
        for pname, pl in placements.items():
            for strategy in cfg.strategies:
                b = _bytes_over_layers(m, pl, strategy, hd, dtype_bytes)
                results.append({
                    "cdf": cdf, "placement": pname, "strategy": strategy,
                    "bytes_total": b["total"], "bytes_max_rank": max(b["per_rank"]),
                    "bytes_per_rank": b["per_rank"], "density": dens,
                })
                _advance(progress, task)
    for r in results:
        ring = next(x for x in results if x["cdf"] == r["cdf"] and x["placement"] == r["placement"]
                    and x["strategy"] == "ring") if "ring" in cfg.strategies else None
        r["reduction_vs_ring"] = 1.0 - r["bytes_total"] / ring["bytes_total"] if ring else None
    doc = {
        "model": geom.name, "ranks": cfg.ranks, "dtype": cfg.dtype, "head_dim": hd, "heads": geom.heads,
        "tokens": geom.num_tokens, "blocks": geom.num_blocks, "block_size": geom.block_size,
        "layers": int(next(iter(masks_by_cdf.values())).shape[0]), "masks": source,
        "results": results, "mask_stats": stats,
    }
    doc["sweep"] = _sweep(geom, masks_by_cdf, cfg, dtype_bytes, progress)
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    return doc


def _sweep(geom, masks_by_cdf, cfg, dtype_bytes, progress) -> dict:
    """Volume versus G (first layer), Figure 4 curves at G = ranks, Figure 5 amplification."""
    cdf = sorted(masks_by_cdf)[len(masks_by_cdf) // 2]
    m = masks_by_cdf[cdf][0]
    ranks_list = [G for G in SWEEP_RANKS if G <= geom.num_blocks]
    task = progress.add_task("sweep over G", total=len(ranks_list) * len(cfg.placements)) if progress else None
    volume = []
    for G in ranks_list:
        for pname in cfg.placements:
            pl = placement_mod.make_placement(pname, geom, G)
            for strategy in cfg.strategies:
                b = comm_bytes(m, pl, strategy, head_dim=geom.head_dim, dtype_bytes=dtype_bytes)
                volume.append({"ranks": G, "placement": pname, "strategy": strategy, "bytes_total": b["total"]})
            _advance(progress, task)
    sharing = {}
    for pname in cfg.placements:
        xs, ys = demand.sharing_curve(m, placement_mod.make_placement(pname, geom, cfg.ranks))
        sharing[pname] = {"x": xs.tolist(), "y": ys.tolist()}
    amp = {}
    for pname in cfg.placements:
        rows = {v["ranks"]: {} for v in volume}
        for v in volume:
            if v["placement"] == pname:
                rows[v["ranks"]][v["strategy"]] = v["bytes_total"]
        amp[pname] = [
            {"ranks": G, "relay_over_direct": r["ring-relay"] / r["sparsp"] if r.get("sparsp") else None}
            for G, r in rows.items() if "ring-relay" in r and "sparsp" in r
        ]
    return {"cdf": cdf, "volume": volume, "sharing": sharing, "amplification": amp}


def _advance(progress, task) -> None:
    if progress is not None and task is not None:
        progress.advance(task)


def write_outputs(doc: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "analysis.json"
    path.write_text(json.dumps(doc, indent=1))
    return [path] + plot(doc, out)


def plot(doc: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep, paths = doc["sweep"], []
    title = f"{doc['model']} ({doc['masks']} masks, cdf {sweep['cdf']})"

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pname in {v["placement"] for v in sweep["volume"]}:
        for strategy in dict.fromkeys(v["strategy"] for v in sweep["volume"]):
            pts = [(v["ranks"], v["bytes_total"] / 2**30) for v in sweep["volume"]
                   if v["placement"] == pname and v["strategy"] == strategy]
            if strategy == "ring-sparse" or (strategy in ("ring", "ulysses") and pname != "contiguous"):
                continue  # identical to ring / independent of placement
            ax.plot(*zip(*pts), marker="o", label=f"{strategy} ({pname})",
                    linestyle="-" if pname == "periodic" else "--")
    ax.set(xlabel="ranks G", ylabel="GiB received per attention call (all ranks)", title=title, xscale="log")
    ax.set_xticks(sorted({v["ranks"] for v in sweep["volume"]}), labels=None)
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    paths.append(_save(fig, out / "volume_vs_ranks.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for pname, c in sweep["sharing"].items():
        ax.plot([100 * x for x in c["x"]], [100 * y for y in c["y"]], marker=".", label=pname)
    ax.set(xlabel="x: % of local Q blocks that read the K block", ylabel="% of remote K blocks received",
           title=f"Figure 4 analogue, G={doc['ranks']}\n{title}")
    ax.legend()
    paths.append(_save(fig, out / "sharing_curve.png"))

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for pname, rows in sweep["amplification"].items():
        ax.plot([r["ranks"] for r in rows], [r["relay_over_direct"] for r in rows], marker="o", label=pname)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="ranks G", ylabel="relay-ring bytes / direct (demand) bytes",
           title=f"Figure 5 analogue\n{title}")
    ax.legend()
    paths.append(_save(fig, out / "relay_amplification.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
