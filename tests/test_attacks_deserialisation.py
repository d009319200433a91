"""The class behind issue 34's item 3: nothing govtrain reads back from disk may run code.

A scan of every module under `govtrain/` and `ledger_store/` (their syntax trees, so that aliases, `from`-imports
and keywords are seen as Python sees them) for each way a read can run code:

- `torch.load` (or `torch.serialization.load`) without `weights_only=True`, or passed around uncalled; `torch.jit.load`
  and `torch.package`'s importer (they load code by design);
- an import of `pickle`, `_pickle`, `cPickle`, `cloudpickle`, `dill`, `joblib`, `marshal` or `shelve`, plain, from, or
  through `__import__` / `importlib.import_module` of a constant name;
- `numpy.load` (any call) given `allow_pickle` other than False; pandas' `read_pickle`;
- `yaml.load` / `yaml.load_all` without a `SafeLoader`; `yaml.unsafe_load`, `yaml.full_load` and their `_all`;
- the builtins `eval` and `exec`, called or not; torch.distributed's object collectives (they unpickle);
- a keyword that turns such a read on anywhere (transformers, peft, numpy): `weights_only` other than True,
  `trust_remote_code` other than False, `use_safetensors` or `safe_serialization` other than True.

Any new use fails `test_govtrain_reads_back_nothing_that_can_run_code`; the one use allowed (`ALLOWED`, with why)
is counted, so that a second one fails too. The scanner itself is tested on small
snippets, each pattern and its safe form, so that it cannot pass by seeing nothing."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("govtrain", "ledger_store")
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
UNSAFE_CALLS = {"torch.jit.load": "loads TorchScript code", "torch.package.PackageImporter": "imports packaged code",
                "yaml.unsafe_load": "unpickles Python objects", "yaml.unsafe_load_all": "unpickles Python objects",
                "yaml.full_load": "builds Python objects", "yaml.full_load_all": "builds Python objects",
                **{f"torch.distributed.{name}": "unpickles what another rank sends" for name in (
                    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
                    "recv_object_list")}}
# What the scan allows, with why (the count of each finding, so that one more is new): the run's ranks exchange
# small records (a refusal's code, the lead's plan) with torch.distributed's object collectives, which pickle.
# They are messages between the run's own processes over its process group, never bytes read back from disk; the
# group's transport is unauthenticated in torch.distributed whatever is sent on it (gradients, weights), so its
# network is the operator's (docs/distributed.md#faults).
ALLOWED = {
    "govtrain/distributed/world.py": {"import pickle": 1,
                                      "torch.distributed.broadcast_object_list (unpickles what another rank sends)": 1,
                                      "torch.distributed.all_gather_object (unpickles what another rank sends)": 1},
}
TORCH_LOADS = {"torch.load", "torch.serialization.load"}
BUILTINS = {"eval", "exec", "builtins.eval", "builtins.exec"}
# keyword -> the one value that keeps a read from running code
KEYWORDS = {"weights_only": True, "trust_remote_code": False, "use_safetensors": True, "safe_serialization": True,
            "allow_pickle": False}


def _constant(node: ast.AST | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


class _Scanner(ast.NodeVisitor):
    """Findings ("line: what") in one module's tree. Names are resolved through the module's imports (`import torch
    as t`, `from torch import load`), wherever they are made; a name the module binds otherwise (a def, an
    assignment) is its own, not a builtin."""

    def __init__(self) -> None:
        self.aliases: dict[str, str] = {}  # local name -> the dotted name it was imported as
        self.bound: set[str] = set()  # names the module defines itself
        self.findings: list[str] = []
        self.called: set[int] = set()  # ids of the `torch.load` references that a call visited here names

    # -- names ------------------------------------------------------------------------------------------------
    def prepare(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.aliases[alias.asname] = alias.name
                    else:
                        self.aliases.setdefault(alias.name.split(".")[0], alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.bound.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.bound.add(node.id)
            elif isinstance(node, ast.arg):
                self.bound.add(node.arg)

    def dotted(self, node: ast.AST) -> str | None:
        """`np.load` -> "numpy.load", `load` (from torch) -> "torch.load", `eval` -> "eval" (unless bound here)."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        if node.id in self.aliases:
            head = self.aliases[node.id]
        elif node.id in self.bound:
            return None
        else:
            head = node.id
        return ".".join([head, *reversed(parts)])

    def find(self, node: ast.AST, what: str) -> None:
        self.findings.append(f"{getattr(node, 'lineno', '?')}: {what}")

    # -- imports ----------------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] in UNSAFE_MODULES:
                self.find(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and node.module.split(".")[0] in UNSAFE_MODULES:
            self.find(node, f"from {node.module} import …")

    # -- calls and references ---------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        name = self.dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords if k.arg is not None}
        if name in TORCH_LOADS:
            self.called.add(id(node.func))  # its reference below is this call, judged here
            if not _constant(keywords.get("weights_only"), True):
                self.find(node, f"{name} without weights_only=True")
        elif name in UNSAFE_CALLS:
            self.find(node, f"{name} ({UNSAFE_CALLS[name]})")
        elif name is not None and name.split(".")[-1] == "read_pickle":
            self.find(node, f"{name} (unpickles)")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = keywords.get("Loader", node.args[1] if len(node.args) > 1 else None)
            loader_name = self.dotted(loader) if loader is not None else None
            if loader_name is None or not loader_name.endswith("SafeLoader"):
                self.find(node, f"{name} without a SafeLoader")
        elif name in ("__import__", "importlib.import_module") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and node.args[0].value.split(".")[0] in UNSAFE_MODULES:
            self.find(node, f"{name}({node.args[0].value!r})")
        for keyword, safe in KEYWORDS.items():
            if keyword in keywords and not _constant(keywords[keyword], safe):
                self.find(node, f"{name or 'a call'}({keyword}=…): only {keyword}={safe} reads no code")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.reference(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Load) and self.reference(node):
            return
        self.generic_visit(node)

    def reference(self, node: ast.AST) -> bool:
        name = self.dotted(node)
        if name in BUILTINS:
            self.find(node, f"{name} (runs code)")
            return True
        if name in TORCH_LOADS:
            if id(node) not in self.called:
                self.find(node, f"{name} passed around (called elsewhere without weights_only=True)")
            return True
        return False


def scan(source: str) -> list[str]:
    """Every unsafe read in `source` (a module's text), as "line: what"."""
    tree = ast.parse(source)
    scanner = _Scanner()
    scanner.prepare(tree)
    scanner.visit(tree)  # a call is visited before its callee's reference (`visit_Call`, then `generic_visit`)
    return sorted(set(scanner.findings), key=lambda f: (int(f.split(":")[0]) if f[0].isdigit() else 0, f))


def _modules() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (ROOT / folder).rglob("*.py"))


