"""The import graph of govtrain and ledger_store, read from the source (no module is imported).

Every import counts: at module level, inside functions (lazy) and under `TYPE_CHECKING`. A lazy or typing-only import
is still a dependency a reader must follow, and the circles it closes are the ones that grow back into import-time
circles. `from package import name` counts as an import of `package.name` when that is a module, else of `package`;
the implicit import of a parent package's `__init__` does not count.

The floors, lowest first, are the pipeline of docs/layout.md. A module may import its own floor and any floor below;
an import of a higher floor is a "back-up arrow". `python -m tests.import_graph` prints the report.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("govtrain", "ledger_store")

# Lowest first. A name is a subpackage or module directly under govtrain/ ("" is govtrain/__init__.py, the facade).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("ledger_store",),
    ("errors", "units", "version", "encoding", "data", "accounting"),
    ("attest", "tasks"),
    ("policy",),
    ("privatizers",),
    ("ledger",),
    ("gate", "resolver"),
    ("mechanisms", "release", "models"),
    ("verify", "distributed"),
    ("monitor",),
    ("routing",),
    ("train",),
    ("integrations", "audit", "inference"),
    ("serve",),
    ("cli", "__main__", ""),
)


@dataclass(frozen=True, kw_only=True)
class Edge:
    source: str
    target: str
    kinds: frozenset[str]  # "top", "lazy", "typing"


def modules(repo: Path = REPO) -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _typing_only(tree: ast.Module) -> set[int]:
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return inside


def edges(repo: Path = REPO) -> list[Edge]:
    known = modules(repo)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: dict[tuple[str, str], set[str]] = defaultdict(set)
    for name, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        typing_only = _typing_only(tree)
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]

        def visit(node: ast.AST, lazy: bool) -> None:
            for child in ast.iter_child_nodes(node):
                nested = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets: list[str] = []
                if isinstance(child, ast.Import):
                    targets = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = package[: len(package) - (child.level - 1)]
                        origin = ".".join(base + ([child.module] if child.module else []))
                    else:
                        origin = child.module or ""
                    targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in child.names]
                for target in targets:
                    resolved = resolve(target)
                    if resolved and resolved != name:
                        kind = "typing" if id(child) in typing_only else "lazy" if nested else "top"
                        found[(name, resolved)].add(kind)
                visit(child, nested)

        visit(tree, False)
    return [Edge(source=a, target=b, kinds=frozenset(k)) for (a, b), k in sorted(found.items())]


def floor(module: str) -> int:
    parts = module.split(".")
    key = parts[0] if parts[0] != "govtrain" else (parts[1] if len(parts) > 1 else "")
    for level, names in enumerate(FLOORS):
        if key in names:
            return level
    raise KeyError(f"{module}: no floor in tests/import_graph.py FLOORS; add its package there and to docs/layout.md")


def circles(graph: list[Edge]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    adjacency: dict[str, list[str]] = defaultdict(list)
    nodes: set[str] = set()
    for edge in graph:
        adjacency[edge.source].append(edge.target)
        nodes.update((edge.source, edge.target))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(adjacency[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(adjacency[child])))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
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
    return found


def back_up_arrows(graph: list[Edge]) -> list[Edge]:
    return [edge for edge in graph if floor(edge.target) > floor(edge.source)]


def closure(graph: list[Edge], start: str, kinds: frozenset[str] = frozenset({"top", "lazy", "typing"})) -> set[str]:
    """Every module reachable from the modules under `start` (a package or module name) along imports of `kinds`."""
    adjacency: dict[str, set[str]] = defaultdict(set)
    for edge in graph:
        if edge.kinds & kinds:
            adjacency[edge.source].add(edge.target)
    seen = {m for m in modules() if m == start or m.startswith(start + ".")}
    todo = list(seen)
    while todo:
        for target in adjacency[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def report(repo: Path = REPO) -> str:
    graph = edges(repo)
    lines = [f"{len(modules(repo))} modules, {len(graph)} imports"]
    found = circles(graph)
    lines.append(f"circles: {len(found)}")
    lines += [f"  {len(c)} modules: {' '.join(c)}" for c in found]
    arrows = back_up_arrows(graph)
    lines.append(f"back-up arrows: {len(arrows)}")
    lines += [f"  {e.source} -> {e.target} ({', '.join(sorted(e.kinds))})" for e in arrows]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO))
