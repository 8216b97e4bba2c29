"""``sparsp analyze``'s outputs: ``analysis.json`` and its plots, written whole or not at all.

Three PNGs from the document ``sparsp.analysis.analyze`` returns: bytes versus G, the sharing
curve, the relay ring's bytes over direct routing (the paper's Figures 4 and 5), and with a
density profile the bytes and per-rank imbalance across layers.
"""

from __future__ import annotations

import json
from pathlib import Path

from .preflight import staged

__all__ = ["plot", "write_outputs"]


def write_outputs(doc: dict, out: Path, plots: bool = True) -> list[Path]:
    """``analysis.json`` and (``plots``) the PNGs in ``out``, all of them or none (``staged``:
    an interrupted or failed write leaves no partial file). Returns their paths."""
    with staged(out) as temp:
        (temp / "analysis.json").write_text(json.dumps(doc, indent=1))
        names = ["analysis.json"] + ([p.name for p in plot(doc, temp)] if plots else [])
    return [out / name for name in names]


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
    # one colour per strategy in both panels (its marker changes past the ten colours), one line
    # style per placement, the kept blocks in black: no two series look alike
    styles = ["-", "--", ":", "-."]
    color = {s: f"C{j % 10}" for j, s in enumerate(strategies)}
    marker = {s: ".x+^v<>"[j // 10 % 7] for j, s in enumerate(strategies)}
    for i, pname in enumerate(placements):
        style = styles[i % 4]
        for strategy in strategies:
            pts = [(r["layer"], r["bytes_total"] / scale) for r in rows
                   if r["placement"] == pname and r["strategy"] == strategy]
            ax1.plot(*zip(*pts), marker=marker[strategy], linestyle=style, color=color[strategy],
                     label=f"{strategy} ({pname})")
        first = [r for r in rows if r["placement"] == pname and r["strategy"] == strategies[0]]
        ax2.plot([r["layer"] for r in first], [r["kept_max_over_mean"] for r in first], marker="s", ms=3,
                 linestyle=style, color="k", label=f"kept blocks ({pname})")
        for strategy in strategies:
            pts = [(r["layer"], r["recv_max_over_mean"]) for r in rows
                   if r["placement"] == pname and r["strategy"] == strategy]
            ax2.plot(*zip(*pts), marker=marker[strategy], linestyle=style, color=color[strategy],
                     label=f"received bytes, {strategy} ({pname})")
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
