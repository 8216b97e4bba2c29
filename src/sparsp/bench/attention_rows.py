"""A row of ``bench attention``: what one call of a strategy (or a one-GPU row) measured, as a
frozen dataclass (as attention-gym's benchmarks keep theirs), and how rows are printed and
drawn.

``AttentionRow.as_json`` writes the result file's fields by their names and in their order
(``sparsp simulate --validate`` and ``sparsp bench report`` read them); a one-GPU row has none
of a strategy call's fields (``CALL_FIELDS``). Figures are stored as measured and rounded only
where printed.

A strategy row times a plan call (``call: "plan"``: its mask phase in ``mask_ms``); its reuse
row, ``STRATEGY (reuse)`` (``call: "reuse"``), times calls that reuse that plan, with the plan
row's ``plan_median_ms`` and ``plan_mask_ms`` and ``reuse_ratio`` = its median / (plan median −
plan mask phase): a reuse call saves exactly the mask phase where the ratio is 1 (the
schedule's target: ≤ 1.05, with its own ``mask_ms`` ≤ 0.05). Registered-strategy readers (the
report, ``simulate --validate``) pass over reuse rows: their name is no registered strategy.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from .args import ONE_GPU_ROWS
from .common import save_figure

SPLIT = ("mask_ms", "pack_ms", "compute_ms", "merge_ms", "exposed_comm_ms")
"""The phases of a call's time split, stacked in the plot (``exposed``: the compute stream waiting)."""
CALL_FIELDS = ("call", "cuda_graphs", "local_first_config", "local_first", "drain_chunks", "auto_choice", "config",
               "head_order", "input_sets", "plan_median_ms", "plan_mask_ms", "reuse_ratio", "mesh")
"""Fields of a strategy's call that a one-GPU row's file does not have."""


@dataclass(frozen=True, kw_only=True)
class AttentionRow:
    """One row: the call (model geometry, strategy, transport, placement, kernel), its times
    (None until timed: ``timed``), the bytes it moved, its time split, the profiler's counts,
    the bound and, for a strategy's call, its settings. ``workload``: the profile layer it ran
    (``profile_layers.LayerWorkload``; its ``row_fields`` close the file's row)."""

    model: str
    tokens: int
    heads: int
    head_dim: int
    ranks: int
    fabric: str
    cdf: float
    strategy: str
    transport: str
    placement: str
    kernel: str
    median_ms: float | None = None
    min_ms: float | None = None
    iters: int | None = None
    timing: str
    bytes_moved: int = 0
    bytes_max_rank: int = 0
    density: float
    mask_ms: float = 0.0
    pack_ms: float = 0.0
    compute_ms: float = 0.0
    merge_ms: float = 0.0
    exposed_comm_ms: float = 0.0
    pack_side_ms: float = 0.0
    transfer_ms: float = 0.0
    host_syncs: int | None = None  # None: not counted (a one-GPU row)
    collectives: int = 0
    link_gbps: float
    dense_tflops: float
    dense_kernel: str
    compute_bound_ms: float
    transfer_bound_ms: float = 0.0
    bound_ms: float
    efficiency: float | None = None
    ablation: str | None = None
    cuda_graphs: bool | None = None
    local_first_config: bool | None = None
    local_first: bool | None = None
    drain_chunks: int | None = None
    auto_choice: str | None = None
    config: dict | None = None
    head_order: str | None = None
    input_sets: int | None = None
    thresholds: str | None = None  # --thresholds FILE
    call: str | None = None  # "plan" or "reuse" (a strategy's call; None: a one-GPU row)
    plan_median_ms: float | None = None  # a reuse row's: its plan row's median and mask phase
    plan_mask_ms: float | None = None
    reuse_ratio: float | None = None  # median / (plan_median_ms - plan_mask_ms)
    mesh: str | None = None  # bench attention --mesh: "ulysses U x sp R" (None: one flat group)
    workload: object = field(default=None, compare=False)

    def timed(self, times: list[float]) -> AttentionRow:
        """The row with its times: median and minimum of ``times``, and the bound's efficiency."""
        import statistics

        med = statistics.median(times)
        return dataclasses.replace(self, median_ms=med, min_ms=min(times), iters=len(times),
                                   efficiency=self.bound_ms / med)

    def as_json(self) -> dict:
        """The row as the result file holds it."""
        skip = {"workload", *(CALL_FIELDS if self.strategy in ONE_GPU_ROWS else ())}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return out if self.workload is None else {**out, **self.workload.row_fields()}

    def line(self) -> str:
        """The row as printed when it is timed."""
        w = self.workload
        return (("" if w is None else f"layer {w.layer:<3d} ")
                + f"{self.strategy:12s} {self.placement:10s} {self.transport:5s} cdf {self.cdf}: "
                f"{self.median_ms:.2f} ms (bound {self.bound_ms:.2f}, eff {self.efficiency:.2f}); split "
                + ", ".join(f"{key[:-3]} {getattr(self, key):.1f}" for key in SPLIT)
                + f"; {self.host_syncs} syncs, {self.collectives} collectives"
                + ("" if self.reuse_ratio is None else f"; reuse / (plan - mask) {self.reuse_ratio:.3f}"))


