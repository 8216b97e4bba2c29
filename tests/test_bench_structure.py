"""The benchmark drivers' shape, read from their source: every function fits in 80 lines, so a
driver's steps stay named, each deciding one thing."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "src" / "sparsp" / "bench"


def _functions():
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.name, node


def test_every_bench_function_fits_in_80_lines():
    long = [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for name, node in _functions() if node.end_lineno - node.lineno + 1 > 80]
    assert not long, long
    assert any(name == "attention.py" and node.name == "main" for name, node in _functions())
