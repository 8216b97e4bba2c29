"""What the benchmark verbs print and draw, without a GPU: each verb's ``--help`` keeps its
description's paragraphs and example commands as written, a result table prints every
strategy's name whole in an 80-column pipe, and the per-layer plot gives every series a look
of its own."""

from __future__ import annotations

import io

import pytest

from cli_utils import run_cli


@pytest.mark.parametrize("verb", ["attention", "e2e", "kernel", "transport", "report", "timeline"])
def test_help_keeps_the_descriptions_paragraphs(capsys, verb):
    from sparsp.bench.args import description

    code, out, _ = run_cli(capsys, ["bench", verb, "--help"])
    assert code == 0
    paragraphs = [p.strip("\n") for p in description(verb).split("\n\n") if p.strip()]
    assert len(paragraphs) >= 3, verb
    for paragraph in paragraphs:  # each as written: its lines, and a blank line before it
        assert "\n\n" + paragraph + "\n" in out, (verb, paragraph[:60])


def test_e2e_table_prints_every_name_whole_in_a_pipe():
    """In a pipe (rich assumes 80 columns) the benchmarks' console is 100 wide: the e2e table
    shows every strategy's name and every header whole (it printed ``diffusers-…``)."""
    from sparsp.bench.common import wide_console
    from sparsp.bench.e2e_rows import result_table

    names = ["1gpu-dense", "1gpu-sparse", "diffusers-ring", "diffusers-ulysses", "ring-sparse", "sparsp"]
    rows = [{"strategy": n, "ranks": 2, "transport": "nccl", "density": 0.8123, "step_ms": 12345.678,
             "per_layer_ms": 6172.839, "attention_ms": 9876.5} for n in names]
    rows[2].update(step_ms=None, transport=None)  # a row that failed
    buffer = io.StringIO()
    wide_console(file=buffer).print(result_table(rows, "e2e hunyuan-video, 2 ranks, gloo, weights=random"))
    text = buffer.getvalue()
    assert "…" not in text and all(f" {n} " in text for n in names), text
    assert "attention ms" in text and max(len(line) for line in text.splitlines()) <= 100


def test_per_layer_plot_gives_each_series_a_look_of_its_own(tmp_path, monkeypatch):
    """``analyze --density-profile``'s layers.png: a colour per strategy in both panels (the
    kept blocks in black, a second marker past ten strategies), a line style per placement; no
    two lines of a panel look alike."""
    from matplotlib.figure import Figure

    from sparsp import analysis_plots as analysis

    saved = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig) or real(fig, *a, **k))
    strategies = [f"s{j}" for j in range(12)]  # more strategies than colours in the cycle
    placements = ["contiguous", "periodic"]
    rows = [{"cdf": 0.9, "layer": layer, "placement": p, "strategy": s, "bytes_total": 1e6 * (1 + j + layer),
             "kept_max_over_mean": 1.1, "recv_max_over_mean": 1.0 + j / 10}
            for layer in range(3) for p in placements for j, s in enumerate(strategies)]
    doc = {"sweep": {"cdf": 0.9}, "model": "wan2.1-1.3b", "masks": "synthetic", "dtype": "bf16", "ranks": 4,
           "per_layer": rows}
    analysis._plot_layers(doc, tmp_path)
    (fig,) = saved
    by_look: dict[tuple, set[str]] = {}
    for ax in fig.axes[:2]:
        lines = ax.get_lines()[: len(placements) * (len(strategies) + (ax is fig.axes[1]))]
        looks = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines]
        assert len(set(looks)) == len(looks), looks
        for line in lines:
            label = line.get_label()
            who = "kept" if label.startswith("kept") else label.split(", ")[-1].split(" (")[0]
            by_look.setdefault((line.get_color(), line.get_marker()), set()).add(who)
    # a colour (with its marker, past the ten colours) names one strategy, or the kept blocks,
    # wherever it appears; the placements differ by line style
    assert all(len(who) == 1 for who in by_look.values()), by_look
    assert len(by_look) == len(strategies) + 1 and by_look[("k", "s")] == {"kept"}
