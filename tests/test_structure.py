"""The code's shape, read from its source: every function of src/sparsp fits in 80 lines (but
``parallelize``, whose numbered steps read as one), so a function's steps stay named, each
deciding one thing; every collective of a benchmark driver goes through ``bench.common``,
where the ranks agree on failure first."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "sparsp"
BENCH = SRC / "bench"
LONG_BY_DESIGN = {("integrations/diffusers.py", "parallelize")}  # numbered steps, one function


def _functions():
    for path in sorted(BENCH.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.name, node


def test_every_function_fits_in_80_lines():
    long = []
    for path in sorted(SRC.rglob("*.py")):
        where = path.relative_to(SRC).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (where, node.name) not in LONG_BY_DESIGN:
                if node.end_lineno - node.lineno + 1 > 80:
                    long.append(f"{where}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
    assert any(name == "attention.py" and node.name == "main" for name, node in _functions())


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_to_all", "barrier", "broadcast",
               "broadcast_object_list", "gather", "gather_object", "reduce", "reduce_scatter", "scatter",
               "scatter_object_list"}
# The transport benchmark's stream alignment: a 4-byte all-reduce queued inside each timed
# exchange (on the GPU stream, between the two ranks' exchanges), not a step of the driver.
STREAM_ALIGNMENT = {("transport.py", "_aligned"), ("transport.py", "run")}  # run: its inner function


def test_every_bench_collective_goes_through_common():
    """A driver's collectives are ``common``'s (``stage``, ``over_ranks``, ``time_ms``, ``share``,
    ``first_error``), each of which follows a point where the ranks agreed that none failed:
    a collective made directly could wait for a peer that has stopped."""
    direct = []
    for name, node in _functions():
        if name == "common.py":
            continue
        for call in ast.walk(node):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "dist"
                    and call.func.attr in COLLECTIVES and (name, node.name) not in STREAM_ALIGNMENT):
                direct.append(f"{name}:{call.lineno} {node.name}: dist.{call.func.attr}")
    assert not direct, direct
