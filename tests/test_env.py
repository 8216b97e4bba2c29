"""The environment variables sparsp reads: the four of ``sparsp.env``, and nothing else.

A ``SPARSP_*`` variable that is set but not one of them (a setting removed in 0.2.0, or a
misspelt one) draws one ``RuntimeWarning`` naming it, at ``import sparsp``; and no module but
``env.py`` names any other ``SPARSP_`` variable, so none can be read behind its back. No module
outside ``env.py`` and the benchmark drivers (``sparsp/bench/``) reads or writes the process
environment at all.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import sparsp
from sparsp import env

SRC = Path(sparsp.__file__).parent


def test_the_four_names():
    assert env.KNOWN == ("SPARSP_PROFILE", "SPARSP_SHM_TAG", "SPARSP_HOST_ID", "SPARSP_TRITON")


def test_a_stale_name_draws_one_warning_at_import():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SPARSP_")}
    environ.update(SPARSP_TRITON_SUMS="0", SPARSP_TRITON="0", SPARSP_SHM_TAG="t1")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    import sparsp\n"
            "    sparsp.env.warn_unknown()  # once per process: not again\n"
            "for w in seen:\n"
            "    print(w.category.__name__, '|', w.message)\n")
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()
    mine = [line for line in out if "SPARSP_" in line]
    assert len(mine) == 1, out
    assert mine[0].startswith("RuntimeWarning | SPARSP_TRITON_SUMS is set but sparsp no longer reads it")
    assert "SPARSP_TRITON, " not in mine[0].split("reads it")[0]  # the known ones are not named


def test_warn_unknown_once_per_name(monkeypatch):
    monkeypatch.setattr(env, "_warned", set())
    for name in [n for n in os.environ if n.startswith("SPARSP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPARSP_RANGES", "1")
    monkeypatch.setenv("SPARSP_PROFILE", "h200x2-nvlink")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        env.warn_unknown()
        env.warn_unknown()
    assert [str(w.message).split()[0] for w in seen] == ["SPARSP_RANGES"]
    assert all(w.category is RuntimeWarning for w in seen)
    assert env.unknown() == ["SPARSP_RANGES"]


def test_no_module_but_env_names_another_sparsp_variable():
    """Source text, docstrings and comments included: only env.py may name a ``SPARSP_*``
    variable other than the four, and only env.py reads ``os.environ`` / ``os.getenv`` for one."""
    known = set(env.KNOWN)
    stray, reads = [], []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "env.py" and path.parent == SRC:
            continue
        text = path.read_text()
        rel = path.relative_to(SRC)
        stray += [f"{rel}: {n}" for n in sorted(set(re.findall(r"SPARSP_[A-Z0-9_]+", text)) - known)]
        reads += [f"{rel}: {m}" for m in re.findall(r"(?:environ\S*|getenv)\(\s*[\"']SPARSP_\w*", text)]
    assert not stray, stray
    assert not reads, reads


def _environ_uses(tree: ast.AST) -> list[int]:
    """Line numbers of every use of the process environment in a module: ``os.environ``,
    ``os.getenv``, ``os.putenv``, ``os.unsetenv``, ``os.environb`` (read or write), and the same
    names imported from ``os``."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_only_env_reads_or_writes_the_environment():
    """No module outside ``env.py`` and ``sparsp/bench/`` reads or writes ``os.environ`` (any
    variable, sparsp's or another tool's): a setting is a field or an argument, and a variable
    sparsp must know about (Triton's ``TRITON_INTERPRET``) is read through a function of
    ``env.py``."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "env.py" or rel.startswith("bench/"):
            continue
        found += [f"{rel}:{line}" for line in _environ_uses(ast.parse(path.read_text()))]
    assert not found, f"the environment used outside env.py: {found}"


def test_the_environment_check_sees_every_spelling():
    code = ("import os\nfrom os import getenv\nos.environ['A'] = '1'\nx = os.environ.get('B')\n"
            "os.getenv('C')\nos.putenv('D', '1')\n")
    assert _environ_uses(ast.parse(code)) == [2, 3, 4, 5, 6]


def test_triton_interpret_is_read_through_env(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert env.triton_interpret() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert env.triton_interpret() is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert env.triton_interpret() is False
    assert "TRITON_INTERPRET" not in env.KNOWN  # Triton's variable: the four stay four
