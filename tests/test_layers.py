"""The layers of the package, read from the source (ast): every import points down, and nothing imports in a circle.

    agents → tools → graphs → training | evals → ermedrag (the CLI and public API)

An import inside a function counts like one at the top of a module: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# The folders of the repository and the installed package each one becomes.
FOLDERS = {
    "agents": "ermedrag.agents",
    "tools": "ermedrag.tools",
    "graphs": "ermedrag.graphs",
    "training": "ermedrag.training",
    "evals": "ermedrag.evals",
    "ermedrag": "ermedrag",
}
# What each layer may import besides itself (training and evals stand side by side: neither imports the other).
MAY_IMPORT = {
    "ermedrag.agents": set(),
    "ermedrag.tools": {"ermedrag.agents"},
    "ermedrag.graphs": {"ermedrag.agents", "ermedrag.tools"},
    "ermedrag.training": {"ermedrag.agents", "ermedrag.tools", "ermedrag.graphs"},
    "ermedrag.evals": {"ermedrag.agents", "ermedrag.tools", "ermedrag.graphs"},
    "ermedrag": {"ermedrag.agents", "ermedrag.tools", "ermedrag.graphs", "ermedrag.training", "ermedrag.evals"},
}


def package_sources(repo: Path = REPO) -> dict[str, str]:
    """Module name → source, for every module the package installs."""
    sources = {}
    for folder, package in FOLDERS.items():
        for path in sorted((repo / folder).rglob("*.py")):
            parts = list(path.relative_to(repo / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            sources[".".join([package, *parts])] = path.read_text(encoding="utf-8")
    return sources


def imported_modules(name: str, source: str, known: set[str]) -> set[str]:
    """The package's modules that module `name` imports (relative imports resolved, `from pkg import mod` read
    as the module `pkg.mod`)."""
    is_package = f"{name}.__init__" in known or any(k.startswith(name + ".") for k in known)
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import ermedrag.tools.retrieval.index.x` → its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer(module: str) -> str:
    return next(p for p in sorted(MAY_IMPORT, key=len, reverse=True) if module == p or module.startswith(p + "."))


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            own, other = layer(module), layer(target)
            if other != own and other not in MAY_IMPORT[own]:
                bad.append(f"{module} imports {target} ({own} may import only {sorted(MAY_IMPORT[own]) or 'itself'})")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as a sorted list of names."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    known = set(sources)
    return {name: imported_modules(name, source, known) for name, source in sources.items()}


def test_every_import_points_down_and_nothing_is_circular():
    graph = import_graph(package_sources())
    assert len(graph) > 30 and "ermedrag.cli" in graph and "ermedrag.graphs.er_medrag" in graph
    assert upward_imports(graph) == []
    assert import_cycles(graph) == []


def test_the_check_catches_an_upward_import_and_a_cycle():
    sources = package_sources()
    # A deliberate upward import (agents → tools), a lazy one (tools → training, inside a function), and a circle
    # between two training modules.
    sources["ermedrag.agents.respondent"] += "\nfrom ermedrag.tools.records.traces import TraceStore\n"
    sources["ermedrag.tools.retrieval.index"] += "\ndef _late():\n    from ermedrag.training import trainers\n"
    sources["ermedrag.training.config"] += "\nfrom ermedrag.training.trainers import plot_curves\n"
    graph = import_graph(sources)
    bad = upward_imports(graph)
    assert any(b.startswith("ermedrag.agents.respondent imports ermedrag.tools.records.traces") for b in bad)
    assert any(b.startswith("ermedrag.tools.retrieval.index imports ermedrag.training.trainers") for b in bad)
    assert any({"ermedrag.training.config", "ermedrag.training.trainers"} <= set(c) for c in import_cycles(graph))


def test_relative_imports_are_resolved():
    known = {
        "ermedrag.graphs",
        "ermedrag.graphs.common",
        "ermedrag.graphs.mmed",
        "ermedrag.graphs.mmed.state",
        "ermedrag.training.trainers",
    }
    assert imported_modules("ermedrag.graphs.mmed.state", "from ..common import Context\nfrom . import x\n", known) == {
        "ermedrag.graphs.common",
        "ermedrag.graphs.mmed",
    }


# ------------------------------------------------------------------------------------------- sub-packages

SUB_PACKAGE_PARENTS = ("ermedrag.tools", "ermedrag.training", "ermedrag.graphs", "ermedrag.testing")


def sub_package(module: str, known: set[str]) -> str:
    """The unit a module belongs to one level below its layer: `ermedrag.tools.retrieval.index` →
    `ermedrag.tools.retrieval`; a module directly in a layer is its own unit."""
    for parent in SUB_PACKAGE_PARENTS:
        if module.startswith(parent + "."):
            head = ".".join(module.split(".")[: len(parent.split(".")) + 1])
            return head
    return module


def collapsed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    known = set(graph)
    units: dict[str, set[str]] = {}
    for module, targets in graph.items():
        unit = sub_package(module, known)
        units.setdefault(unit, set()).update(t for t in (sub_package(t, known) for t in targets) if t != unit)
    return units


def test_sub_packages_import_each_other_without_a_circle():
    """One level down the plan holds too: `tools.models`, `tools.retrieval`, `training.rewards`... may depend on
    one another, but never in a circle (a circle between two folders means they are one concern, or a piece is
    in the wrong one)."""
    units = collapsed(import_graph(package_sources()))
    assert {
        "ermedrag.tools.models",
        "ermedrag.tools.model_server",
        "ermedrag.tools.retrieval",
        "ermedrag.training.rewards",
        "ermedrag.graphs.mmedagent",
    } <= set(units)
    assert import_cycles(units) == []


def test_the_plan_stays_readable():
    """At most about eight modules a folder (tools/ and training/ at most 8 directly), no product module over 600
    lines, and the environment read in one module only (`tools/settings.py`)."""
    for folder in ("tools", "training"):
        assert len(list((REPO / folder).glob("*.py"))) <= 8, f"{folder}/ holds more than 8 modules: make a sub-package"
    long = {
        f"{path.relative_to(REPO)}: {n}"
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > 600
    }
    assert not long, f"split these modules by concern: {sorted(long)}"
    readers = {
        str(path.relative_to(REPO))
        for folder in FOLDERS
        for path in (REPO / folder).rglob("*.py")
        if any(
            call in line and "ERMEDRAG_" in line
            for line in path.read_text(encoding="utf-8").splitlines()
            for call in ("os.environ", "getenv(")
        )
    }
    assert readers <= {"tools/settings.py"}, f"read these settings through tools.settings: {sorted(readers)}"
