"""The house plan (docs/architecture.md): each package is one role, its imports only point
down, and no two modules import each other, directly or round a loop. Every import is
checked, function-local and `TYPE_CHECKING` ones included, so a lazy import cannot hide a
wrong-way edge or a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What `pip install .` puts at the top of site-packages (tests/deploy checks the wheel).
INSTALLED = ("pdserve", "kv_transfer", "prefill_node", "decode_node", "gateway")

# layer -> the project layers it may import (besides itself); the longest prefix names a module's layer.
MAY_IMPORT: dict[str, set[str]] = {
    "pdserve.common": set(),
    "pdserve.engine": {"pdserve.common"},
    "kv_transfer": {"pdserve.common"},
    "pdserve.worker": {"pdserve.engine", "kv_transfer", "pdserve.common"},
    "prefill_node": {"pdserve.worker", "pdserve.engine", "kv_transfer", "pdserve.common"},
    "decode_node": {"pdserve.worker", "pdserve.engine", "kv_transfer", "pdserve.common"},
    "gateway": {"pdserve.common"},
    "pdserve.builtin": {"pdserve.common"},
    "pdserve.loadgen": {"pdserve.builtin", "pdserve.common"},
    "pdserve.planner": {"pdserve.engine", "pdserve.builtin", "pdserve.common"},
    "pdserve.cli": {"pdserve.planner", "pdserve.loadgen", "pdserve.builtin", "gateway", "prefill_node",
                    "decode_node", "pdserve.worker", "pdserve.engine", "kv_transfer", "pdserve.common"},
    "pdserve": {"pdserve.cli"},
}
# third-party roots a layer must never import
NEVER: dict[str, set[str]] = {
    "gateway": {"torch", "numpy"},
    "pdserve.common": {"torch", "numpy"},
    "pdserve.engine.core": {"torch", "numpy", "safetensors"},  # block ids are bookkeeping
    "pdserve.loadgen": {"torch"},
}


def modules() -> dict[str, Path]:
    out = {}
    for top in INSTALLED:
        for f in sorted((ROOT / top).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = modules()


def imports_of(path: Path) -> set[str]:
    """Every module name an import in `path` binds: `from a.b import c` is `a.b.c` when that
    is a module, else `a.b`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; spell the package out")
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                      else node.module for a in node.names}
    return names


def layer_of(module: str) -> str | None:
    best = None
    for layer in MAY_IMPORT:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best or ""):
            best = layer
    return best


def project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def wrong_way() -> list[str]:
    bad = []
    for module, path in MODULES.items():
        own = layer_of(module)
        assert own is not None, f"{module} belongs to no layer: add it to MAY_IMPORT"
        for name in sorted(imports_of(path)):
            target = project_module(name)
            if target is not None:
                other = layer_of(target)
                if other != own and other not in MAY_IMPORT[own]:
                    bad.append(f"{module} ({own}) imports {target} ({other})")
            for scope, roots in NEVER.items():
                if (module == scope or module.startswith(scope + ".")) and name.split(".")[0] in roots:
                    bad.append(f"{module} imports {name}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on_stack.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {project_module(n) for n in imports_of(path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def test_every_installed_module_has_a_layer_and_imports_point_down() -> None:
    assert len(MODULES) > 200  # the walk found the packages
    assert wrong_way() == []


def test_no_import_cycles_lazy_or_not() -> None:
    assert cycles(import_graph()) == []


def test_the_checks_see_a_wrong_way_import_and_a_cycle(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from decode_node.node import DecodeNode\n    import torch.nn\n")
    assert imports_of(f) == {"decode_node.node", "torch.nn"}
    assert layer_of("pdserve.engine.core.scheduler") == "pdserve.engine"
    assert layer_of("pdserve.cli.up") == "pdserve.cli"
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("top", INSTALLED)
def test_installed_tops_are_packages(top: str) -> None:
    assert (ROOT / top / "__init__.py").exists(), top