def test_govtrain_reads_back_nothing_that_can_run_code():
    modules = _modules()
    # the scan sees the modules that read back: it cannot pass by scanning nothing
    names = {p.relative_to(ROOT).as_posix() for p in modules}
    assert {"govtrain/train/run.py", "govtrain/train/state_file.py", "govtrain/release/load.py",
            "ledger_store/store.py"} <= names and len(modules) > 100
    found = []
    for path in modules:
        name = path.relative_to(ROOT).as_posix()
        findings = scan(path.read_text())
        allowed = Counter(ALLOWED.get(name, {}))
        seen = Counter(f.split(": ", 1)[1] for f in findings)
        found += [f"{name}:{f}" for f in findings if seen[f.split(": ", 1)[1]] > allowed[f.split(": ", 1)[1]]]
        assert all(seen[what] == count for what, count in allowed.items()), \
            f"{name}: the allowed {dict(allowed)} are not what is there ({dict(seen)}): update ALLOWED"
    assert found == [], "reads that can run code:\n" + "\n".join(found)


# -- the scanner sees each pattern, and passes its safe form --------------------------------------------------------

UNSAFE = {
    "torch.load": "import torch\ntorch.load(path)",
    "torch.load weights_only=False": "import torch\ntorch.load(path, weights_only=False, map_location='cpu')",
    "torch.load weights_only from a variable": "import torch\nflag = True\ntorch.load(path, weights_only=flag)",
    "torch.load aliased": "import torch as t\nt.load(path)",
    "torch.load from-imported": "from torch import load\nload(path)",
    "torch.load from-imported and renamed": "from torch import load as read\nread(path)",
    "torch.serialization.load": "import torch.serialization\ntorch.serialization.load(path)",
    "torch.load inside a function": "def f(path):\n    import torch\n    return torch.load(path)",
    "torch.load passed around": "import torch\nread = torch.load\nread(path, weights_only=True)",
    "torch.jit.load": "import torch\ntorch.jit.load(path)",
    "torch.package": "from torch.package import PackageImporter\nPackageImporter(path)",
    "import pickle": "import pickle",
    "import pickle as": "import pickle as p",
    "from pickle import": "from pickle import loads",
    "import _pickle": "import _pickle",
    "import cPickle": "import cPickle",
    "import dill": "import dill",
    "import joblib": "import joblib",
    "from joblib import": "from joblib import load",
    "import marshal": "import marshal",
    "import shelve": "import shelve",
    "import cloudpickle": "import cloudpickle",
    "__import__ pickle": "__import__('pickle')",
    "importlib pickle": "import importlib\nimportlib.import_module('pickle')",
    "np.load allow_pickle": "import numpy as np\nnp.load(path, allow_pickle=True)",
    "numpy.load allow_pickle from a variable": "import numpy\nok = True\nnumpy.load(path, allow_pickle=ok)",
    "pd.read_pickle": "import pandas as pd\npd.read_pickle(path)",
    "yaml.load": "import yaml\nyaml.load(text)",
    "yaml.load Loader": "import yaml\nyaml.load(text, Loader=yaml.Loader)",
    "yaml.load positional loader": "import yaml\nyaml.load(text, yaml.UnsafeLoader)",
    "yaml.load_all": "import yaml\nyaml.load_all(text, Loader=yaml.FullLoader)",
    "yaml.unsafe_load": "import yaml\nyaml.unsafe_load(text)",
    "yaml.full_load": "import yaml\nyaml.full_load(text)",
    "from yaml import load": "from yaml import load\nload(text)",
    "eval": "eval('1 + 1')",
    "exec": "exec('x = 1')",
    "eval in a method": "class A:\n    def f(self, s):\n        return eval(s)",
    "eval passed around": "run = eval\nrun('1')",
    "builtins.exec": "import builtins\nbuiltins.exec('x = 1')",
    "trust_remote_code": "from transformers import AutoModel\nAutoModel.from_pretrained(p, trust_remote_code=True)",
    "weights_only=False elsewhere": "from transformers import AutoModel\nAutoModel.from_pretrained(p, "
                                    "weights_only=False)",
    "use_safetensors=False": "from transformers import AutoModel\nAutoModel.from_pretrained(p, use_safetensors=False)",
    "safe_serialization=False": "model.save_pretrained(folder, safe_serialization=False)",
    "an object collective": "import torch.distributed as dist\ndist.broadcast_object_list(box, src=0)",
    "another object collective": "from torch import distributed\ndistributed.all_gather_object(out, value)",
}

