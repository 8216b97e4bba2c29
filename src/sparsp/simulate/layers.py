"""``sparsp simulate --density-profile``: the whole model's step, layer by layer.

Each layer has its own masks, from the generator calibrated to the profile's densities of that
layer's heads (``analysis.load_masks``: the masks ``sparsp analyze --density-profile`` reads,
fitted now or read from ``--calibration``; with ``--thresholds``, at each layer's own
thresholds). Every layer's attention call is predicted per
strategy, G and fabric profile as ``sparsp simulate`` predicts one call (``job.row_of``); the
model's step is the sum over its layers. ``auto`` picks per layer with the runtime's own rule
(``strategies.auto.decide`` over ``strategies.auto.candidates``, on the strategy ``sparsp``'s
placement, as its calls arrive placed), so its sum is what a run with ``strategy="auto"`` would
be charged. A head-sharded strategy (``ulysses``) is predicted twice: with heads given to
ranks by density (``cost.balance``; ``balanced``: True), as it runs, and with contiguous head
groups (``balanced``: False), what that balancing saves.

Rows (``results``): per layer (``layer`` its index) and per model (``layer`` None: sums over the
layers) for each (cdf, G, fabric, strategy[, balanced]); ``kept_per_rank``: the kept blocks
each rank computes (a sequence-sharded strategy: of the query blocks it owns, over heads; a
head-sharded one: of its heads), with ``kept_max_over_mean`` and ``densest_rank``. ``balance``:
per (cdf, G, fabric), what the head-sharded imbalance costs, on the densest layer and on the
model's sum.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from ..analysis import DTYPE_BYTES, AnalyzeConfig, load_masks
from ..cost.balance import balanced_heads, contiguous_heads, max_over_mean, rank_loads
from ..cost.figures import Blocks, measure
from ..cost.model import SCHEDULES, work
from ..cost.profiles import get_profile
from ..geometry import preset
from ..placement import make_placement
from ..strategies.auto import AUTO, PLANNED, candidates, decide
from ..strategies.registry import strategies_where, strategy_names, strategy_spec
from .calibrate import calibrate
from .job import row_of
from .options import default_ranks, modelled, placement_for

SUMMED = ("predicted_ms", "compute_ms", "fixed_ms", "transfer_ms", "exposed_ms", "bytes_total")
"""Row fields the model's row sums over the layers."""
COSTLY = 0.10
"""Share of a call above which the head-sharded imbalance is worth balancing (the ``balance``
summary flags it)."""


def profiles_of(cfg) -> tuple[list, dict | None]:
    """The profiles of ``cfg.fabric_names()``, fitted to ``cfg.fit_profile`` when given (one
    profile only), and the fit's record."""
    out, record = [], None
    for name in cfg.fabric_names():
        prof = get_profile(name)
        if cfg.fit_profile:
            prof, record = calibrate(prof, cfg.fit_profile)
        if cfg.transport is not None:
            prof.transport(cfg.transport)  # unknown transport: ValueError before any work
        out.append(prof)
    return out, record


