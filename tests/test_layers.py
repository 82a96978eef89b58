"""The package's imports run one way (docs/ARCHITECTURE.md): each module imports only from its own layer or lower
ones, ``train``, ``bench`` and ``serve`` stand side by side on the OPSD step without importing one another, no
modules import each other in a circle, and no private name is imported from another module. Read from the source (every import,
lazy ones inside functions and ``TYPE_CHECKING`` blocks included), so nothing is imported to check it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "opsd_rollout"

LAYERS = [
    {"metrics", "checks", "modeling", "presets", "models", "distributed", "deepspeed_engine", "deepspeed_config",
     "files", "seeding", "cores", "compact_answer", "lazy"},
    {"profiling"},
    {"rollout"},
    {"opsd"},
    {"train", "bench", "serve"},
    {"cli", "__main__"},
]
"""Bottom to top, by the first part of a module's name below the package."""
ROLLOUT_LAYERS = [None, {"decode"}, {"strategies"}, {"engine", "factory", "continuous_stats", None}]
"""Inside ``rollout/``: the loop's pieces, the strategies that run them, the rollout that picks a strategy and
what it reports (the package's ``__init__``, named ``None`` here, re-exports from there); the first entry is
every other module of ``rollout/``, the base they all stand on."""
APART = ({"train"}, {"bench"}, {"serve"})
"""Side by side in one layer: none imports another."""


def modules() -> dict[str, Path]:
    """``opsd_rollout.x.y`` -> its file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """``(module imported, name imported from it or None, line)`` for every import of the package's own modules."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + [node.module] if node.module else base)
            if module.split(".")[0] == "opsd_rollout":
                for alias in node.names:
                    child = f"{module}.{alias.name}"
                    found.append((child, None, node.lineno) if child in MODULES else (module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names
                      if alias.name.split(".")[0] == "opsd_rollout"]
    return found


def layer(name: str) -> int | None:
    """The layer index of a module (``None`` for the package's own lazy ``__init__``)."""
    parts = name.split(".")
    if len(parts) == 1:
        return None
    return next(i for i, members in enumerate(LAYERS) if parts[1] in members)


def rollout_layer(name: str) -> int:
    parts = name.split(".")
    below = parts[2] if len(parts) > 2 else None
    return next((i for i, members in enumerate(ROLLOUT_LAYERS) if members is not None and below in members), 0)


def edges() -> list[tuple[str, str, str | None, int]]:
    return [(name, target, imported, line) for name, path in MODULES.items()
            for target, imported, line in imports(name, path) if target != name]


def test_every_module_has_a_layer():
    assert [name for name in MODULES if len(name.split(".")) > 1 and
            not any(name.split(".")[1] in members for members in LAYERS)] == []


def test_imports_go_down_or_across_never_up():
    upward = []
    for source, target, _, line in edges():
        here, there = layer(source), layer(target)
        if here is None or there is None:
            continue
        if there > here:
            upward.append(f"{source}:{line} imports {target}")
        elif here == there and source.split(".")[1] == "rollout" == target.split(".")[1] and \
                rollout_layer(target) > rollout_layer(source):
            upward.append(f"{source}:{line} imports {target}")
        for side in APART:
            others = set().union(*(other for other in APART if other is not side))
            if source.split(".")[1] in side and target.split(".")[1] in others:
                upward.append(f"{source}:{line} imports {target} (train, bench and serve stand apart)")
    assert upward == []


def test_no_modules_import_each_other_in_a_circle():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for source, target, _, _ in edges():
        if target in graph:
            graph[source].add(target)
    circles, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            circles.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, path + [node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    assert circles == []


def test_no_private_name_is_imported_from_another_module():
    private = [f"{source}:{line} imports {imported} from {target}" for source, target, imported, line in edges()
               if imported is not None and imported.startswith("_") and not imported.startswith("__")]
    assert private == []


@pytest.mark.parametrize("rule", ["layers", "circles"])
def test_the_rules_catch_what_they_forbid(rule, monkeypatch):
    """A planted upward import and a planted circle are found (the checks above are not vacuous)."""
    planted = dict(MODULES)
    monkeypatch.setattr("test_layers.MODULES", planted)
    real = imports

    def with_plant(name, path):
        extra = {"layers": {"opsd_rollout.metrics": [("opsd_rollout.bench.report", None, 1)]},
                 "circles": {"opsd_rollout.files": [("opsd_rollout.checks", None, 1)],
                             "opsd_rollout.checks": [("opsd_rollout.files", None, 1)]}}[rule]
        return real(name, path) + extra.get(name, [])

    monkeypatch.setattr("test_layers.imports", with_plant)
    check = {"layers": test_imports_go_down_or_across_never_up, "circles": test_no_modules_import_each_other_in_a_circle}
    with pytest.raises(AssertionError):
        check[rule]()
