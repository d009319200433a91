"""Layers that only point down: no import circle, the back-up arrows named here and no other, and the audit path
without torch. The graph is read from the source (tests/import_graph.py); `python -m tests.import_graph` prints it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import import_graph
from tests.import_graph import Edge, back_up_arrows, circles, closure, edges, floor, modules

# Each back-up arrow that stays, with why it does (at most 3: the bound).
ALLOWED_BACK_UP_ARROWS: dict[tuple[str, str], str] = {}

# The floors that never import torch: what an auditor installs and runs.
TORCH_FREE = ("accounting", "encoding", "ledger", "policy", "attest", "verify")


@pytest.fixture(scope="module")
def graph() -> list[Edge]:
    return edges()


def test_every_module_has_a_floor(graph):
    for module in modules():
        floor(module)


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_back_up_arrows_are_the_named_few(graph):
    assert len(ALLOWED_BACK_UP_ARROWS) <= 3
    found = {(e.source, e.target) for e in back_up_arrows(graph)}
    assert found == set(ALLOWED_BACK_UP_ARROWS), import_graph.report()


def test_accounting_imports_nothing_above_it(graph):
    leaf = floor("govtrain.accounting")
    reached = closure(graph, "govtrain.accounting")
    assert {m for m in reached if floor(m) > leaf} == set()
    assert not any(m.startswith(("govtrain.privatizers", "govtrain.train")) for m in reached)


def test_verify_reaches_no_training_serving_or_torch_privatizer(graph):
    """Along every import, lazy ones too, the verifier reaches no training, routing, serving or mechanism code. A
    privatizer's torch parts are its modules that import torch when loaded (its noise, its rounding); they do their
    work in methods that only training calls, so the verifier must not reach them along imports that run when a
    module loads. (What verifying actually imports is checked by running it: tests/test_accounting.py,
    test_attacks_privatizer_record.py and test_attacks_privatizer_review.py verify ledgers in a fresh interpreter.)"""
    reached = closure(graph, "govtrain.verify")
    forbidden = ("govtrain.train", "govtrain.routing", "govtrain.serve", "govtrain.mechanisms", "govtrain.distributed")
    assert sorted(m for m in reached if m.startswith(forbidden)) == []
    torch_parts = {m for m, path in modules().items()
                   if m.startswith("govtrain.privatizers") and _imports_torch_when_loaded(path.read_text())}
    assert torch_parts, "the privatizers' torch parts are found (the test can fail)"
    loaded = closure(graph, "govtrain.verify", frozenset({"top", "typing"}))
    assert sorted(loaded & torch_parts) == []


def _imports_torch_when_loaded(source: str) -> bool:
    """A module-level `import torch` (or `from torch ...`), outside `if TYPE_CHECKING:`."""
    import ast

    def loaded(node: ast.AST) -> bool:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import) and any(a.name.split(".")[0] == "torch" for a in child.names):
                return True
            if isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] == "torch" and not child.level:
                return True
            if loaded(child):
                return True
        return False

    return loaded(ast.parse(source))


def test_torch_free_floors_import_no_torch():
    """Import every module of the torch-free floors, and ledger_store, in one fresh interpreter: none pulls torch."""
    names = sorted(m for m in modules() if m.split(".")[0] == "ledger_store"
                   or (m.startswith("govtrain.") and m.split(".")[1] in TORCH_FREE))
    assert len(names) > 40
    script = ("import importlib, sys\n"
              f"for name in {names!r}:\n"
              "    importlib.import_module(name)\n"
              "    assert 'torch' not in sys.modules, f'{name} imported torch'\n"
              "print('clean', len(sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("clean")


def test_the_graph_reader_sees_each_kind_of_import(tmp_path):
    """The reader itself: a top-level, a lazy and a typing-only import each make an edge; a circle is found."""
    pkg = tmp_path / "govtrain"
    (pkg / "accounting").mkdir(parents=True)
    (pkg / "train").mkdir()
    (tmp_path / "ledger_store").mkdir()
    (tmp_path / "ledger_store" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "accounting" / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "accounting" / "spend.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from govtrain.train.config import X\n")
    (pkg / "train" / "config.py").write_text("def f():\n    from ..accounting import spend\n")
    (pkg / "train" / "run.py").write_text("from govtrain.train import config\n")
    found = {(e.source, e.target): e.kinds for e in edges(tmp_path)}
    assert found[("govtrain.accounting.spend", "govtrain.train.config")] == {"typing"}
    assert found[("govtrain.train.config", "govtrain.accounting.spend")] == {"lazy"}
    assert found[("govtrain.train.run", "govtrain.train.config")] == {"top"}
    graph = edges(tmp_path)
    assert circles(graph) == [["govtrain.accounting.spend", "govtrain.train.config"]]
    assert [(e.source, e.target) for e in back_up_arrows(graph)] == [("govtrain.accounting.spend",
                                                                     "govtrain.train.config")]


MAX_LINES = 450  # shared/STYLE.md: past ~400 lines a module is probably two


def test_every_module_fits_in_a_head():
    """No module of govtrain or ledger_store is longer than MAX_LINES: a file a reader can hold in one sitting."""
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_layout_page_names_every_module_and_only_modules_that_exist():
    """docs/layout.md, the map of the code, has a row per folder naming each of its modules (a subpackage's in its
    parent's row), and names no module that is not there."""
    import re

    rows = {}
    for line in (import_graph.REPO / "docs" / "layout.md").read_text().splitlines():
        found = re.match(r"\| `((?:govtrain|ledger_store)/(?:[a-z_]+/)?)` \|(.*)\|\s*$", line)
        if found:
            rows[found.group(1)] = set(re.findall(r"`([a-z_0-9]+\.py)`", found.group(2)))
    assert "govtrain/" in rows and "govtrain/train/" in rows
    missing, named = [], {folder: set() for folder in rows}
    for name, path in modules().items():
        parts = path.relative_to(import_graph.REPO).parts
        folder = "/".join(parts[:2]) + "/" if len(parts) > 2 else parts[0] + "/"
        if path.name == "__init__.py" and len(parts) > 2:
            named.setdefault(folder, set()).add(path.name)  # a package's own __init__: named where it holds code
            continue
        if path.name not in rows.get(folder, set()):
            missing.append(str(path.relative_to(import_graph.REPO)))
        named.setdefault(folder, set()).add(path.name)
    assert missing == []
    assert {folder: names - named[folder] for folder, names in rows.items() if names - named[folder]} == {}