def with_reuse_figures(rows: list[AttentionRow]) -> list[AttentionRow]:
    """``rows`` with each reuse row's plan figures: the median and mask phase of its strategy's
    plan row (same strategy, transport, placement, cdf and layer) and ``reuse_ratio``."""
    def where(r: AttentionRow, strategy: str) -> tuple:
        return (strategy, r.transport, r.placement, r.cdf, None if r.workload is None else r.workload.layer)

    plans = {where(r, r.strategy): r for r in rows if r.call == "plan" and r.ablation is None}
    out = []
    for r in rows:
        plan = plans.get(where(r, r.strategy.removesuffix(" (reuse)"))) if r.call == "reuse" else None
        if plan is not None:
            rest = plan.median_ms - plan.mask_ms
            r = dataclasses.replace(r, plan_median_ms=plan.median_ms, plan_mask_ms=plan.mask_ms,
                                    reuse_ratio=r.median_ms / rest if rest > 0 else None)
        out.append(r)
    return out


def table(rows: list[AttentionRow], title: str):
    """The run's rows as a rich table (the layer columns where the rows ran a profile's layers)."""
    from rich.table import Table

    layered = any(r.workload is not None for r in rows)
    out = Table(title=title)
    for c in (("layer", "profile density") if layered else ()) + (
            "strategy", "transport", "placement", "ablation", "cdf", "median ms", "bound ms", "eff", "mask",
            "compute", "merge", "exposed", "syncs", "coll", "GiB max"):
        out.add_column(c)
    for r in rows:
        w = r.workload
        out.add_row(*((f"{w.layer}" + (f" ({w.pick})" if w.pick else ""), f"{w.density:.3f}") if layered else ()),
                    r.strategy, r.transport, r.placement, r.ablation or "", str(r.cdf), f"{r.median_ms:.2f}",
                    f"{r.bound_ms:.2f}", f"{r.efficiency:.2f}", f"{r.mask_ms:.1f}", f"{r.compute_ms:.1f}",
                    f"{r.merge_ms:.1f}", f"{r.exposed_comm_ms:.1f}", str(r.host_syncs), str(r.collectives),
                    f"{r.bytes_max_rank / 2**30:.3f}")
    return out


def _env_text(row: dict, sep: str, first: str = "") -> str:
    """A row's environment variables as ``NAME=VALUE`` items ('' for a default row; rows
    written before 0.2.0 may carry an ``env``, which is how they are told apart)."""
    env = row.get("env") or {}
    return first + sep.join(f"{n}={v}" for n, v in env.items()) if env else ""


def plot(path: Path) -> Path:
    """Stacked time split per row (like the paper's Figure 13), the bound as a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = [r for r in doc["rows"] if "bound_ms" in r]  # rows of earlier versions lack the split
    if not rows:
        return Path(path).with_suffix(".png")
    fabrics = list(dict.fromkeys(r["fabric"] for r in rows))
    fig, axes = plt.subplots(1, len(fabrics), figsize=(max(8, 1.0 * len(rows) / max(1, len(fabrics)) + 4), 5),
                             squeeze=False)
    colors = {"mask_ms": "#8c8c8c", "pack_ms": "#bcbd22", "compute_ms": "#1f77b4", "merge_ms": "#17becf",
              "exposed_comm_ms": "#d62728"}
    for ax, fab in zip(axes[0], fabrics):
        rs = [r for r in rows if r["fabric"] == fab]
        xs = range(len(rs))
        bottom = [0.0] * len(rs)
        for key, color in colors.items():
            vals = [r.get(key, 0.0) or 0.0 for r in rs]
            ax.bar(xs, vals, bottom=bottom, color=color, label=key[:-3])
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.scatter(xs, [r["median_ms"] for r in rs], marker="_", s=400, color="k", label="median", zorder=3)
        ax.scatter(xs, [r["bound_ms"] for r in rs], marker="v", color="g", label="bound", zorder=3)
        labels = [(f"layer {r['layer']}\n" if r.get("layer") is not None else "")
                  + f"{r['strategy']}\n{r['transport']}" + (f"\n{r['ablation']}" if r.get("ablation") else "")
                  + _env_text(r, "\n", first="\n") for r in rs]
        ax.set_xticks(list(xs), labels, fontsize=6, rotation=60, ha="right")
        ax.set(ylabel="ms per attention call", title=f"{rows[0]['model']}, {fab}")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"attention time split, {doc['machine']}")
    return save_figure(fig, path)
