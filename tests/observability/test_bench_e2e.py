"""Issue 7 acceptance: `pdserve bench` against `pdserve up` on the default model.

8 measured requests (plus warm-ups) run end to end; the JSON result has every
metric (TTFT, ITL, TPOT and e2e with mean/p50/p90/p95/p99/max, throughputs,
prefill and decode tokens/s, goodput, failures), and it agrees with the
gateway's own view of the same requests: the TTFT histogram count grew by exactly
the requests sent, the generated-token counter by exactly the tokens the bench
counted, and each measured request's gateway log line (found by the request id the
bench sends) has the bench's prompt and output token counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.hosts import free_port
from tests.observability.obs import json_payloads, scrape, value, wait_until

ROOT = Path(__file__).resolve().parents[2]
MEASURED = 8
WARMUP = 2
OUTPUT_LEN = 8
STAT_KEYS = ("count", "mean", "p50", "p90", "p95", "p99", "max")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PDSERVE_LOG_LEVEL="INFO")
    return env


@dataclass
class Up:
    url: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM `pdserve up` (it drains its workers, then the gateway); SIGKILL the group after 30 s."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                return self.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)  # the whole group: `up` and its children
        return self.popen.wait(5)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("obs-up") / "up.log"
    with open(log_path, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--prefill", "1", "--decode", "1",
             "--threads", "1", "--num-blocks", "256"],
            cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    u = Up(f"http://127.0.0.1:{port}", popen, log_path)
    try:
        wait_until(lambda: "pdserve ready at" in u.log() or popen.poll() is not None, "pdserve up ready", timeout=90)
        assert popen.poll() is None, f"pdserve up exited {popen.returncode}:\n{u.log()[-4000:]}"
    except BaseException:
        u.stop()
        raise
    yield u
    # SIGTERM of a healthy `pdserve up` drains its workers and exits 0.
    assert u.stop() == 0, u.log()[-4000:]


def run_bench(url: str, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pdserve", "bench", "--base-url", url, "--num-requests", str(MEASURED),
           "--warmup", str(WARMUP), "--concurrency", "4", "--input-len", "16", "--output-len", str(OUTPUT_LEN),
           "--slo", "ttft=30,tpot=5", "--no-progress", "--output-json", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    wall_s = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT" in proc.stdout and "goodput" in proc.stdout, proc.stdout
    result = dict(json.loads(out.read_text()))
    # The bench's measured duration is in seconds and lies inside the time it ran.
    duration_s = result["runs"][0]["summary"]["duration_s"]
    assert 0 < duration_s <= wall_s, (duration_s, wall_s)
    return result


def gateway_request_lines(up: Up) -> list[dict[str, Any]]:
    return [r for r in json_payloads(up.log()) if r.get("event") == "request"]


def test_bench_against_up_matches_gateway_metrics(up: Up, tmp_path: Path) -> None:
    before = scrape(f"{up.url}/metrics")
    seen_before = {r["request_id"] for r in gateway_request_lines(up)}
    result = run_bench(up.url, tmp_path / "bench.json")

    # Every metric is in the JSON.
    assert len(result["runs"]) == 1
    run = result["runs"][0]
    s = run["summary"]
    assert (s["num_requests"], s["completed"], s["failed"], s["cancelled"]) == (MEASURED, MEASURED, 0, 0), s
    assert s["failures"] == {}
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert set(STAT_KEYS) <= set(s[key]), (key, s[key])
        assert all(s[key][k] is not None for k in STAT_KEYS), (key, s[key])
        assert s[key]["mean"] >= 0 and s[key]["max"] >= s[key]["p99"] >= s[key]["p50"] >= 0, (key, s[key])
    assert s["ttft"]["count"] == s["e2e"]["count"] == s["tpot"]["count"] == MEASURED
    assert s["itl"]["count"] == MEASURED * (OUTPUT_LEN - 1)
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "prefill_throughput",
                "decode_throughput", "decode_rate_per_stream", "duration_s"):
        assert s[key] is not None and s[key] > 0, (key, s[key])
    assert s["prefill_rate_per_request"]["count"] == MEASURED
    assert s["goodput"]["requests_met"] == MEASURED and s["goodput"]["request_goodput"] > 0, s["goodput"]
    records = run["requests"]
    assert len(records) == MEASURED and all(r["ok"] for r in records)
    assert all(r["output_tokens"] == OUTPUT_LEN for r in records), [r["output_tokens"] for r in records]
    assert s["total_output_tokens"] == MEASURED * OUTPUT_LEN

    # The gateway saw exactly these requests plus the warm-ups, with the same token counts.
    def new_lines() -> list[dict[str, Any]] | None:
        lines = [r for r in gateway_request_lines(up) if r["request_id"] not in seen_before]
        return lines if len(lines) >= MEASURED + WARMUP else None

    lines = wait_until(new_lines, "the gateway's request log lines for the bench", timeout=10)
    assert len(lines) == MEASURED + WARMUP, lines
    assert all(r["status"] == 200 for r in lines), lines
    by_id = {r["request_id"]: r for r in lines}
    for rec in records:
        line = by_id.get(rec["request_id"])
        assert line is not None, (rec["request_id"], sorted(by_id))
        assert line["completion_tokens"] == rec["output_tokens"], (line, rec)
        assert line["prompt_tokens"] == rec["prompt_tokens"], (line, rec)
    warmups = [r for rid, r in by_id.items() if rid not in {rec["request_id"] for rec in records}]
    assert len(warmups) == WARMUP

    after = scrape(f"{up.url}/metrics")

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("llm_time_to_first_token_seconds_count") == MEASURED + WARMUP
    assert delta("llm_e2e_request_latency_seconds_count") == MEASURED + WARMUP
    warmup_tokens = sum(r["completion_tokens"] for r in warmups)
    assert delta("llm_generation_tokens_total") == s["total_output_tokens"] + warmup_tokens
    assert delta("llm_prompt_tokens_total") == s["total_prompt_tokens"] + sum(r["prompt_tokens"] for r in warmups)
