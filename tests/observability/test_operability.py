"""Operability details, without processes: JSON log records carry the request id,
worker gauges and labels, the KV address in the registry listing, and the flags
`pdserve up` forwards to its workers."""

from __future__ import annotations

import json
import logging

import pytest

from gateway.registry import WorkerRegistry
from pdserve.cli import build_parser
from pdserve.cli.up import _worker_cmds
from pdserve.common.logs import JsonFormatter, request_fields
from pdserve.common.protocol import RegisterWorker
from pdserve.common.transport import transport_kind
from pdserve.worker.metrics import WorkerMetrics


def _record(msg: str, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("prefill_node.node", logging.DEBUG, __file__, 1, msg, (), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_log_lines_carry_the_gateway_request_id() -> None:
    assert request_fields("req-1#2") == {"request_id": "req-1", "attempt": 2}
    line = json.loads(JsonFormatter().format(_record("prefill request req-1#2 accepted", **request_fields("req-1#2"))))
    assert line["request_id"] == "req-1" and line["attempt"] == 2 and line["level"] == "debug"
    assert line["message"] == "prefill request req-1#2 accepted"
    # A JSON message (the gateway's request line) is merged, not nested.
    merged = json.loads(JsonFormatter().format(_record('{"event": "request", "request_id": "r9"}')))
    assert merged["event"] == "request" and merged["request_id"] == "r9" and "message" not in merged


def test_transport_kind_names_the_kv_path() -> None:
    assert transport_kind("shm+tcp://127.0.0.1:5000") == "shm"
    assert transport_kind("cuda+tcp://10.0.0.1:5000") == "cuda_ipc"
    assert transport_kind("tcp://10.0.0.1:5000") == "tcp"
    assert transport_kind("ipc:///tmp/x.sock") == "ipc"
    assert transport_kind("") == ""


def test_worker_listing_shows_the_kv_address() -> None:
    r = WorkerRegistry(3.0)
    r.register(RegisterWorker("d1", "decode", "h", "shm+tcp://127.0.0.1:7000", "pdkv_1", "c", 10, 16, 0, 1), 0.0)
    r.register(RegisterWorker("p1", "prefill", "h", "", "", "c", 10, 16, 0, 2), 0.0)
    listed = {w["id"]: w for w in (w.describe(0.0) for w in r.all())}
    assert listed["d1"]["kv_address"] == "shm+tcp://127.0.0.1:7000" and listed["d1"]["kv_transport"] == "shm"
    assert listed["p1"]["kv_address"] == "" and listed["p1"]["kv_transport"] == ""


def test_worker_gauges_and_transfer_bytes_by_transport() -> None:
    m = WorkerMetrics("prefill", "p1")
    m.queued_prefill_tokens.set(42)
    m.running_seqs.set(3)
    m.add_transfer_bytes("shm", 100)
    m.add_transfer_bytes("tcp", 7)
    assert m.gauges()["llm_prefill_queued_tokens"] == 42 and m.gauges()["llm_num_running_seqs"] == 3
    text = m.render().decode()
    assert 'llm_kv_transfer_bytes_total{role="prefill",transport="shm",worker="p1"} 100.0' in text
    assert 'llm_kv_transfer_bytes_total{role="prefill",transport="tcp",worker="p1"} 7.0' in text
    assert "llm_prefill_queued_tokens" not in WorkerMetrics("decode", "d1").gauges()


def test_up_forwards_engine_flags_and_workers_take_a_kv_port() -> None:
    args = build_parser().parse_args(
        ["up", "--no-prefix-caching", "--max-num-batched-tokens", "512", "--num-blocks", "64",
         "--kv-cache-memory", "64MiB", "--max-num-seqs", "8", "--long-prefill-token-threshold", "256"]
    )
    cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
    assert len(cmds) == 2
    for cmd in cmds:
        assert "--no-prefix-caching" in cmd
        assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "512"
        assert cmd[cmd.index("--num-blocks") + 1] == "64"
        assert cmd[cmd.index("--kv-cache-memory") + 1] == "64MiB"
        assert cmd[cmd.index("--max-num-seqs") + 1] == "8"
        assert cmd[cmd.index("--long-prefill-token-threshold") + 1] == "256"
        parsed = build_parser().parse_args(cmd[3:])  # the worker parser accepts them
        assert parsed.no_prefix_caching and parsed.max_num_batched_tokens == 512
        assert parsed.long_prefill_token_threshold == 256
    plain = _worker_cmds(build_parser().parse_args(["up"]), "tcp://127.0.0.1:5555")
    assert all("--no-prefix-caching" not in c and "--max-num-batched-tokens" not in c for c in plain)
    decode = build_parser().parse_args(["decode", "--gateway", "tcp://127.0.0.1:5555", "--kv-port", "7100"])
    assert decode.kv_port == 7100


def test_up_lets_openmp_spin_only_when_the_worker_threads_fit_the_cores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    # up counts the cores this process may run on, not the host's
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})

    def spins(*argv: str) -> list[bool]:
        cmds = _worker_cmds(build_parser().parse_args(["up", *argv]), "tcp://127.0.0.1:5555")
        return ["--spin-wait" in c for c in cmds]

    assert spins() == [True, True]  # 2 workers x 2 threads on 4 cores
    assert spins("--threads", "3") == [False, False]  # 6 threads on 4 cores: passive waiting
    assert spins("--prefill-threads", "3", "--decode-threads", "1") == [True, True]
    assert spins("--colocated", "--workers", "1", "--threads", "4") == [True]
    cmds = _worker_cmds(build_parser().parse_args(["up", "--prefill-threads", "3"]), "tcp://x:1")
    assert [c[c.index("--threads") + 1] for c in cmds] == ["3", "2"]