SAFE = {
    "torch.load weights_only=True": "import torch\ntorch.load(path, weights_only=True, map_location='cpu')",
    "torch.load aliased, weights_only=True": "import torch as t\nt.load(path, weights_only=True)",
    "torch.save": "import torch\ntorch.save(x, path)",
    "torch.compile": "import torch\ntorch.compile(f)",
    "model.eval()": "model.eval()\nrun.model.eval()",
    "a method named load": "ledger.load(path)\nself.load()",
    "a function of its own named eval": "def eval(x):\n    return x\neval(1)",
    "safetensors": "from safetensors.torch import load_file\nload_file(path)",
    "json": "import json\njson.loads(text)",
    "np.load": "import numpy as np\nnp.load(path)\nnp.load(path, allow_pickle=False)",
    "yaml.safe_load": "import yaml\nyaml.safe_load(text)",
    "yaml.load SafeLoader": "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)\nyaml.load(text, yaml.CSafeLoader)",
    "importlib of a module of its own": "import importlib\nimportlib.import_module('govtrain.privatizers.rules')",
    "trust_remote_code=False": "AutoTokenizer.from_pretrained(p, local_files_only=True, trust_remote_code=False)",
    "safe_serialization=True": "model.save_pretrained(folder, safe_serialization=True)",
    "re.compile": "import re\nre.compile('x')",
    "a string that names them": "text = 'torch.load(path) pickle eval exec'",
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_the_scanner_finds_each_unsafe_read(name: str):
    assert scan(UNSAFE[name]), f"the scanner missed {name}"


@pytest.mark.parametrize("name", sorted(SAFE))
def test_the_scanner_passes_the_safe_forms(name: str):
    assert scan(SAFE[name]) == []


def test_the_scanner_finds_a_use_added_to_a_real_module():
    """A real module of the scan, with one unsafe read added, is caught; as it is, it is not."""
    source = (ROOT / "govtrain/train/state_file.py").read_text()
    assert scan(source) == []
    assert scan(source + "\n\ndef _old(path):\n    import torch\n    return torch.load(path, weights_only=False)\n")
