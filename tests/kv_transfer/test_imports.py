"""kv_transfer's dependency rules: torch only in tensor_adapter, cupy only in cuda_ipc."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "kv_transfer"
ALLOWED = {"torch": "tensor_adapter.py", "cupy": "cuda_ipc.py"}


def test_heavy_imports_stay_in_their_modules() -> None:
    for name, home in ALLOWED.items():
        pattern = re.compile(rf"^\s*(import|from)\s+{name}\b", re.M)
        users = sorted(p.name for p in PKG.glob("*.py") if pattern.search(p.read_text()))
        assert users in ([], [home]), f"{name} imported by {users}"


def test_importing_kv_transfer_loads_neither_torch_nor_cupy() -> None:
    code = ("import sys, kv_transfer, kv_transfer.pool.cuda_ipc, kv_transfer.receiver.receiver;"
            "print('torch' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parent, check=True)
    assert out.stdout.split() == ["False", "False"]
