"""The import order of src/sparsp, as docs/design.md writes it ("Layers"), holds in the code.

Every import between sparsp's modules counts, function-level ones included (those under
``if TYPE_CHECKING:`` do not run and are left out). A module may import from its own floor
and the floors below; the graph has no cycle. The floors are read from docs/design.md, so the
document and the test cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "sparsp"


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of src/sparsp."""
    found = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _type_checking_lines(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skip.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return skip


def imports() -> dict[str, set[str]]:
    """module -> the sparsp modules it imports (resolved to the module, not the package, where
    ``from pkg import name`` names a submodule)."""
    mods = modules()

    def known(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.split(".")[0] == "sparsp"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "sparsp":
                    continue
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            else:
                continue
            for target in targets:
                hit = known(target)
                if hit and hit != name:
                    out.add(hit)
        graph[name] = out
    return graph


def floors() -> list[list[str]]:
    """The "Layers" section of docs/design.md: one numbered line per floor, bottom first, each
    naming its modules in backticks (relative to ``sparsp``; ``sparsp`` itself is the package)."""
    text = (ROOT / "docs" / "design.md").read_text()
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/design.md has no '## Layers' section"
    rows = []
    for line in section.group(1).splitlines():
        if re.match(r"\s*\d+\.\s", line):
            names = re.findall(r"`([\w.]+)`", line)
            rows.append([n if n == "sparsp" else f"sparsp.{n}" for n in names])
    assert rows, "docs/design.md's Layers section lists no floor"
    return rows


def floor_of(module: str, table: list[list[str]]) -> int | None:
    best, level = -1, None
    for i, row in enumerate(table):
        for prefix in row:
            inside = module.startswith(prefix + ".") and prefix != "sparsp"  # the package: itself only
            if (module == prefix or inside) and len(prefix) > best:
                best, level = len(prefix), i
    return level


def test_every_module_has_a_floor():
    table = floors()
    missing = sorted(m for m in modules() if floor_of(m, table) is None)
    assert not missing, f"modules on no floor of docs/design.md's Layers: {missing}"


def test_no_import_runs_up_the_layers():
    table = floors()
    wrong = []
    for module, targets in sorted(imports().items()):
        here = floor_of(module, table)
        for target in sorted(targets):
            there = floor_of(target, table)
            if here is not None and there is not None and there > here:
                wrong.append(f"{module} (floor {here + 1}) imports {target} (floor {there + 1})")
    assert not wrong, "imports against the order of docs/design.md:\n" + "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    found = cycles(imports())
    assert not found, "import cycles in src/sparsp:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_cycles_and_function_level_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # a function-level import is seen: strategies.auto imports the cost model inside no function
    # today, but every import form is walked (ast.walk reaches function bodies)
    tree = ast.parse("def f():\n    from .x import y\n")
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
