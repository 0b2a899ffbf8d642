"""`pdserve bench` end to end against the fake server: table, JSON, PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.loadgen.metrics import LEGEND
from tests.bench.fake_openai import FakeOpenAIServer

SUMMARY_KEYS = {
    "num_requests",
    "completed",
    "failed",
    "cancelled",
    "failures",
    "duration_s",
    "total_prompt_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "prefill_throughput",
    "prefill_rate_per_request",
    "decode_throughput",
    "decode_rate_per_stream",
    "ttft",
    "tpot",
    "itl",
    "e2e",
    "goodput",
}
STAT_KEYS = {"count", "mean", "p50", "p90", "p95", "p99", "max"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_cli_sweep_writes_table_json_png(
    fake_server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.01, 0.005
    fake_server.behaviour.api_key = "k"  # the key comes from a file, not the command line
    (tmp_path / "key").write_text("# bench key\nk\n")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "bench",
            "--base-url", fake_server.url,
            "--sweep", "1,2",
            "--num-requests", "3",
            "--warmup", "1",
            "--input-len", "8",
            "--output-len", "4",
            "--slo", "ttft=1,tpot=1",
            "--api-key-file", str(tmp_path / "key"),
            "--output-json", str(out_json),
            "--output-png", str(out_png),
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    assert "TTFT" in captured.out and "ITL" in captured.out and "metrics:" in captured.out
    assert "tpot: time per output token" in captured.out  # formulas printed
    assert "[" in captured.err and "req" in captured.err  # progress bar on stderr
    data = json.loads(out_json.read_text())
    assert data["legend"] == LEGEND and data["model"] == "fake-model"
    assert data["config"]["load"]["sweep"] == [1, 2]
    assert data["config"]["endpoint"]["api_key"] == "***"
    assert len(data["runs"]) == 2
    for run in data["runs"]:
        s = run["summary"]
        assert set(s) >= SUMMARY_KEYS
        for key in ("ttft", "tpot", "itl", "e2e", "prefill_rate_per_request"):
            assert set(s[key]) == STAT_KEYS and s[key]["p50"] is not None
        assert s["goodput"]["requests_met"] == 3
        assert len(run["requests"]) == 3
        req = run["requests"][0]
        assert req["ok"] and len(req["chunk_times"]) == 4 and req["completion_tokens"] == 4
    png = out_png.read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_cli_single_run_png_and_bad_args(
    fake_server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.behaviour.ttft_s = fake_server.behaviour.itl_s = 0.005
    png = tmp_path / "one.png"
    args = ["bench", "--base-url", fake_server.url, "--num-requests", "2", "--output-len", "3"]
    assert main([*args, "--no-progress", "--output-png", str(png)]) == 0
    assert png.read_bytes().startswith(PNG_MAGIC)
    fake_server.requests.clear()
    assert main([*args, "--no-progress", "--models", "a0,a1"]) == 0
    assert sorted(r["model"] for r in fake_server.requests) == ["a0", "a1"]
    assert main([*args, "--slo", "speed=3"]) == 2
    assert main([*args, "--workload", "dataset"]) == 2
    assert "needs --dataset" in capsys.readouterr().err


def test_cli_unreachable_endpoint_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress"]) == 2
    assert "v1/models" in capsys.readouterr().err


def test_cli_prints_the_servers_mean_acceptance_length(
    fake_server: FakeOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_server.behaviour.ttft_s = fake_server.behaviour.itl_s = 0.005
    fake_server.behaviour.spec_per_request = (4, 12, 6)  # 1 + 6/4 tokens per verifying forward
    out_json = tmp_path / "spec.json"
    args = ["bench", "--base-url", fake_server.url, "--num-requests", "3", "--output-len", "3", "--warmup", "1"]
    assert main([*args, "--no-progress", "--output-json", str(out_json)]) == 0
    assert "mean acceptance length 2.50   18/36 draft tokens accepted (50%) over 12 drafts" in capsys.readouterr().out
    spec = json.loads(out_json.read_text())["runs"][0]["summary"]["spec_decode"]
    assert spec == {"drafts": 12.0, "draft_tokens": 36.0, "accepted_tokens": 18.0,
                    "mean_acceptance_length": 2.5, "acceptance_rate": 0.5}
    fake_server.behaviour.spec_per_request = None
    assert main([*args, "--no-progress"]) == 0
    assert "acceptance" not in capsys.readouterr().out  # a server without the counters
