"""The code's layout as a specification: which package may import which, no cycles, no reaching into privates.

Every import counts, those inside functions and under TYPE_CHECKING too: a cycle that only a function-level
import keeps from failing at start-up is still a cycle a reader has to untangle.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Each product folder and the import package it is (pyproject.toml's package-dir).
FOLDERS = {"engine": "npumoe.engine", "jobs": "npumoe.jobs", "daemon": "npumoe.daemon", "bench": "npumoe.bench",
           "launchd": "npumoe.launchd"}
# Who may import whom: daemon -> jobs -> engine; bench may import them all, and nothing imports bench.
MAY_IMPORT = {
    "npumoe.engine": {"npumoe.engine"},
    "npumoe.jobs": {"npumoe.jobs", "npumoe.engine"},
    "npumoe.daemon": {"npumoe.daemon", "npumoe.jobs", "npumoe.engine", "npumoe.launchd"},
    "npumoe.bench": {"npumoe.bench", "npumoe.daemon", "npumoe.jobs", "npumoe.engine"},
    "npumoe.launchd": set(),
}
# The engine's rooms, lowest first: each imports only from rooms before it (and from itself).
ENGINE_ORDER = ("vocabulary", "errors", "formats", "kernels", "moe", "plan", "backends", "loading", "attach",
                "generate", "calibration", "api", "synthetic")
MOST_FLAT_MODULES = 15


def product_modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = product_modules()


def imports_of(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported from, names taken) for every import statement of the module, wherever it stands."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.append((source, [alias.name for alias in node.names]))
    return found


def edges() -> dict[str, set[str]]:
    """Each product module and the product modules it imports (a name that is a submodule counts as one)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for source, names in imports_of(name, path):
            targets = [f"{source}.{n}" for n in names if f"{source}.{n}" in MODULES]
            if source in MODULES and (len(targets) < len(names) or not names):
                targets.append(source)
            graph[name].update(t for t in targets if t != name)
    return graph


def engine_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["npumoe", "engine"] else None


def test_no_import_cycle_among_product_modules() -> None:
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(MODULES):
        if module not in index:
            visit(module)
    assert cycles == []


def test_packages_import_only_downwards() -> None:
    wrong = []
    for module, targets in edges().items():
        top = ".".join(module.split(".")[:2])
        wrong += [(module, t) for t in targets if ".".join(t.split(".")[:2]) not in MAY_IMPORT[top]]
    assert wrong == []


def test_engine_rooms_import_only_rooms_below_them() -> None:
    rank = {room: i for i, room in enumerate(ENGINE_ORDER)}
    assert {engine_room(m) for m in MODULES if engine_room(m)} == set(ENGINE_ORDER)  # every room is ranked
    backward = []
    for module, targets in edges().items():
        room = engine_room(module)
        if room is None:
            continue  # the engine's package facade (npumoe.engine) names the API lazily
        backward += [(module, t) for t in targets if engine_room(t) is not None and rank[engine_room(t)] > rank[room]]
    assert backward == []


def test_no_module_imports_another_modules_private_names() -> None:
    private = []
    for name, path in MODULES.items():
        for source, names in imports_of(name, path):
            if source.startswith("npumoe.") and source != name:
                private += [(name, f"{source}.{n}") for n in names if n.startswith("_") and not n.startswith("__")]
    assert private == []


@pytest.mark.parametrize("folder", sorted({path.parent for path in MODULES.values()}), ids=str)
def test_no_product_folder_holds_more_than_fifteen_modules_flat(folder: Path) -> None:
    flat = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(flat) <= MOST_FLAT_MODULES, sorted(p.name for p in flat)


def test_the_rules_see_function_level_imports() -> None:
    """The graph holds an import made inside a function: the backends registry imports Core ML lazily."""
    lazy = [(s, n) for s, n in imports_of("npumoe.engine.backends.registry", MODULES["npumoe.engine.backends.registry"])
            if s.endswith("coreml.backend")]
    assert lazy and "npumoe.engine.backends.coreml.backend" in edges()["npumoe.engine.backends.registry"]
