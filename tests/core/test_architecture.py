"""The shape of the code (issue 28): one concern per module said in its first line, data flowing
one way (no import cycle, dp_core pure), and modules that do not grow past a reviewable size."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.support.paths import ROOT

PACKAGES = ("server", "dp_core", "config")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of the packages, nested ones included, by dotted name (a package by its
    own name, for its `__init__.py`)."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if p.stem == "__init__" else parts)] = p
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports anywhere: at the top, inside functions, and for
    type checking only (a cycle of type-only imports is a cycle of concerns all the same)."""
    here = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = here.removesuffix(".__init__") if path.stem == "__init__" else here.rpartition(".")[0]

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.partition(".")[0] in PACKAGES and (mod := owner(name)):
                found.add(mod)
    return found


def test_no_import_cycle_and_dp_core_is_pure() -> None:
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    assert not [m for m, deps in graph.items() if m.startswith("dp_core.")
                and any(d.startswith("server.") for d in deps)], "dp_core imports server"
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(
                    [*trail[trail.index(dep):], dep] if dep in trail else [*trail, dep]))
            if dep in graph and dep not in state:
                visit(dep, [*trail, dep])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_each_module_says_its_concern_in_its_first_line() -> None:
    for name, path in _modules().items():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if path.stem == "__init__" and doc is None:
            continue
        assert doc, f"{name} has no docstring"
        first = doc.splitlines()[0]
        assert 20 <= len(first) <= 110 and not re.match(r"(?i)this module", first), \
            f"{name}: {first!r}"


def test_modules_stay_reviewable() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for p in _modules().values()}
    over = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not over, f"over {MAX_LINES} lines: split them by concern: {over}"