def simulate_model(cfg, progress=None) -> dict:
    """The ``simulate.json`` document of a whole model's step (module docstring)."""
    t0 = time.perf_counter()
    profiles, record = profiles_of(cfg)
    cfg = replace(cfg, ranks=cfg.ranks or default_ranks(max(p.gpus for p in profiles)))
    acfg = AnalyzeConfig(model=cfg.model, ranks=max(cfg.ranks), cdf=cfg.cdf, layers=cfg.layers, seed=cfg.seed,
                         density_profile=Path(cfg.density_profile), step=cfg.step, calibration=cfg.calibration,
                         out=cfg.out, thresholds=cfg.thresholds)
    geom = preset(cfg.model)
    several = len(profiles) > 1
    for G in cfg.ranks:  # before the masks: a calibration may take minutes
        if G > geom.num_blocks:
            raise ValueError(f"--ranks {G} exceeds the {geom.num_blocks} blocks of {geom.name}")
        for prof in profiles:
            if G > prof.gpus and not several:
                raise ValueError(f"--ranks {G} exceeds the {prof.gpus} GPUs of profile {prof.name}")
    geom, masks_by_cdf, source, info = load_masks(acfg, progress)
    strategies = cfg.strategies or strategy_names()
    dtype_bytes, hd, H = DTYPE_BYTES[cfg.dtype], geom.head_dim, geom.heads
    skipped = []
    for G in cfg.ranks:
        for prof in profiles:
            if G > prof.gpus:
                skipped.append({"ranks": G, "fabric": prof.name,
                                "reason": f"profile {prof.name} has {prof.gpus} GPUs"})
        for s in strategies:
            if strategy_spec(s).heads_divisible and H % G:
                skipped.append({"strategy": s, "ranks": G, "reason": f"needs heads divisible by G: H={H}"})
            elif not modelled(s):
                skipped.append({"strategy": s, "ranks": G,
                                "reason": f"byte rule {strategy_spec(s).byte_rule!r} has no schedule in the cost "
                                          f"model ({', '.join(SCHEDULES)})"})
    layers = int(next(iter(masks_by_cdf.values())).shape[0])
    task = progress.add_task("layers x G", total=len(masks_by_cdf) * layers * len(cfg.ranks)) if progress else None
    rows = []
    for cdf, m in masks_by_cdf.items():
        for li, layer in enumerate(m):
            density = round(float(layer.float().mean()), 4)
            kept_h = layer.sum(dim=(1, 2)).tolist()
            kept_q = layer.sum(dim=(0, 2)).double()  # kept blocks per query block, over heads
            for G in cfg.ranks:
                rows += _layer_rows(cfg, layer, kept_h, kept_q, geom, G, profiles, strategies, dtype_bytes,
                                    {"layer": li, "cdf": cdf, "density": density})
                if progress is not None:
                    progress.advance(task)
    rows += model_rows(rows)
    _speedups(rows)
    doc = {
        "kind": "simulate", "mode": "model", "model": geom.name, "tokens": geom.num_tokens, "heads": H,
        "head_dim": hd, "dtype": cfg.dtype, "masks": source, "layers": layers,
        "fabrics": [p.name for p in profiles], "profiles": {p.name: p.to_dict() for p in profiles},
        "ranks": list(cfg.ranks), "cdf": list(cfg.cdf), "prefetch": cfg.prefetch, "local_first": cfg.local_first,
        "results": rows, "balance": balance_summary(rows), "skipped": skipped,
        "density_calibration": info, "calibration": record,
    }
    doc["seconds"] = round(time.perf_counter() - t0, 2)
    return doc


