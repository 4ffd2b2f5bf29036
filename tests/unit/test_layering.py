"""The house rules of docs/architecture.md, read from the source: which freetx package
imports which, no cycles, and strategy names only inside freetx/distributed/."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

LEAVES = {"models", "data", "envs"}  # import nothing of freetx above them
# ...but these leaves: data reads the built-in environments' own data (`tasks: [guess]`)
LEAF_EDGES = {"data": {"envs"}}
BELOW_EVERYTHING = {"errors", "fields", "checksums"}
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
        assert graph[leaf] <= BELOW_EVERYTHING | LEAF_EDGES.get(leaf, set()), (leaf, graph[leaf])
    assert "data" not in graph["envs"]  # one way


def test_checkpoint_and_training_do_not_import_each_other_both_ways():
    graph = package_graph()
    assert "training" not in graph["checkpoint"]


def test_only_the_cli_imports_the_planning_tools():
    """estimate and import live apart from training/, which holds what loops share."""
    graph = package_graph()
    assert {p for p, targets in graph.items() if "planning" in targets} == {"cli"}
    assert graph["planning"] <= {"training", "distributed", "models", "data", "config",
                                 "checkpoint", *BELOW_EVERYTHING}, graph["planning"]  # fmt: skip
    recipes = "".join(p.read_text() for p in (REPO / "recipes").glob("*.py"))
    assert "freetx.planning" not in recipes


def test_only_the_cli_and_the_decoder_setup_import_evaluation():
    """The harness adapter (lm-eval, an optional extra) lies apart from what training loops
    share; the eval recipe and `freetx eval` reach it, and the decoder recipes' setup for
    `eval.after_training`."""
    graph = package_graph()
    assert {p for p, targets in graph.items() if "evaluation" in targets} <= {"cli", "training"}
    training = {p.name for p in (REPO / "freetx" / "training").glob("*.py")
                if "evaluation" in freetx_imports(p)}  # fmt: skip
    assert training <= {"decoder.py"}, training
    assert graph["evaluation"] <= {"models", "data", "checkpoint", "distributed", "config",
                                   *BELOW_EVERYTHING}, graph["evaluation"]  # fmt: skip


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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Which freetx module imports which (top level and inside functions); `from pkg
    import name` points at pkg.name when that is a module, else at pkg."""
    paths = {module_name(p): p for p in (REPO / "freetx").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in paths else node.module)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def test_no_import_cycles_between_modules():
    graph = module_graph()
    cycles = []
    for start in graph:
        stack, seen = [(start, (start,))], {start}
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join((*trail, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    assert not cycles, cycles


COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "barrier",
    "broadcast", "broadcast_object_list", "reduce_scatter_tensor", "new_group",
    "init_process_group", "get_world_size", "get_rank",
}  # fmt: skip


def test_collectives_run_only_in_distributed():
    """Recipes, training, data, models and checkpoints name the group they reduce over
    through freetx.distributed (ParallelGroups), never torch.distributed directly."""
    offenders = []
    files = [p for p in (REPO / "freetx").rglob("*.py") if package_of(p) != "distributed"]
    files += sorted((REPO / "recipes").glob("*.py"))
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in COLLECTIVES
                and isinstance(node.value, ast.Name)
                and node.value.id == "dist"
            ):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} dist.{node.attr}")
    assert not offenders, offenders


def test_objectives_import_no_recipe_and_only_recipes_import_them():
    """The losses, rollouts and references are a library over training/, models/, data/,
    envs/ (multi-turn episodes) and distributed/: no freetx package below the recipes
    imports them."""
    graph = package_graph()
    assert not {p for p, targets in graph.items() if "objectives" in targets}
    assert graph["objectives"] <= {"training", "distributed", "models", "data", "envs", "config",
                                   "checkpoint", "user_files", *BELOW_EVERYTHING}  # fmt: skip
    for path in (REPO / "freetx" / "objectives").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not any(n.split(".")[0] == "recipes" for n in names), path
