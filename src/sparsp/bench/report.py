"""Print a short table of benchmark result files: ``python -m sparsp.bench.report FILE...``;
``--plot OUT.png`` also draws the attention files' summary (``summary_plot``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


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


SUMMARY = ("1gpu-dense", "1gpu-sparse", "ring", "ring-sparse", "ring-relay", "ulysses", "sparsp")


def best_rows(rows: list[dict], cdf: float = 0.9) -> dict[tuple[str, str], dict]:
    """``(fabric, strategy) → row`` of the fastest transport of each strategy at ``cdf``
    (ablation and ``auto`` rows left out)."""
    best: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r.get("ablation") or r["strategy"] not in SUMMARY or abs(r["cdf"] - cdf) > 1e-9:
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

    docs = [json.loads(Path(p).read_text()) for p in paths]
    docs = [d for d in docs if d["kind"] == "attention"]
    fabrics = sorted({r["fabric"] for d in docs for r in d["rows"]}, reverse=True)
    fig, axes = plt.subplots(1, len(fabrics), figsize=(6 * len(fabrics), 4.5), squeeze=False)
    width = 0.8 / len(SUMMARY)
    for ax, fab in zip(axes[0], fabrics):
        names = []
        for i, d in enumerate(docs):
            best = best_rows(d["rows"], cdf)
            dense = best.get((fab, "1gpu-dense"))
            if dense is None:
                continue
            names.append(d["rows"][0]["model"])
            x = len(names) - 1
            for j, strategy in enumerate(SUMMARY):
                r = best.get((fab, strategy))
                if r is not None:
                    ax.bar(x + (j - len(SUMMARY) / 2 + 0.5) * width, dense["median_ms"] / r["median_ms"], width,
                           color=f"C{j}", label=strategy if x == 0 else None)
            sp = best.get((fab, "sparsp"))
            if sp is not None:
                ax.scatter([x], [dense["median_ms"] / sp["bound_ms"]], marker="v", color="k",
                           label="sparsp bound" if x == 0 else None, zorder=3)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set(ylabel="speedup over one GPU (cuDNN/FA4 dense)", title=f"fabric {fab}, cdf {cdf}")
        ax.legend(fontsize=7, ncol=2)
    machine = docs[0]["machine"] if docs else ""
    fig.suptitle(f"one attention layer, {machine}")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(argv if argv is not None else sys.argv[1:])
    plot_to = None
    if "--plot" in args:
        i = args.index("--plot")
        if i + 1 >= len(args):
            print("--plot needs an output path", file=sys.stderr)
            return 2
        plot_to = args[i + 1]
        del args[i: i + 2]
    if not args:
        print("usage: python -m sparsp.bench.report [--plot OUT.png] RESULT.json ...", file=sys.stderr)
        return 2
    print(summarize(args))
    if plot_to:
        print(f"wrote {summary_plot(args, Path(plot_to))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
