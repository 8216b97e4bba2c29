"""A short table of benchmark result files, and the attention files' figures.

    sparsp bench report bench/results/attention-*-2xH200-*.json
    sparsp bench report --plot summary.png bench/results/attention-*-2xH200-*.json
    sparsp bench report --scaling scaling.png bench/results/attention-*-[248]xH200-*.json

``--plot OUT.png`` also draws the attention files' summary (``summary_plot``: each strategy's
speedup over one GPU per preset), ``--scaling OUT.png`` latency and speedup versus the number
of GPUs from attention files of several machines (``scaling_plot``, the paper's Figures 17–18
from measured rows). Every file is checked before anything is printed: one line naming a file
that is no result, exit status 2.

The strategies, their order and colours come from the strategy registry (``register_strategy``:
``color``, and ``primary`` for the bound the summary marks); the one-GPU rows of ``bench
attention`` (``ONE_GPU_ROWS``) come first.
"""

from __future__ import annotations

import json
from pathlib import Path

from .args import ONE_GPU_ROWS, check_out, refuse
from .common import save_figure


def summarize(paths: list[str]) -> str:
    lines = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        lines.append(f"{Path(path).name}  ({doc['machine']}, {doc['date']})")
        if doc["kind"] == "attention":
            lines.append(f"  {'fabric':7s} {'strategy':12s} {'transport':9s} {'placement':10s} {'cdf':>5s} "
                         f"{'median ms':>10s} {'GiB moved':>10s} {'density':>8s}")
            for r in doc["rows"]:
                lines.append(f"  {r['fabric']:7s} {r['strategy']:12s} {r['transport']:9s} {r.get('placement', ''):10s} "
                             f"{r['cdf']:5.2f} {r['median_ms']:10.2f} {r['bytes_moved'] / 2**30:10.3f} {r['density']:8.3f}")
        elif doc["kind"] == "transport":
            lines.append(f"  {'transport':10s} {'fabric':7s} {'MiB':>8s} {'GB/s':>8s} {'load':>5s} "
                         f"{'inflight':>8s} {'slowdown':>9s}")
            for r in doc["rows"]:
                if r["bytes"] < 2**24 and not (r["bytes"] == 2**22 and not r["under_load"]):
                    continue  # the short table keeps 4 MiB (unloaded) and 16 MiB and up
                slow = "" if r["attention_slowdown"] is None else f"{100 * r['attention_slowdown']:+.1f}%"
                lines.append(f"  {r['transport']:10s} {r['fabric']:7s} {r['bytes'] / 2**20:8.0f} {r['gbps']:8.1f} "
                             f"{'yes' if r['under_load'] else 'no':>5s} {r.get('inflight', 1):8d} {slow:>9s}")
        else:
            lines.append(f"  {len(doc['rows'])} rows")
    return "\n".join(lines)


ONE_GPU_COLORS = ("C0", "C1")


def summary_names() -> tuple[str, ...]:
    """The rows the summary shows: the one-GPU rows, then every registered strategy."""
    from ..strategies.registry import strategy_names

    return ONE_GPU_ROWS + strategy_names()


def colors(names: tuple[str, ...]) -> dict[str, str]:
    """A plot colour per name: the one-GPU rows' and each strategy's registered ``color``, the
    rest the matplotlib cycle's colours no one claimed, in order."""
    from ..strategies.registry import strategy_names, strategy_spec

    fixed = dict(zip(ONE_GPU_ROWS, ONE_GPU_COLORS))
    fixed.update({s: strategy_spec(s).color for s in strategy_names() if strategy_spec(s).color})
    free = (f"C{i}" for i in range(100) if f"C{i}" not in fixed.values())
    return {n: fixed.get(n) or next(free) for n in names}


def best_rows(rows: list[dict], cdf: float = 0.9) -> dict[tuple[str, str], dict]:
    """``(fabric, strategy) → row`` of the fastest transport of each strategy at ``cdf``
    (ablation, ``--env-variant`` and ``auto`` rows left out)."""
    names = summary_names()
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r.get("ablation") or r.get("env") or r["strategy"] not in names or abs(r["cdf"] - cdf) > 1e-9:
            continue
        key = (r["fabric"], r["strategy"])
        if key not in best or r["median_ms"] < best[key]["median_ms"]:
            best[key] = r
    return best


