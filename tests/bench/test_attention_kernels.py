"""bench/attention_kernels.py on CPU (Triton interpreted, tiny shape): the path the GPU check
times at batch 64 x 4k, with the two backends agreeing and the figures derived as stated."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.attention_kernels import AttentionBench

# Looked up, not imported: triton imported in this process before TRITON_INTERPRET is set
# would run tests/engine/test_triton_attention.py's kernels half interpreted.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install '.[test]')")

REPO = Path(__file__).resolve().parents[2]

TINY = ["--device", "cpu", "--dtype", "float32", "--batch", "2", "--context", "37", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "16", "--warmup", "0", "--iters", "1"]


def test_kv_bytes_per_step_of_the_gpu_case() -> None:
    # 64 sequences x 4,096 tokens x K and V x 8 heads x 128 dims x 2 bytes: 1 GiB a layer.
    assert AttentionBench().kv_bytes_per_step == 2**30


def test_cpu_run_agrees_and_reports(tmp_path: Path) -> None:
    # A process of its own: TRITON_INTERPRET counts when the kernels are defined, and this
    # one may have defined them already.
    out = tmp_path / "attention.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # CPU tensors: the kernels interpreted
    proc = subprocess.run([sys.executable, "-m", "bench.attention_kernels", *TINY, "--output-json",
                           str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "gather + SDPA" in proc.stdout
    got = json.loads(out.read_text())
    cfg, r = AttentionBench(**got["config"]), got["result"]
    assert (cfg.batch, cfg.context, cfg.device) == (2, 37, "cpu")
    assert r["max_abs_diff"] < 1e-4  # the Triton and gather + SDPA outputs agree
    assert r["triton_s"] > 0 and r["torch_s"] > 0
    assert r["speedup"] == pytest.approx(r["torch_s"] / r["triton_s"])
    assert r["triton_kv_gbps"] == pytest.approx(cfg.kv_bytes_per_step / r["triton_s"] / 1e9)
