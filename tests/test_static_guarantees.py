"""Whole-codebase guarantees that are checked by reading the code or importing it.

- Nothing on an internal socket is ever unpickled: no pickle, recv_pyobj or
  torch.load anywhere in the shipped packages.
- The gateway never imports torch (it runs on CPU-only front-end hosts).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "common", "worker", "engine", "kv_transfer", "prefill_node", "decode_node", "gateway", "bench")
FORBIDDEN = re.compile(r"\b(import pickle|from pickle|cPickle|recv_pyobj|send_pyobj|torch\.load|pickle\.loads)\b")


def _python_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def test_no_unpickling_anywhere() -> None:
    files = _python_files()
    assert len(files) > 10, "expected to scan the real packages"
    offenders = [
        f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert offenders == []


def test_gateway_never_imports_torch() -> None:
    code = (
        "import sys, gateway.server, gateway.tokenizer, gateway.detokenizer, common.protocol;"
        "import gateway.cluster;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_forbidden_pattern_catches_pickle() -> None:
    # The scanner itself must fire on the patterns it exists to catch.
    for bad in ("import pickle", "sock.recv_pyobj()", "torch.load(buf)"):
        assert FORBIDDEN.search(bad)
