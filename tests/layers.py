"""The layer check of ``make lint``: no import circle among a package's modules, counting every import,
and no module longer than :data:`MAX_LINES` lines (split one by job before it grows past that).

Imports inside functions and under ``TYPE_CHECKING`` count as much as module-level ones: a circle
held open by a deferred import is still a circle (it only moves the failure from import time to
run time). ``from package import name`` counts as importing the package's ``__init__`` and, when
``name`` is a module, that module; a module importing one of its own parent packages is not
counted (a package's ``__init__`` re-exporting its children is not a circle of design).

Run: ``python tests/layers.py framework broker spark_bridge``; exit status 1 and one line per
circle or oversized module when there is any (no argument: every package of :data:`PACKAGES`).
The one-way rules between packages (``example_services -> framework -> broker``) are
import-linter contracts in pyproject.toml.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["framework", "broker", "spark_bridge", "example_services", "benchmarks"]
MAX_LINES = 450  # the house rule: no module grows past this


def module_files(package: str) -> dict[str, Path]:
    """Every module of ``package`` (dotted name -> file); a package is named by its ``__init__``."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_names(module: str, path: Path) -> Iterator[str]:
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join([*parts, node.module] if node.module else parts)
            else:
                base = node.module or ""
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(packages: list[str]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (the nearest enclosing known module of each name)."""
    files: dict[str, Path] = {}
    for package in packages:
        files |= module_files(package)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for name in _imported_names(module, path):
            while name and name not in files:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                graph[module].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def oversized(packages: list[str], limit: int = MAX_LINES) -> list[tuple[Path, int]]:
    """Every ``.py`` file of ``packages`` longer than ``limit`` lines, with its line count."""
    found = []
    for package in packages:
        for path in module_files(package).values():
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > limit:
                found.append((path.relative_to(ROOT), lines))
    return sorted(found)


def main(argv: list[str]) -> int:
    packages = argv or PACKAGES
    found = circles(import_graph(packages))
    for component in found:
        print(f"import circle of {len(component)}: {' -> '.join(component)}")
    if not found:
        print(f"no import circle in {', '.join(packages)}")
    too_long = oversized(packages)
    for path, lines in too_long:
        print(f"{path}: {lines} lines, over the {MAX_LINES}-line limit; split it by job into modules")
    if not too_long:
        print(f"no module over {MAX_LINES} lines in {', '.join(packages)}")
    return 1 if found or too_long else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