def _layer_rows(cfg, layer, kept_h, kept_q, geom, G, profiles, strategies, dtype_bytes, about) -> list[dict]:
    """Every row of one layer at G: each strategy (a head-sharded one twice) and ``auto``, on
    each profile that holds G GPUs."""
    hd, H = geom.head_dim, geom.heads
    demands, seq = {}, {}

    def demand(kind: str):  # measured once per placement, shared by every strategy and profile
        if kind not in demands:
            pl = make_placement(kind, geom, G)
            demands[kind] = measure(layer, Blocks.of(pl), relay=True)
            per_rank = torch.zeros(G, dtype=torch.float64).index_add_(0, pl.owner.long(), kept_q)
            seq[kind] = [int(x) for x in per_rank.tolist()]
        return demands[kind]

    out = []
    for prof in profiles:
        if G > prof.gpus:
            continue
        transport = cfg.transport
        base = dict(about, fabric=prof.name)
        for s in strategies:
            spec = strategy_spec(s)
            if (spec.heads_divisible and H % G) or not modelled(s):
                continue
            kind = placement_for(s, cfg.placement)
            d = demand(kind)
            variants = [(None, None)]
            if spec.heads_divisible:
                # contiguous head groups against heads given to ranks by density: ulysses' own
                # order (cost.balance on the layer's kept pairs per head), the model's default
                variants = [(False, contiguous_heads(H)), (True, balanced_heads(d.head_pairs, G))]
            for balanced, order in variants:
                w = work(spec, d, head_dim=hd, dtype_bytes=dtype_bytes, profile=prof, transport=transport,
                         local_first=cfg.local_first, head_order=order)
                row = {**base, **row_of(w, prof, placement=kind, transport=transport, prefetch=cfg.prefetch,
                                        head_dim=hd, rounds=False, savings=False)}
                if spec.heads_divisible:
                    mine = rank_loads(kept_h, G, order)
                    row["balanced"] = balanced
                    if balanced:
                        row["head_order"] = list(order)
                else:
                    mine = seq[kind]
                row.update(kept_per_rank=mine, kept_max_over_mean=max_over_mean(mine),
                           densest_rank=mine.index(max(mine)))
                out.append(row)
        names = candidates(H, G)
        kind = placement_for(PLANNED, cfg.placement)
        choice, times = decide(demand(kind), prof, prof.transport(transport).name, names, head_dim=hd,
                               dtype_bytes=dtype_bytes, prefetch=cfg.prefetch, local_first=cfg.local_first)
        out.append({**base, "strategy": AUTO, "ranks": G, "placement": kind, "choice": choice,
                    "predicted_ms": times[choice], "candidates_ms": times})
    return out


def _key(r: dict) -> tuple:
    return (r["cdf"], r["ranks"], r["fabric"], r["strategy"], r.get("balanced"))


