"""The rows of ``bench e2e``: which rows a run has (each strategy, a sparse one once per
schedule), how a row is named where it is printed or drawn, and the printed table and the PNG.

A sparse row (run by sparsp: ``1gpu-sparse`` and sparsp's strategies) runs under
``--dense-steps``/``--replan-every`` and once more under each other ``--schedule``; its
``schedule`` field holds ``{"dense_steps", "replan_every"}`` (None on the dense rows, which
follow none) and its name where printed adds ``dense=N,replan=K`` unless it plans every step.
"""

from __future__ import annotations

from pathlib import Path

from .args import schedule_label
from .common import save_figure

DIFFUSERS = {"diffusers-ring": "ring_degree", "diffusers-ulysses": "ulysses_degree", "diffusers-unified": None}
"""Diffusers' own context parallelism: row name -> its ``ContextParallelConfig`` field of the
world size (None: ``diffusers-unified``, ``ring_degree`` and ``ulysses_degree`` of ``--mesh``)."""


def scheduled_warmup(schedule) -> int:
    """The untimed steps a row under ``schedule`` (dense_steps N, replan_every K) takes at least,
    so that its timed steps meet nothing for the first time (a kernel's compilation, a plan
    stage's capture): N dense steps, a plan, K - 1 reuses and the next plan; 0 without one."""
    if schedule is None or schedule == (0, 1):
        return 0
    dense_steps, replan_every = schedule
    return dense_steps + replan_every + 1


def row_plan(args) -> list[tuple[str, tuple | None]]:
    """(strategy, schedule) of every row in order: each ``--strategy``; a sparse one (run by
    sparsp: ``1gpu-sparse`` and sparsp's strategies) under ``--dense-steps``/``--replan-every``,
    then once per other ``--schedule``."""
    base = (args.dense_steps, args.replan_every)
    rows = []
    for name in args.strategy:
        if name == "1gpu-dense" or name in DIFFUSERS:
            rows.append((name, None))
            continue
        rows += [(name, s) for s in dict.fromkeys([base, *args.schedule])]
    return rows


def row_label(row: dict) -> str:
    """A row's name where rows are printed or drawn: its strategy, and its schedule unless that
    plans every step."""
    sched = row.get("schedule")
    if not sched or (sched["dense_steps"], sched["replan_every"]) == (0, 1):
        return row["strategy"]
    return f"{row['strategy']} {schedule_label((sched['dense_steps'], sched['replan_every']))}"


def compose(rows: list[dict]) -> None:
    """Give each one-GPU schedule row its ``composed_ms``: its timed steps at the ``1gpu-dense``
    row's step where they are dense and at the replan-every-step ``1gpu-sparse`` row's step
    where they are not (the schedule's cost if a reuse step cost what a plan step does); a
    schedule pays where ``total_ms`` is below it. None where either row is missing or failed."""
    def step(name, plain):
        for r in rows:
            if r["strategy"] == name and r["step_ms"] is not None and (not plain or row_label(r) == name):
                return r["step_ms"]
        return None

    dense, sparse = step("1gpu-dense", False), step("1gpu-sparse", True)
    for r in rows:
        if r["strategy"] == "1gpu-sparse" and row_label(r) != r["strategy"] and r["step_ms"] is not None:
            n = min(r["schedule"]["dense_steps"], r["steps"])
            r["composed_ms"] = None if dense is None or sparse is None else n * dense + (r["steps"] - n) * sparse


def result_table(rows: list[dict], title: str):
    """The rows as printed: step, per-layer and attention time per strategy (on a
    ``wide_console``: every name and header whole)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("strategy", "ranks", "transport", "density", "step ms", "ms/layer", "attention ms", "total ms"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        ok = r["step_ms"] is not None
        table.add_row(row_label(r), str(r["ranks"]), str(r["transport"] or "-"),
                      "-" if r["density"] is None else f"{100 * r['density']:.1f}%",
                      f"{r['step_ms']:.1f}" if ok else "failed", f"{r['per_layer_ms']:.2f}" if ok else "-",
                      f"{r['attention_ms']:.1f}" if ok else "-",
                      "-" if r.get("total_ms") is None else f"{r['total_ms']:.0f}")
    return table


def what_ran(row: dict) -> str:
    """The attention a row ran: a dense row's backend, a one-GPU sparse row's kernels per step
    and the layers that took the dense kernel."""
    if row.get("attention_kernels"):
        kernels = ", ".join(f"{k} x{n}" for k, n in row["attention_kernels"].items())
        return f" (attention per step: {kernels}; dense kernel on layers {row['dense_layers'] or 'none'})"
    if row.get("backends_tried"):
        return f" (dense attention: {row['attention_backend']})"
    return ""


def plot(path: Path) -> Path:
    """Step time per strategy (one bar group per fabric and weights), PNG next to the JSON."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(Path(path).read_text())
    rows = [r for r in doc["rows"] if r.get("step_ms") is not None]
    groups = sorted({(r["fabric"], r["weights"]) for r in rows})
    names = list(dict.fromkeys(row_label(r) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) * max(1, len(groups))), 4))
    width = 0.8 / max(1, len(groups))
    for i, g in enumerate(groups):
        vals = {row_label(r): r["step_ms"] for r in rows if (r["fabric"], r["weights"]) == g}
        xs = [j + i * width for j, n in enumerate(names) if n in vals]
        ax.bar(xs, [vals[n] for n in names if n in vals], width, label=f"{g[0]}, {g[1]} weights")
    ax.set_xticks([j + width * (len(groups) - 1) / 2 for j in range(len(names))], names, rotation=20)
    ax.set_ylabel("ms per denoising step (median)")
    models = sorted({r["model"] for r in rows})
    ax.set_title(f"e2e step time: {', '.join(models)} ({doc['machine']})")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
