"""What bench/gpu_check.sh's test phases depend on, checked on CPU: every GPU test file is in
the `gpu_tests` (or `hf_equiv`) phase, and the GPU files collect on a machine without
pytest-timeout (the GPU machine has pytest only; `--strict-markers` turns an unregistered
`timeout` mark into a collection error that would run none of the phase's tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
BUILTIN_MARKS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}


def _test_files() -> list[Path]:
    return sorted((REPO / "tests").rglob("test_*.py"))


def _gpu_files() -> list[str]:
    return [str(p.relative_to(REPO)) for p in _test_files()
            if p != Path(__file__).resolve() and "pytest.mark.gpu" in p.read_text()]


def test_every_mark_the_tests_use_is_registered() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0].strip() for m in config["markers"]}
    used = {m for p in _test_files() for m in re.findall(r"pytest\.mark\.(\w+)", p.read_text())}
    assert used - BUILTIN_MARKS - registered == set()


def test_gpu_check_runs_every_file_with_gpu_tests() -> None:
    script = (REPO / "bench" / "gpu_check.sh").read_text()
    files = _gpu_files()
    assert "tests/engine/test_cuda_graphs.py" in files  # the scan sees the marks
    assert [f for f in files if f not in script] == []


def test_gpu_files_collect_without_pytest_timeout() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:timeout", "-p", "no:cacheprovider",
         "--collect-only", "-q", "-m", "gpu", "tests/kv_transfer/test_cuda_ipc.py"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 5), proc.stdout[-2000:]  # 5: all deselected, none errored
    assert "error" not in proc.stdout.lower(), proc.stdout[-2000:]