def model_rows(rows: list[dict]) -> list[dict]:
    """One row per (cdf, G, fabric, strategy[, balanced]): the per-layer rows' ``SUMMED``
    fields summed (``layer`` None), kept blocks per rank summed, and ``auto``'s per-layer
    choices in layer order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for group in groups.values():
        rs = sorted(group, key=lambda r: r["layer"])
        first = rs[0]
        row = {k: first[k] for k in ("cdf", "ranks", "fabric", "strategy", "placement")}
        row.update(layer=None, layers=len(rs))
        if "balanced" in first:
            row["balanced"] = first["balanced"]
        if first["strategy"] == AUTO:
            row["predicted_ms"] = round(sum(r["predicted_ms"] for r in rs), 4)
            row["choices"] = [r["choice"] for r in rs]
            row["choice_counts"] = {s: row["choices"].count(s) for s in dict.fromkeys(row["choices"])}
        else:
            for k in SUMMED:
                total = sum(r[k] for r in rs)
                row[k] = total if isinstance(total, int) else round(total, 4)
            kept = [sum(col) for col in zip(*(r["kept_per_rank"] for r in rs))]
            # each layer's call waits for its own busiest rank: the step's imbalance is the
            # layers' busiest ranks summed over their means summed, not the sums' max/mean
            busiest = sum(max(r["kept_per_rank"]) for r in rs)
            mean = sum(sum(r["kept_per_rank"]) / len(r["kept_per_rank"]) for r in rs)
            row.update(kept_per_rank=kept, kept_max_over_mean=max_over_mean(kept),
                       step_kept_max_over_mean=round(busiest / mean, 4) if mean > 0 else 1.0)
        out.append(row)
    return out


def _speedups(rows: list[dict]) -> None:
    """``speedup_vs_ring`` of every row: against the dense baseline's row of the same cdf, G,
    fabric and layer (or model)."""
    baseline = strategies_where(baseline=True)
    ring = {(r["cdf"], r["ranks"], r["fabric"], r["layer"]): r["predicted_ms"] for r in rows
            if r["strategy"] in baseline}
    for r in rows:
        base = ring.get((r["cdf"], r["ranks"], r["fabric"], r["layer"]))
        r["speedup_vs_ring"] = round(base / r["predicted_ms"], 4) if base and r["predicted_ms"] > 0 else None


def balance_summary(rows: list[dict]) -> list[dict]:
    """Per (cdf, G, fabric, head-sharded strategy): what its imbalance costs — contiguous and
    balanced heads' ms, and the share of the contiguous call that balancing saves
    (``gain``) — on the densest layer (the most kept blocks), on the layer where balancing
    saves the most, and on the model's sum; ``costly``: the gain exceeds ``COSTLY`` on the
    densest layer or the sum."""
    pairs: dict[tuple, dict] = {}
    for r in rows:
        if "balanced" in r:
            pairs.setdefault((r["cdf"], r["ranks"], r["fabric"], r["strategy"], r["layer"]), {})[r["balanced"]] = r

    def figures(plain: dict, even: dict) -> dict:
        a, b = plain["predicted_ms"], even["predicted_ms"]
        return {"contiguous_ms": a, "balanced_ms": b, "gain": round(1 - b / a, 4) if a > 0 else 0.0,
                "kept_max_over_mean": plain["kept_max_over_mean"],
                "balanced_kept_max_over_mean": even["kept_max_over_mean"],
                **({"densest_rank": plain["densest_rank"]} if "densest_rank" in plain else {})}

    out = []
    for (cdf, G, fabric, s, layer), both in pairs.items():
        if layer is not None:
            continue
        mine = [(k[4], v) for k, v in pairs.items() if k[:4] == (cdf, G, fabric, s) and k[4] is not None]
        densest_layer, dl = max(mine, key=lambda x: (sum(x[1][False]["kept_per_rank"]), -x[0]))
        best_layer, bl = max(mine, key=lambda x: (figures(x[1][False], x[1][True])["gain"], -x[0]))
        entry = {"cdf": cdf, "ranks": G, "fabric": fabric, "strategy": s,
                 "model": figures(both[False], both[True]),
                 "densest_layer": {"layer": densest_layer, **figures(dl[False], dl[True])},
                 "largest_gain_layer": {"layer": best_layer, **figures(bl[False], bl[True])}}
        entry["costly"] = max(entry["model"]["gain"], entry["densest_layer"]["gain"]) > COSTLY
        out.append(entry)
    return out


# --- outputs -----------------------------------------------------------------------------------


def _label(r: dict) -> str:
    """A row's name in the table and plot: a head-sharded strategy as it runs (heads balanced)
    by its own name, its contiguous comparison marked."""
    if r.get("balanced") is False:
        return f"{r['strategy']} (contiguous heads)"
    return r["strategy"]


def write_model(doc: dict, out: Path, plots: bool = True) -> list[Path]:
    """``simulate.json``, the profile fitted to bench results (``--fit-profile``), the density
    calibration when fitted now (already written by ``analysis.load_masks``), ``layers_ms.png``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "simulate.json"]
    paths[0].write_text(json.dumps(doc, indent=1))
    if doc.get("calibration"):  # one profile
        (name, fitted), = doc["profiles"].items()
        paths.append(out / f"profile-{name}.json")
        paths[-1].write_text(json.dumps(fitted, indent=1))
    written = out / "calibration.json"
    if doc["density_calibration"].get("fitted_now") and written.exists():
        paths.append(written)
    return paths + (plot_model(doc, out) if plots else [])


