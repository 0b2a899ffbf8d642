"""bench/gpu_check.sh on CPU: it parses, its phase driver (GPU_CHECK_DRY_RUN=1) invokes every
phase in order, records each, goes on after a failure and keeps the serving run's time; and
bench/gpu_summary.py sets a run's figures beside the targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_summary import junit_counts, read_phases, summarize

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"
PHASES = ["wheels", "native", "env", "gpu_tests", "hf_equiv", "kv", "attention", "serve"]
# What each phase runs, as its command line shows it.
COMMANDS = {"wheels": "pip install -q --no-index", "native": "setup.py -q build_ext",
            "env": "-m bench.gpu_env", "gpu_tests": "tests/engine/test_triton_attention.py",
            "hf_equiv": "tests/engine/test_hf_equivalence.py",
            "kv": "--transports cuda cuda-tcp", "attention": "--batch 64 --context 4096",
            "serve": "-m bench.gpu_serve --shape llama3-8b"}


def _dry_run(tmp_path: Path, wheels: bool = True, **env: str) -> tuple[int, str, dict]:
    wheel_dir = tmp_path / "whl"
    wheel_dir.mkdir()
    if wheels:
        (wheel_dir / "pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl").write_bytes(b"")
    out = tmp_path / "out"
    full_env = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable,
                "GPU_CHECK_WHEELS": str(wheel_dir), **env}
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=full_env, capture_output=True,
                          text=True, timeout=120)
    log = (out / "gpu_check.log").read_text()
    assert proc.stdout == log  # everything printed is in $OUT too
    return proc.returncode, log, json.loads((out / "summary.json").read_text())


def test_scripts_parse() -> None:
    for name in ("gpu_check.sh", "prep_gpu_wheels.sh"):
        proc = subprocess.run(["bash", "-n", str(REPO / "bench" / name)], capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr


def test_every_phase_runs_in_order_and_a_failure_does_not_stop_the_next(tmp_path: Path) -> None:
    rc, log, summary = _dry_run(tmp_path, GPU_CHECK_DRY_FAIL="wheels kv")
    assert rc == 1 and summary["ok"] is False
    phases = {p["name"]: p for p in summary["phases"]}
    assert [p["name"] for p in summary["phases"]] == PHASES
    assert {n: p["status"] for n, p in phases.items()} == {
        n: "failed" if n in ("wheels", "kv") else "ok" for n in PHASES}
    assert phases["kv"]["exit_code"] == 3
    starts = [log.index(f"== {n} (at ") for n in PHASES]
    assert starts == sorted(starts)
    for name, command in COMMANDS.items():
        line = next(s for s in log.splitlines() if s.startswith(f"== {name} (at "))
        assert command in line, line
    # Nothing was measured: every target is there, unmeasured.
    assert len(summary["targets"]) == 6
    assert all(t["value"] is None and t["met"] is None for t in summary["targets"])


def test_clean_dry_run_exits_0_and_missing_wheels_are_a_skip(tmp_path: Path) -> None:
    rc, log, summary = _dry_run(tmp_path, wheels=False)
    assert rc == 0 and summary["ok"] is True, log
    statuses = {p["name"]: p["status"] for p in summary["phases"]}
    assert statuses == {n: "skipped" if n == "wheels" else "ok" for n in PHASES}
    assert "prep_gpu_wheels.sh" in summary["phases"][0]["note"]


def test_a_short_budget_keeps_the_serving_run_its_time(tmp_path: Path) -> None:
    # 100 s: 30 for the summary leaves 70, under the 270 the phases before `serve` must
    # leave it, so none of them starts and `serve` gets the 70.
    rc, _, summary = _dry_run(tmp_path, GPU_CHECK_BUDGET_S="100")
    phases = {p["name"]: p for p in summary["phases"]}
    assert rc == 1
    assert all(phases[n]["status"] == "no_time" for n in PHASES[:-1])
    assert phases["serve"]["status"] == "ok" and 60 <= phases["serve"]["limit_s"] <= 70


def _write_run(work: Path) -> None:
    (work / "kv.json").write_text(json.dumps({"rows": [
        {"transport": "cuda", "ratio": 0.62, "gbps": 900.0},
        {"transport": "cuda-tcp", "error": "RuntimeError('refused')"}]}))
    (work / "attention.json").write_text(json.dumps({"result": {"speedup": 2.5}}))
    (work / "serve.json").write_text(json.dumps({
        "prefill": {"fraction_of_peak": 0.45},
        "decode": [{"batch": 1, "tokens_per_s": 220.0, "fraction": 0.69},
                   {"batch": 32, "tokens_per_s": 5100.0, "fraction": 0.5}]}))
    (work / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="30" failures="1" errors="0" skipped="13"/></testsuites>')


def test_summary_sets_the_figures_beside_the_targets(tmp_path: Path) -> None:
    _write_run(tmp_path)
    phases = tmp_path / "phases.tsv"
    phases.write_text("env\tok\t0\t12\t60\t\nserve\ttimeout\t124\t300\t300\t\n"
                      "hf_equiv\tskipped\t-\t0\t0\tno transformers\n")
    s = summarize(read_phases(phases), tmp_path)
    assert s["ok"] is False  # the timeout
    assert [p["exit_code"] for p in s["phases"]] == [0, 124, None]
    got = {t["name"]: (t["value"], t["met"]) for t in s["targets"]}
    assert got == {
        "decode batch 1, fraction of the HBM roofline": (0.69, False),
        "decode batch 1, tok/s": (220.0, True),
        "decode batch 32, tok/s": (5100.0, True),
        "prefill at 2,048 tokens, fraction of bf16 peak": (0.45, True),
        "CUDA IPC KV transfer, fraction of device memcpy": (0.62, True),
        "Triton decode attention speed-up over gather + SDPA": (2.5, False),
    }
    assert s["tests"] == {"gpu_tests": {"tests": 30, "failures": 1, "errors": 0, "skipped": 13},
                          "hf_equiv": None}
    assert s["env"] is None


@pytest.mark.parametrize("text", ["", "<testsuites>"])
def test_unreadable_junit_is_none(tmp_path: Path, text: str) -> None:
    (tmp_path / "t.xml").write_text(text)
    assert junit_counts(tmp_path / "t.xml") is None