def test_prefill_workers_may_get_their_own_kv_pool() -> None:
    def blocks(*argv: str) -> list[str | None]:
        cmds = _worker_cmds(build_parser().parse_args(["up", "--prefill", "2", *argv]), "tcp://x:1")
        return [c[c.index("--num-blocks") + 1] if "--num-blocks" in c else None for c in cmds]

    assert blocks("--num-blocks", "500", "--prefill-num-blocks", "100") == ["100", "100", "500"]
    assert blocks("--prefill-num-blocks", "100") == ["100", "100", None]
    assert blocks("--num-blocks", "500") == ["500", "500", "500"]


def test_kv_receiver_binds_a_fixed_port() -> None:
    from kv_transfer.receiver.receiver import ZmqReceiver
    from pdserve.common.hosts import free_port
    from tests.kv_transfer.harness import TINY, random_pool

    port = free_port()
    with ZmqReceiver(TINY, random_pool(TINY, 4, seed=0), transport="tcp", port=port) as receiver:
        assert receiver.address == f"tcp://127.0.0.1:{port}"


def test_up_gives_the_prefill_worker_the_draft_only_when_it_ships_its_kv() -> None:
    def spec_of(draft_kv: str) -> list[str | None]:
        text = json.dumps({"method": "draft_model", "model": "/d", "num_speculative_tokens": 3, "draft_kv": draft_kv})
        cmds = _worker_cmds(build_parser().parse_args(["up", "--speculative-config", text]), "tcp://x:1")
        return [c[c.index("--speculative-config") + 1] if "--speculative-config" in c else None for c in cmds]

    pre, dec = spec_of("prefill")
    assert pre == dec and pre is not None and json.loads(pre)["draft_kv"] == "prefill"
    assert spec_of("decode")[0] is None  # the decode worker prefills the draft: prefill needs none


def test_up_passes_the_traces_endpoint_to_the_gateway_and_every_worker() -> None:
    from pdserve.cli.up import _gateway_cmd

    url = "http://collector:4318/v1/traces"
    args = build_parser().parse_args(["up", "--prefill", "2", "--otlp-traces-endpoint", url])
    for cmd in [_gateway_cmd(args, 5555), *_worker_cmds(args, "tcp://127.0.0.1:5555")]:
        assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == url
        assert build_parser().parse_args(cmd[3:]).otlp_traces_endpoint == url  # each child parses it
    plain = build_parser().parse_args(["up"])
    assert all("--otlp-traces-endpoint" not in c for c in [_gateway_cmd(plain, 1), *_worker_cmds(plain, "tcp://x:1")])


def test_up_refuses_a_bad_otel_variable_before_starting_anything() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root), "OTEL_TRACES_SAMPLER": "sometimes",
           "PDSERVE_HOME": str(Path.home() / ".cache" / "pdserve")}
    done = subprocess.run([sys.executable, "-m", "pdserve", "up", "--otlp-traces-endpoint", "http://c:4317"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-1000:]
    assert "--otlp-traces-endpoint" in done.stderr and "OTEL_TRACES_SAMPLER" in done.stderr
