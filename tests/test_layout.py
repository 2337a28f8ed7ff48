"""The layout shows the pipeline (README's "Where things are"): each stage or job a package, the
imports between them one way only, and no package holding the bulk of the code.

An import anywhere counts: at module level, inside a function, or under `TYPE_CHECKING`; a
knot hidden in a function body is still a knot a reader has to untie.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "predispatch"

#: The stages after export: what `ExportedProgram`'s methods call.  Each may use the ones to its
#: right, never one to its left: `program` -> `serialize` -> `runtime` -> `transforms`.
AFTER_EXPORT = ("program", "serialize", "runtime", "transforms")


def _unit(module: str) -> str | None:
    """The top-level package or module of `predispatch.<unit>...`; None outside predispatch or for
    the root itself (whose public names are imported lazily, by string)."""
    parts = module.split(".")
    if parts[0] != "predispatch" or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    """Every `predispatch.*` module or name `path` imports, wherever the import stands."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "predispatch":  # `from predispatch import errors`
                names.update(f"predispatch.{alias.name}" for alias in node.names)
    return names


def _unit_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).with_suffix("")
        if relative.parts == ("__init__",):
            continue
        unit = relative.parts[0]
        targets = {_unit(name) for name in _imports(path)}
        graph.setdefault(unit, set()).update(t for t in targets if t is not None and t != unit)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the units, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        stack.append(unit)
        for target in sorted(graph.get(unit, ())):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        stack.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (found := visit(unit)):
            return found
    return None


def test_no_import_knots_between_packages():
    cycle = _cycle(_unit_graph())
    assert cycle is None, "import knot: " + " -> ".join(cycle or ())


def test_the_stages_after_export_import_one_way():
    graph = _unit_graph()
    wrong = [
        f"{low} imports {high}"
        for i, high in enumerate(AFTER_EXPORT)
        for low in AFTER_EXPORT[i + 1:]
        if high in graph.get(low, ())
    ]
    assert not wrong, wrong


def test_the_checker_sees_a_knot():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


def _lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


_PACKAGES = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.rglob("__init__.py") if p.parent != ROOT)


@pytest.mark.parametrize("package", _PACKAGES)
def test_no_package_holds_more_than_a_quarter_of_the_lines(package):
    """Each package with its subpackages (trace/ with trace/dedup/): at most a quarter of all."""
    total = _lines(ROOT.rglob("*.py"))
    held = _lines((ROOT / package).rglob("*.py"))
    assert held <= total / 4, f"{package}/ holds {held} of {total} lines"


def _module_graph() -> dict[str, set[str]]:
    """module -> the other predispatch modules it imports (a package's `__init__` by its name)."""
    def name_of(path: Path) -> str:
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    def imported(path: Path) -> Iterator[str]:
        """Each module `path` imports: `from p.a import b` imports `p.a.b` when that is a module."""
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                yield from (alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    yield f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module

    modules = {name_of(path): path for path in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in imported(path):
            while target and target not in modules:  # `from predispatch.a.b import name`
                target = target.rpartition(".")[0]
            if target and target != name and target != "predispatch":
                targets.add(target)
        graph[name] = targets
    return graph


def test_no_import_circles_between_modules():
    """Within a package too (issue 38: `audit/render.py` and `audit/table.py` imported each
    other): a module's imports, wherever they stand, never lead back to it."""
    cycle = _cycle(_module_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def test_module_circles_are_found():
    assert _cycle({"predispatch.a.x": {"predispatch.a.y"}, "predispatch.a.y": {"predispatch.a.x"}}) is not None
