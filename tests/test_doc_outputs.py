"""What the documents show a command printing is what it prints now.

A fenced block in README.md or docs/*.md right after a comment
``<!-- output of: sparsp VERB ... -->`` is an excerpt of that command's output: every table
row of the block (compared cell by cell) and every other line must be among what the command
prints today, run from the repository's root as documented (with ``--no-plots`` and its own
``--out``). So a change to the code that changes a documented figure fails here until the
document is remade from the command.

docs/analysis.md's two tables are made from eight ``sparsp analyze`` runs (about three minutes
of CPU): ``test_analysis_tables`` remakes their rows from the same runs, marked ``slow`` and run
with ``pytest -m slow --doc-outputs`` (``make doc-outputs``).

And the README stays a page one reads through: at most ``README_LINES`` lines; more detail
goes into docs/ with a link.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from cli_utils import run_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_MARK = re.compile(r"<!-- output of: (sparsp [^>]*?) -->\s*\n```[^\n]*\n(.*?)\n```", re.S)
_RULE = set("┏┓┗┛┡┩└┘┳┻╇┴┬╋┼━─ ")  # a table's border lines: no cells to compare


def excerpts() -> list[tuple[str, str, str]]:
    """(file, command, excerpt) of every marked block."""
    return [(str(path.relative_to(ROOT)), " ".join(cmd.split()), block)
            for path in DOCS for cmd, block in _MARK.findall(path.read_text())]


def _cells(line: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in re.split("[│┃]", line)[1:-1])


def _run(command: str, tmp_path, capsys, monkeypatch) -> str:
    """The command's stdout, run from the repository's root into ``tmp_path``."""
    argv = shlex.split(command)[1:]
    if "--out" in argv:
        del argv[argv.index("--out"): argv.index("--out") + 2]
    argv += ["--out", str(tmp_path / "out")] + ([] if "--no-plots" in argv else ["--no-plots"])
    monkeypatch.chdir(ROOT)  # as documented: bench/results is where discovery looks
    code, out, err = run_cli(capsys, argv)
    assert code == 0, f"`{command}` failed: {err}"
    return out


README_LINES = 250


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines (at most {README_LINES}): move detail into docs/"


def test_the_documents_mark_their_outputs():
    files = {where for where, _, _ in excerpts()}
    assert "docs/simulate.md" in files and len(excerpts()) >= 2, excerpts()


@pytest.mark.parametrize("where, command, block", excerpts(), ids=lambda x: x if len(x) < 60 else None)
def test_a_documented_output_is_what_the_command_prints(where, command, block, tmp_path, capsys, monkeypatch):
    out = _run(command, tmp_path, capsys, monkeypatch)
    rows = {_cells(line) for line in out.splitlines() if "│" in line or "┃" in line}
    text = " ".join(out.split())
    stale = [line for line in block.splitlines() if line.strip() and not set(line) <= _RULE
             and (_cells(line) not in rows if ("│" in line or "┃" in line) else " ".join(line.split()) not in text)]
    assert not stale, f"{where}: `{command}` no longer prints:\n" + "\n".join(stale)


# --- docs/analysis.md ------------------------------------------------------------------------------

ANALYSIS = ROOT / "docs" / "analysis.md"
_COMMAND = "sparsp analyze --model {model} --ranks {G} --cdf 0.85 0.9 0.95"


def analysis_rows() -> dict[str, list[str]]:
    """The table rows under each ``## <model>`` heading of docs/analysis.md."""
    out, model = {}, None
    for line in ANALYSIS.read_text().splitlines():
        if line.startswith("## "):
            model = line[3:].strip()
        elif model and re.match(r"\| \d+ \|", line):
            out.setdefault(model, []).append(line)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def analysis_row(doc: dict, cdf: float, placement: str) -> str:
    """One row of analysis.md's table from ``analysis.json``: ring's bytes, and the others'
    with their change against it."""
    mine = {r["strategy"]: r for r in doc["results"] if r["cdf"] == cdf and r["placement"] == placement}
    cells = [str(doc["ranks"]), f"{cdf:g}", f"{100 * mine['ring']['density']:.1f} %", placement,
             _gib(mine["ring"]["bytes_total"])]
    for s in ("ring-relay", "sparsp", "ulysses"):
        if s in mine:
            cells.append(f"{_gib(mine[s]['bytes_total'])} ({-100 * mine[s]['reduction_vs_ring']:+.1f} %)")
        else:
            cells.append(f"— ({doc['heads']} heads: not divisible by {doc['ranks']})")
    return "| " + " | ".join(cells) + " |"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hunyuan-video", "wan2.1-14b"])
def test_analysis_tables(model, tmp_path, capsys, monkeypatch, request):
    if not request.config.getoption("--doc-outputs"):
        pytest.skip("eight sparsp analyze runs: pytest -m slow --doc-outputs (make doc-outputs)")
    assert _COMMAND.format(model="MODEL", G="G") in " ".join(ANALYSIS.read_text().split())
    want = []
    for G in (2, 4, 8, 16):
        _run(_COMMAND.format(model=model, G=G), tmp_path / str(G), capsys, monkeypatch)
        doc = json.loads((tmp_path / str(G) / "out" / "analysis.json").read_text())
        want += [analysis_row(doc, cdf, p) for cdf in (0.85, 0.9, 0.95) for p in ("contiguous", "periodic")]
    assert analysis_rows()[model] == want
