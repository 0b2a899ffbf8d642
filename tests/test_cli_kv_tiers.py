"""The KV tier flags: `up` passes them to every worker (prefill, decode, colocated),
a worker builds the config they name, and contradictory ones are refused in one line
by a real `python -m pdserve` process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.cli.kv_tier_args import tier_config
from pdserve.cli.up import _worker_cmds

ROOT = Path(__file__).resolve().parents[1]
GW = "tcp://127.0.0.1:5"
TIERS = ["--kv-offload-memory", "1GiB", "--kv-offload-memory-dir", "/dev/shm/x", "--kv-offload-dir", "/tmp/kv",
         "--kv-offload-disk", "2GiB", "--kv-remote-url", "redis://127.0.0.1:6379/0"]


@pytest.mark.parametrize("layout", [[], ["--colocated", "--workers", "2"]])
def test_up_passes_the_tier_flags_to_every_worker(layout: list[str]) -> None:
    args = build_parser().parse_args(["up", *TIERS, *layout])
    cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
    assert {c[3] for c in cmds} == ({"worker"} if layout else {"prefill", "decode"})
    for cmd in cmds:
        cfg = tier_config(build_parser().parse_args(cmd[3:]))
        assert cfg is not None
        assert (cfg.memory_bytes, cfg.memory_dir, cfg.disk_dir, cfg.disk_bytes, cfg.remote_url) == (
            1 << 30, "/dev/shm/x", "/tmp/kv", 2 << 30, "redis://127.0.0.1:6379/0")
    plain = build_parser().parse_args(["up"])
    assert all(not any(a.startswith("--kv-offload") for a in c) for c in _worker_cmds(plain, "tcp://x:1"))
    assert tier_config(build_parser().parse_args(["worker", "--colocated", "--gateway", GW])) is None


@pytest.mark.parametrize(("argv", "flag"), [
    (["worker", "--colocated", "--gateway", GW, "--kv-offload-disk", "1GiB"], "--kv-offload-disk"),
    (["worker", "--colocated", "--gateway", GW, "--kv-offload-memory-dir", "/dev/shm/x"], "--kv-offload-memory-dir"),
    (["worker", "--colocated", "--gateway", GW, "--kv-remote-url", "http://x"], "--kv-remote-url"),
    (["up", "--kv-offload-memory", "lots"], "--kv-offload-memory"),
])
def test_contradictory_tier_flags_are_refused_in_one_line(argv: list[str], flag: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "Traceback" not in proc.stderr
