"""The house plan (docs/architecture.md): each top-level package is one role and its
imports only point down. Every import in the package is checked, function-local ones
included, so a lazy import cannot hide a wrong-way edge."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"common", "engine", "kv_transfer", "worker", "prefill_node", "decode_node", "gateway",
           "pdserve", "bench"}

# package -> project packages (and third-party roots) it must never import
FORBIDDEN: dict[str, set[str]] = {
    "common": PROJECT - {"common"},
    "engine": {"kv_transfer", "worker", "prefill_node", "decode_node", "gateway", "pdserve", "bench"},
    "kv_transfer": {"engine", "worker", "prefill_node", "decode_node", "gateway", "pdserve", "bench"},
    "worker": {"prefill_node", "decode_node", "gateway", "pdserve", "bench"},
    "prefill_node": {"decode_node", "gateway", "pdserve", "bench"},
    "decode_node": {"prefill_node", "gateway", "pdserve", "bench"},
    "gateway": {"torch", "engine", "kv_transfer", "worker", "prefill_node", "decode_node", "pdserve", "bench"},
}


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level:
            raise AssertionError(f"{path}: relative import; spell the package out")
    return roots


def wrong_way(package: str) -> list[str]:
    bad = []
    for f in sorted((ROOT / package).rglob("*.py")):
        hits = imported_roots(f) & FORBIDDEN[package]
        bad += [f"{f.relative_to(ROOT)} imports {h}" for h in sorted(hits)]
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package: str) -> None:
    assert (ROOT / package / "__init__.py").exists(), package
    assert wrong_way(package) == []


def test_the_checker_sees_a_wrong_way_import(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from decode_node.node import DecodeNode\n    import torch.nn\n")
    assert imported_roots(f) == {"decode_node", "torch"}
