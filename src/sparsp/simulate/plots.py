"""``sparsp simulate``'s outputs for the one-call sweep and ``--mesh``: ``simulate.json``, the
fitted profile, and latency and speedup versus G (the paper's Figures 17–18, attention level)."""

from __future__ import annotations

import json
from pathlib import Path

from ..strategies.registry import strategies_where

__all__ = ["plot", "write_outputs"]


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
