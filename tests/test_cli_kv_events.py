"""`--kv-events-config`: `up` hands every worker vLLM's JSON with its own port (worker i:
port + i), a worker reads it back, and an endpoint off loopback is refused in one line by
a real `python -m pdserve` process unless the worker has `--insecure` (`up` has none)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import build_parser
from pdserve.cli.args import UsageError
from pdserve.cli.curve_options import check_kv_events_exposure
from pdserve.cli.up import _worker_cmds

ROOT = Path(__file__).resolve().parents[1]
GW = "tcp://127.0.0.1:5"
EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:6100", "replay_endpoint": "tcp://127.0.0.1:6200", "topic": "kv"}'


@pytest.mark.parametrize("layout", [[], ["--colocated", "--workers", "3"]])
def test_up_gives_each_worker_the_config_with_its_own_ports(layout: list[str]) -> None:
    args = build_parser().parse_args(["up", "--kv-events-config", EVENTS, *layout])
    cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
    assert len(cmds) == (3 if layout else 2)
    for i, cmd in enumerate(cmds):
        cfg = build_parser().parse_args(cmd[3:]).kv_events_config
        assert cfg is not None and cfg.enabled and cfg.topic == "kv"
        assert (cfg.endpoint, cfg.replay_endpoint) == (f"tcp://127.0.0.1:{6100 + i}", f"tcp://127.0.0.1:{6200 + i}")
    plain = build_parser().parse_args(["up"])
    assert all("--kv-events-config" not in c for c in _worker_cmds(plain, "tcp://x:1"))


def test_insecure_lets_a_worker_publish_off_loopback() -> None:
    argv = ["worker", "--colocated", "--gateway", GW, "--kv-events-config",
            '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}']
    check_kv_events_exposure(build_parser().parse_args([*argv, "--insecure"]))  # no refusal
    with pytest.raises(UsageError, match="not loopback"):
        check_kv_events_exposure(build_parser().parse_args(argv))


@pytest.mark.parametrize(("argv", "says"), [
    (["worker", "--colocated", "--gateway", GW, "--kv-events-config",
      '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'], "not loopback"),
    (["prefill", "--gateway", GW, "--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'],
     "hwm must be at least 1"),
    (["up", "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://10.0.0.5:5557"}'],
     "loopback or ipc only"),
    (["up", "--kv-events-config", '{"enable_kv_cache_events": true, "port": 1}'], "unknown key"),
])
def test_bad_or_exposed_event_configs_are_refused_in_one_line(argv: list[str], says: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kv-events-config" in lines[0] and says in lines[0], proc.stderr