def summary_plot(paths: list[str], out: Path, cdf: float = 0.9) -> Path:
    """Speedup over ``1gpu-dense`` of every strategy (its fastest transport) per preset, one
    panel per fabric, the bound's speedup marked: the README's attention figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..strategies.registry import strategies_where

    docs = [json.loads(Path(p).read_text()) for p in paths]
    docs = [d for d in docs if d["kind"] == "attention"]
    fabrics = sorted({r["fabric"] for d in docs for r in d["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(fabrics), figsize=(6 * len(fabrics), 4.5), squeeze=False)
    summary = summary_names()
    color = colors(summary)
    primary = strategies_where(primary=True)[0]
    width = 0.8 / len(summary)
    for ax, fab in zip(axes[0], fabrics):
        names = []
        for i, d in enumerate(docs):
            best = best_rows(d["rows"], cdf)
            dense = best.get((fab, ONE_GPU_ROWS[0]))
            if dense is None:
                continue
            names.append(d["rows"][0]["model"])
            x = len(names) - 1
            for j, strategy in enumerate(summary):
                r = best.get((fab, strategy))
                if r is not None:
                    ax.bar(x + (j - len(summary) / 2 + 0.5) * width, dense["median_ms"] / r["median_ms"], width,
                           color=color[strategy], label=strategy if x == 0 else None)
            sp = best.get((fab, primary))
            if sp is not None:
                ax.scatter([x], [dense["median_ms"] / sp["bound_ms"]], marker="v", color="k",
                           label=f"{primary} bound" if x == 0 else None, zorder=3)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set(ylabel="speedup over one GPU (cuDNN/FA4 dense)", title=f"fabric {fab}, cdf {cdf}")
        if ax.get_legend_handles_labels()[0]:  # a fabric without one-GPU rows draws no bars
            ax.legend(fontsize=7, ncol=2)
    machine = docs[0]["machine"] if docs else ""
    fig.suptitle(f"one attention layer, {machine}")
    return save_figure(fig, out, dpi=110)


def scaling_points(paths: list[str], cdf: float = 0.9) -> dict[tuple[str, str], dict[str, dict[int, float]]]:
    """``(model, fabric) → strategy → {G: median ms}`` from attention files of any group sizes
    (each strategy's fastest transport; ``1gpu-dense`` / ``1gpu-sparse`` at G = 1, the fastest
    of their rows across the files). ``ValueError`` when a file is not an attention result."""
    points: dict[tuple[str, str], dict[str, dict[int, float]]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if doc.get("kind") != "attention":
            raise ValueError(f"{path}: not a bench attention result (kind {doc.get('kind')!r})")
        for (fabric, strategy), r in best_rows(doc["rows"], cdf).items():
            G = 1 if strategy in ONE_GPU_ROWS else int(r["ranks"])
            series = points.setdefault((r["model"], fabric), {}).setdefault(strategy, {})
            series[G] = min(series.get(G, float("inf")), float(r["median_ms"]))
    return points


def _models(points: dict, cdf: float = 0.9) -> list[str]:
    """The models of ``scaling_points``' points; ``ValueError`` when there are none."""
    models = sorted({m for m, _ in points})
    if not models:
        raise ValueError(f"no attention rows at cdf {cdf} in the files given")
    return models


def scaling_plot(paths: list[str], out: Path, cdf: float = 0.9) -> Path:
    """Latency (top) and speedup over ``1gpu-dense`` (bottom) versus G per strategy, one column
    per model, NVLink solid and the host fabric dashed; the one-GPU sparse row as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..strategies.registry import strategy_names

    points = scaling_points(paths, cdf)
    color = colors(strategy_names())
    models = _models(points, cdf)
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    for col, model in enumerate(models):
        lat, spd = axes[0][col], axes[1][col]
        for fabric, style in (("nvlink", "-o"), ("host", "--s")):
            series = points.get((model, fabric))
            if not series:
                continue
            dense = series.get(ONE_GPU_ROWS[0], {}).get(1)
            for strategy in strategy_names():
                pts = sorted(series.get(strategy, {}).items())
                if not pts:
                    continue
                label = f"{strategy} ({fabric})"
                lat.plot([g for g, _ in pts], [ms for _, ms in pts], style, color=color[strategy], ms=4, label=label)
                if dense:
                    spd.plot([g for g, _ in pts], [dense / ms for _, ms in pts], style, color=color[strategy], ms=4,
                             label=label)
            one = series.get(ONE_GPU_ROWS[1], {}).get(1)
            if one:
                lat.scatter([1], [one], marker="*", color="k", s=50, zorder=3,
                            label=f"{ONE_GPU_ROWS[1]} ({fabric})" if fabric == "nvlink" else None)
                if dense:
                    spd.scatter([1], [dense / one], marker="*", color="k", s=50, zorder=3)
        ranks = sorted({g for (m, _), s in points.items() if m == model for v in s.values() for g in v})
        for ax in (lat, spd):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [str(g) for g in ranks])
            ax.grid(True, alpha=0.3)
        lat.set_yscale("log")
        lat.set(title=model, ylabel="ms per attention call" if col == 0 else None)
        spd.set(xlabel="GPUs", ylabel="speedup over one GPU dense" if col == 0 else None)
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"one attention layer versus GPUs, cdf {cdf} (NVLink solid, host fabric dashed)")
    return save_figure(fig, out, dpi=110)


def _check_result(path: str) -> str | None:
    """What is wrong with ``path`` as a bench result file (None: nothing)."""
    from ..inputs import read_json

    try:
        doc = read_json(path, what="sparsp bench result (JSON)")
    except ValueError as e:
        return str(e)
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) \
            or not all(k in doc for k in ("kind", "machine", "date")):
        return f"{path}: not a sparsp bench result: expected a JSON object with kind, machine, date and rows"
    return None


def main(args) -> int:
    """``sparsp bench report``: every file and output checked first (``refuse``: one line, exit
    status 2), then the table and the figures asked for."""
    for path in args.files:
        error = _check_result(path)
        if error:
            refuse("report", error)
    for flag, out in (("--plot", args.plot), ("--scaling", args.scaling)):
        if out is not None:
            check_out("report", flag, out, file=True)
    if args.scaling:  # rows to draw, in attention files only
        try:
            _models(scaling_points(args.files))
        except ValueError as e:
            refuse("report", f"--scaling: {e}")
    print(summarize(args.files))
    if args.plot:
        print(f"wrote {summary_plot(args.files, args.plot)}")
    if args.scaling:
        print(f"wrote {scaling_plot(args.files, args.scaling)}")
    return 0
