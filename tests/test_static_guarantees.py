"""Whole-codebase guarantees that are checked by reading the code or importing it.

- Nothing on an internal socket is ever unpickled, and no received bytes are
  ever run: no pickle or its relatives (marshal, shelve, dill, cloudpickle),
  recv_pyobj, torch.load, numpy.load with allow_pickle, yaml without a safe
  Loader, eval or exec anywhere in the shipped packages (an ast scan that
  follows import aliases, see tests/helpers/unsafe_code.py).
- The gateway never imports torch (it runs on CPU-only front-end hosts).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.unsafe_code import unsafe_uses

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "common", "worker", "engine", "kv_transfer", "prefill_node", "decode_node", "gateway", "bench")


def _python_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]


def test_no_unpickling_anywhere() -> None:
    files = _python_files()
    assert len(files) > 10, "expected to scan the real packages"
    offenders = [
        f"{p.relative_to(ROOT)}:{f.line}: {f.what}"
        for p in files
        for f in unsafe_uses(p.read_text(), str(p))
    ]
    assert offenders == []


def test_gateway_never_imports_torch() -> None:
    code = (
        "import sys, gateway.server, gateway.tokenizer, gateway.detokenizer, pdserve.common.protocol;"
        "import gateway.cluster;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


UNSAFE_SNIPPETS = [
    "import pickle",
    "import pickle as p\np.loads(b)",
    "from pickle import loads as x\nx(b)",
    "import cPickle",
    "from _pickle import loads",
    "import marshal\nmarshal.loads(b)",
    "from marshal import loads as m",
    "import shelve\nshelve.open(path)",
    "import dill",
    "import cloudpickle as cp",
    "sock.recv_pyobj()",
    "sock.send_pyobj(x)",
    "import torch\ntorch.load(buf)",
    "import torch as t\nt.load(buf)",
    "from torch import load as tl\ntl(buf)",
    "import numpy as np\nnp.load(f, allow_pickle=True)",
    "from numpy import load as l\nl(f, allow_pickle=flag)",
    "import numpy\nnumpy.load(f, None, True)",
    "import yaml\nyaml.load(s)",
    "import yaml\nyaml.load(s, Loader=yaml.Loader)",
    "import yaml as y\ny.unsafe_load(s)",
    "from yaml import load, FullLoader\nload(s, FullLoader)",
    "eval(msg.payload)",
    "exec(frame.decode())",
    "import builtins\nbuiltins.eval(x)",
    "__import__('pickle')",
    "import importlib\nimportlib.import_module('cloudpickle')",
]
SAFE_SNIPPETS = [
    "import numpy as np\nnp.load(f)\nnp.load(f, allow_pickle=False)",
    "import yaml\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)",
    "from yaml import CSafeLoader, load\nload(s, CSafeLoader)",
    "model.eval()\nself.exec_plan()",
    "import json, msgpack\njson.loads(b)\nmsgpack.unpackb(b, strict_map_key=True)",
    "import picklesque",
]


@pytest.mark.parametrize("snippet", UNSAFE_SNIPPETS)
def test_unsafe_scan_flags(snippet: str) -> None:
    # The scanner itself must fire on every pattern it exists to catch ...
    assert unsafe_uses(snippet), snippet


@pytest.mark.parametrize("snippet", SAFE_SNIPPETS)
def test_unsafe_scan_passes_safe_code(snippet: str) -> None:
    # ... and stay quiet on safe look-alikes, or the real scan would cry wolf.
    assert unsafe_uses(snippet) == []