def print_model(doc: dict, console) -> None:
    """The model's rows as a table, ``auto``'s picks, and what the head-sharded imbalance costs."""
    from rich.table import Table

    table = Table(title=f"{doc['model']}: {doc['layers']} layer(s), {doc['tokens']:,} tokens, "
                        f"{doc['heads']}x{doc['head_dim']} heads, {doc['masks']} masks; simulated step "
                        f"(sum over layers of one attention call each)")
    for col in ("cdf", "G", "fabric", "strategy", "step ms", "vs ring", "compute", "exposed",
                "kept max/mean"):
        table.add_column(col, justify="left" if col in ("fabric", "strategy") else "right")
    model = [r for r in doc["results"] if r["layer"] is None]
    for r in model:
        table.add_row(f"{r['cdf']:.2f}", str(r["ranks"]), r["fabric"], _label(r), f"{r['predicted_ms']:.1f}",
                      "" if r["speedup_vs_ring"] is None else f"{r['speedup_vs_ring']:.2f}x",
                      f"{r['compute_ms']:.1f}" if "compute_ms" in r else "",
                      f"{r['exposed_ms']:.1f}" if "exposed_ms" in r else "",
                      f"{r['step_kept_max_over_mean']:.2f}x" if "step_kept_max_over_mean" in r else "")
    console.print(table)
    console.print("step ms: the layers' predicted attention calls summed; compute, exposed: the slowest rank's "
                  "kernel time and transfer time not hidden behind compute, summed; kept max/mean: each layer's "
                  "busiest rank's kept blocks over the mean rank's, summed over the layers; auto: the runtime's "
                  "pick per layer",
                  markup=False, highlight=False)
    for r in model:
        if r["strategy"] == AUTO:
            picks = ", ".join(f"{s} x{n}" for s, n in r["choice_counts"].items())
            console.print(f"auto, cdf {r['cdf']:.2f}, G={r['ranks']}, {r['fabric']}: {picks}",
                          markup=False, highlight=False)
    for b in doc["balance"]:
        d, m = b["densest_layer"], b["model"]
        console.print(f"{b['strategy']}, cdf {b['cdf']:.2f}, G={b['ranks']}, {b['fabric']}: densest layer "
                      f"{d['layer']} (rank {d['densest_rank']} holds the densest heads, kept "
                      f"{d['kept_max_over_mean']:.2f}x the mean, balanced {d['balanced_kept_max_over_mean']:.2f}x) "
                      f"{d['contiguous_ms']:.1f} -> {d['balanced_ms']:.1f} ms ({100 * d['gain']:.1f} %); model "
                      f"{m['contiguous_ms']:.1f} -> {m['balanced_ms']:.1f} ms ({100 * m['gain']:.1f} %)"
                      + ("; worth balancing" if b["costly"] else ""), markup=False, highlight=False)
    if doc["balance"]:
        console.print("ulysses gives heads to ranks by density (cost.balance); contiguous heads: rank r "
                      "taking heads r*H/G onwards, what that saves", markup=False, highlight=False)
    for s in doc["skipped"]:
        what = f"{s['strategy']} at G={s['ranks']}" if "strategy" in s else f"{s['fabric']} at G={s['ranks']}"
        console.print(f"skipped {what}: {s['reason']}", markup=False, highlight=False)


def plot_model(doc: dict, out: Path) -> list[Path]:
    """Per layer, each strategy's predicted call (and auto's) at the largest G, on
    pcie4-8gpu-nop2p where simulated, else the first profile."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fabric = "pcie4-8gpu-nop2p" if "pcie4-8gpu-nop2p" in doc["fabrics"] else doc["fabrics"][0]
    layered = [r for r in doc["results"] if r["layer"] is not None and r["fabric"] == fabric]
    if not layered:
        return []
    G, cdf = max(r["ranks"] for r in layered), doc["cdf"][0]
    rows = [r for r in layered if r["ranks"] == G and r["cdf"] == cdf]
    fig, ax = plt.subplots(figsize=(9, 5))
    styles = ["-", "--", ":", "-."]
    for i, label in enumerate(dict.fromkeys(_label(r) for r in rows)):
        pts = sorted((r["layer"], r["predicted_ms"]) for r in rows if _label(r) == label)
        ax.plot(*zip(*pts), marker=".", linestyle=styles[i % 4], label=label)
    about = f"{doc['model']} on {fabric}, G={G}, cdf {cdf}, {doc['masks']} masks (simulated)"
    ax.set(xlabel="layer", ylabel="predicted ms per attention call",
           title="\n".join(textwrap.wrap("Predicted attention call per layer", 70) + textwrap.wrap(about, 70)))
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "layers_ms.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
