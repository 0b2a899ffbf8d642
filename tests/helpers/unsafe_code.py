"""An ast scan for code that could turn received bytes into objects or running code:
pickle and its relatives, unsafe loaders (torch.load, numpy with allow_pickle,
yaml without a safe Loader), and eval/exec. Imports are followed through
aliases (`import pickle as p`, `from numpy import load as l`), so renaming a
module or function does not hide a call.
"""

from __future__ import annotations

import ast
from typing import NamedTuple

# Modules whose only purpose is (un)pickling or loading code objects: importing one is a finding.
UNSAFE_MODULES = frozenset({
    "pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "jsonpickle",
})
# Calls that unpickle or run code whatever their arguments.
UNSAFE_CALLS = frozenset({
    "torch.load", "eval", "exec", "builtins.eval", "builtins.exec", "pandas.read_pickle",
    "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
})
# Methods that unpickle whatever object they are called on (pyzmq's socket helpers).
UNSAFE_METHODS = frozenset({"recv_pyobj", "send_pyobj", "read_pickle"})
SAFE_YAML_LOADERS = frozenset({"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader"})
DYNAMIC_IMPORTS = frozenset({"__import__", "importlib.import_module"})


class Finding(NamedTuple):
    line: int
    what: str


def unsafe_uses(source: str, filename: str = "<snippet>") -> list[Finding]:
    """Every unsafe import or call in `source`, in line order."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)
    found: list[Finding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Finding(node.lineno, f"import {a.name}") for a in node.names if _unsafe_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _unsafe_module(node.module or ""):
            found.append(Finding(node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call):
            what = _unsafe_call(node, aliases)
            if what:
                found.append(Finding(node.lineno, what))
    return sorted(found)


def _unsafe_module(name: str) -> bool:
    return name.split(".")[0] in UNSAFE_MODULES


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the qualified name it was imported as, from every import in the module."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    root = a.name.split(".")[0]
                    names[root] = root
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _qualname(expr: ast.expr, aliases: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return aliases.get(expr.id, expr.id)
    if isinstance(expr, ast.Attribute):
        base = _qualname(expr.value, aliases)
        return f"{base}.{expr.attr}" if base else None
    return None


def _argument(call: ast.Call, keyword: str, position: int) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == keyword:
            return kw.value
    return call.args[position] if len(call.args) > position else None


def _unsafe_call(call: ast.Call, aliases: dict[str, str]) -> str | None:
    if isinstance(call.func, ast.Attribute) and call.func.attr in UNSAFE_METHODS:
        return f"{call.func.attr}() unpickles"
    name = _qualname(call.func, aliases)
    if name is None:
        return None
    if name in UNSAFE_CALLS:
        return f"{name}()"
    if name in DYNAMIC_IMPORTS and call.args:
        target = call.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str) and _unsafe_module(target.value):
            return f"{name}({target.value!r})"
    if name == "numpy.load":
        allow = _argument(call, "allow_pickle", 2)
        if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
            return "numpy.load(allow_pickle=...) unpickles"
    if name in ("yaml.load", "yaml.load_all"):
        loader = _argument(call, "Loader", 1)
        if loader is None or _qualname(loader, aliases) not in SAFE_YAML_LOADERS:
            return f"{name}() without a safe Loader"
    return None
