"""Every import the README, docs/ and examples/ show works.

Collects ``import sparsp...``, ``from sparsp... import a, b`` and ``python -m sparsp...``
from those files and runs each import, so that moving a module without keeping its documented
path fails here rather than for a user.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.py"))]

_FROM = re.compile(r"^\s*from (sparsp[\w.]*) import \(?([\w, ]+)", re.M)
_IMPORT = re.compile(r"^\s*import (sparsp[\w.]*)", re.M)
_RUN = re.compile(r"python3? -m (sparsp[\w.]*)")


def documented() -> list[tuple[str, str, tuple[str, ...]]]:
    """(file, module, names) for every import shown."""
    found = set()
    for path in FILES:
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        for module, names in _FROM.findall(text):
            found.add((rel, module, tuple(n.strip() for n in names.split(",") if n.strip())))
        for module in _IMPORT.findall(text) + _RUN.findall(text):
            found.add((rel, module, ()))
    return sorted(found)


def test_the_documents_show_imports():
    assert len(documented()) >= 5, documented()


@pytest.mark.parametrize("where,module,names", documented(), ids=lambda x: x if isinstance(x, str) else None)
def test_documented_import_works(where, module, names):
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n) and importlib.util.find_spec(f"{module}.{n}") is None]
    assert not missing, f"{where}: `from {module} import {', '.join(names)}`: no {missing}"
