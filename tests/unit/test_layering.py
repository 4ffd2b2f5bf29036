"""The house rules of docs/architecture.md, read from the source: which freetx package
imports which, no cycles, and strategy names only inside freetx/distributed/."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

LEAVES = {"models", "data", "envs"}  # import nothing of freetx above them
BELOW_EVERYTHING = {"errors", "fields"}
STRATEGIES = {"ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"}


def package_of(path: Path) -> str:
    parts = path.relative_to(REPO / "freetx").parts
    return parts[0].removesuffix(".py")


def freetx_imports(path: Path) -> set[str]:
    """The freetx packages a module imports (top level and inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "freetx" and len(parts) > 1:
                found.add(parts[1])
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in (REPO / "freetx").rglob("*.py"):
        package = package_of(path)
        graph.setdefault(package, set()).update(freetx_imports(path) - {package})
    return graph


def test_leaf_packages_import_only_errors_and_fields():
    graph = package_graph()
    for leaf in LEAVES:
        assert graph[leaf] <= BELOW_EVERYTHING, (leaf, graph[leaf])


def test_checkpoint_and_training_do_not_import_each_other_both_ways():
    graph = package_graph()
    assert "training" not in graph["checkpoint"]


def test_no_import_cycles_between_packages():
    graph = package_graph()

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    cycles = [p for p in graph if reaches(p, p, {p})]
    assert not cycles, {p: sorted(graph[p]) for p in cycles}


def test_strategy_names_appear_only_in_distributed():
    offenders = []
    files = [p for p in (REPO / "freetx").rglob("*.py") if package_of(p) != "distributed"]
    files += sorted((REPO / "recipes").glob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in STRATEGIES:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value!r}")
    assert not offenders, offenders
