"""The soak verdict (bench/soak_verdict.py) on synthetic samples, its traffic
against the fake OpenAI server, its twin check against the real engine, and one
very short real soak (a killed and a hung decode worker, sampled traffic)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.harness import model_dir
from bench.soak import parse_args
from bench.soak_traffic import PENALTIES, SAMPLED_TEMPERATURE, Completed, Traffic
from bench.soak_twins import ReferenceTwins, check_twins, recovered_ids, twin_params
from bench.soak_verdict import (
    MIB,
    ErrorEvent,
    HungWorker,
    ProcSample,
    TwinCheck,
    error_code,
    is_explained,
    judge,
)
from gateway.cluster import assigned_seed
from tests.bench.fake_openai import FakeOpenAIServer

START = {
    "gateway": ProcSample(200 * MIB, 40),
    "prefill1": ProcSample(900 * MIB, 60),
    "decode2": ProcSample(900 * MIB, 60),
    "decode3": ProcSample(900 * MIB, 60),
}
KV_IDLE = {"prefill1": 0.0, "decode3": 0.0, "decode4": 0.0}
ALIVE = {"gateway": True, "prefill1": True, "decode2": False, "decode3": True, "decode4": True}
KILLED = frozenset({"decode2"})
WINDOW = (300.0, 320.0)


def end_samples(**changes: ProcSample) -> dict[str, ProcSample]:
    end = {k: v for k, v in START.items() if k != "decode2"}
    end["decode4"] = ProcSample(800 * MIB, 55)  # replacement: no start sample, not compared
    end.update(changes)
    return end


def test_clean_run_passes() -> None:
    v = judge(START, end_samples(), KV_IDLE, ALIVE, [], WINDOW, KILLED)
    assert v.passed and v.reasons == []


def test_rss_bound_is_larger_of_50mib_and_10_percent() -> None:
    # gateway 200 MiB: bound 50 MiB; prefill 900 MiB: bound 90 MiB
    ok = end_samples(gateway=ProcSample(249 * MIB, 40), prefill1=ProcSample(989 * MIB, 60))
    assert judge(START, ok, KV_IDLE, ALIVE, [], WINDOW, KILLED).passed
    bad = end_samples(gateway=ProcSample(251 * MIB, 40))
    v = judge(START, bad, KV_IDLE, ALIVE, [], WINDOW, KILLED)
    assert not v.passed and any("gateway: RSS grew" in r for r in v.reasons)
    bad = end_samples(prefill1=ProcSample(991 * MIB, 60))
    assert not judge(START, bad, KV_IDLE, ALIVE, [], WINDOW, KILLED).passed


def test_rss_shrink_is_fine() -> None:
    assert judge(START, end_samples(gateway=ProcSample(100 * MIB, 40)), KV_IDLE, ALIVE, [], WINDOW, KILLED).passed


def test_fd_count_within_five() -> None:
    assert judge(START, end_samples(decode3=ProcSample(900 * MIB, 65)), KV_IDLE, ALIVE, [], WINDOW, KILLED).passed
    assert judge(START, end_samples(decode3=ProcSample(900 * MIB, 55)), KV_IDLE, ALIVE, [], WINDOW, KILLED).passed
    v = judge(START, end_samples(decode3=ProcSample(900 * MIB, 66)), KV_IDLE, ALIVE, [], WINDOW, KILLED)
    assert not v.passed and any("decode3: open fds 60 -> 66" in r for r in v.reasons)


def test_kv_not_idle_fails() -> None:
    v = judge(START, end_samples(), {**KV_IDLE, "decode3": 0.02}, ALIVE, [], WINDOW, KILLED)
    assert not v.passed and any("decode3: KV usage" in r for r in v.reasons)


def test_unexpected_death_fails_but_killed_worker_is_fine() -> None:
    end = end_samples()
    del end["prefill1"]
    v = judge(START, end, KV_IDLE, {**ALIVE, "prefill1": False}, [], WINDOW, KILLED)
    assert not v.passed
    assert any("prefill1: process died" in r for r in v.reasons)
    assert any("prefill1: no end sample" in r for r in v.reasons)
    assert not any("decode2" in r for r in v.reasons)


def test_killed_worker_counts_if_not_declared_killed() -> None:
    v = judge(START, end_samples(), KV_IDLE, ALIVE, [], None, frozenset())
    assert not v.passed and any("decode2: process died" in r for r in v.reasons)


def test_error_explanation_rule() -> None:
    assert error_code("stream_error:no_workers") == "no_workers"
    assert error_code("http_503:no_workers") == "no_workers"
    assert error_code("http_503") == "http_503"
    assert is_explained(ErrorEvent(305.0, "stream_error:no_workers"), WINDOW)
    assert is_explained(ErrorEvent(300.0, "http_503:no_workers"), WINDOW)
    assert not is_explained(ErrorEvent(299.9, "stream_error:no_workers"), WINDOW)  # before the kill
    assert not is_explained(ErrorEvent(321.0, "stream_error:no_workers"), WINDOW)  # after recovery
    assert not is_explained(ErrorEvent(305.0, "incomplete_stream"), WINDOW)  # a lost stream is a bug
    assert not is_explained(ErrorEvent(305.0, "stream_error:backend_failed"), WINDOW)
    assert not is_explained(ErrorEvent(305.0, "stream_error:no_workers"), None)  # no restart injected


def test_errors_split_and_counted() -> None:
    errors = [
        ErrorEvent(310.0, "stream_error:no_workers"),
        ErrorEvent(10.0, "timeout"),
        ErrorEvent(11.0, "timeout"),
        ErrorEvent(312.0, "incomplete_stream"),
    ]
    v = judge(START, end_samples(), KV_IDLE, ALIVE, errors, WINDOW, KILLED)
    assert [e.kind for e in v.explained] == ["stream_error:no_workers"]
    assert len(v.unexplained) == 3
    assert not v.passed
    assert any("3 unexplained error(s)" in r and "'timeout': 2" in r for r in v.reasons)
    only_explained = judge(START, end_samples(), KV_IDLE, ALIVE, errors[:1], WINDOW, KILLED)
    assert only_explained.passed and len(only_explained.explained) == 1


def test_multiple_failures_all_reported() -> None:
    end = end_samples(gateway=ProcSample(400 * MIB, 80))
    v = judge(START, end, {**KV_IDLE, "decode4": 0.5}, ALIVE, [ErrorEvent(1.0, "timeout")], WINDOW, KILLED)
    assert not v.passed and len(v.reasons) == 4


# ---------------------------------------------------------------- hung worker and twins in the verdict

HUNG_END = {**KV_IDLE, "decode5": 0.03}  # the hung worker never freed its blocks
HUNG_ALIVE = {**ALIVE, "decode5": False}  # killed after the run


def test_hung_worker_counts_like_the_killed_one() -> None:
    v = judge(START, end_samples(), HUNG_END, HUNG_ALIVE, [], WINDOW, KILLED, hung=HungWorker("decode5", 42.0))
    assert v.passed, v.reasons
    undeclared = judge(START, end_samples(), HUNG_END, HUNG_ALIVE, [], WINDOW, KILLED)
    assert not undeclared.passed
    assert any("decode5: KV usage" in r for r in undeclared.reasons)
    assert any("decode5: process died" in r for r in undeclared.reasons)


def test_hung_worker_never_marked_stalled_or_crashed_fails() -> None:
    v = judge(START, end_samples(), HUNG_END, HUNG_ALIVE, [], WINDOW, KILLED, hung=HungWorker("decode5", None))
    assert not v.passed and v.reasons == ["decode5: hung but never marked stalled by the gateway"]
    v = judge(START, end_samples(), HUNG_END, HUNG_ALIVE, [], WINDOW, KILLED,
              hung=HungWorker("decode5", 42.0, alive_at_end=False))
    assert not v.passed and v.reasons == ["decode5: exited by itself before the soak killed it (a crash, not a hang)"]


def test_twins_must_match_and_include_a_sampled_stream() -> None:
    assert judge(START, end_samples(), KV_IDLE, ALIVE, [], WINDOW, KILLED, twins=TwinCheck(5, 1)).passed
    v = judge(START, end_samples(), KV_IDLE, ALIVE, [], WINDOW, KILLED, twins=TwinCheck(5, 0))
    assert not v.passed and any("no recovered sampled stream" in r for r in v.reasons)
    diff = TwinCheck(5, 3, ("soak-7 (temperature 0.9): client length 'ab' vs twin length 'ac'",))
    v = judge(START, end_samples(), KV_IDLE, ALIVE, [], WINDOW, KILLED, twins=diff)
    assert not v.passed
    assert v.reasons[0] == "1 of 5 recovered stream(s) differ from their undisturbed twin"
    assert "soak-7" in v.reasons[1]
    # no fault injected: nothing recovered, nothing to require
    assert judge(START, end_samples(), KV_IDLE, ALIVE, [], None, KILLED, twins=None).passed


# ---------------------------------------------------------------- traffic


def test_traffic_mixes_sampled_requests_names_each_and_keeps_what_completed(
    fake_server: FakeOpenAIServer,
) -> None:
    fake_server.behaviour.ttft_s = fake_server.behaviour.itl_s = 0.0
    traffic = Traffic(fake_server.url, "fake-model", 0.0, seed=3, t0=time.monotonic(), sampled_fraction=0.5,
                      id_prefix="t")
    # No time budget: `hold` alone keeps the traffic going, until 24 requests were sent.
    asyncio.run(traffic.run(2, 0.0, hold=lambda: traffic.counts["sent"] < 24))
    assert traffic.counts == {"sent": 24, "completed": 24, "aborted": 0, "errors": 0}
    ids = [v for h in fake_server.headers for k, v in h.items() if k.lower() == "x-request-id"]
    assert sorted(ids) == sorted(f"t-{i}" for i in range(1, 25))
    sampled = [b for b in fake_server.requests if b["temperature"]]
    greedy = [b for b in fake_server.requests if not b["temperature"]]
    assert sampled and greedy
    for b in sampled:
        assert b["temperature"] == SAMPLED_TEMPERATURE
        assert {k: b[k] for k in b if k.endswith("_penalty")} in PENALTIES
    assert any("seed" in b for b in sampled) and any("seed" not in b for b in sampled)
    assert not any("seed" in b or "frequency_penalty" in b for b in greedy)
    for rid, body in zip(ids, fake_server.requests, strict=True):
        assert traffic.completed[rid] == Completed(body, " w" * body["max_tokens"], "length")


# ---------------------------------------------------------------- twins against the real engine

KEY = bytes(range(32))


def test_recovered_ids_from_the_gateway_log() -> None:
    log = "\n".join([
        '{"level":"warning","message":"recovering soak-219 (attempt 1): worker decode-11823-4ecf5f lost"}',
        '{"level":"warning","message":"recovering soak-219 (attempt 2): worker decode-11449-aa lost"}',
        '{"level":"warning","message":"recovering warm-3 (attempt 1): worker decode-1-b stalled"}',
        '{"level":"warning","message":"worker decode-11823-4ecf5f (decode) stalled: holds work"}',
    ])
    assert recovered_ids(log) == {"soak-219", "warm-3"}


@pytest.fixture(scope="module")
def twins_engine() -> ReferenceTwins:
    return ReferenceTwins(model_dir(None), "float32", 1)


def test_twins_rebuild_the_gateway_seed_and_catch_any_difference(twins_engine: ReferenceTwins) -> None:
    base: dict[str, Any] = {"model": "m", "max_tokens": 12, "ignore_eos": True, "stream": True}
    sampled = {**base, "temperature": SAMPLED_TEMPERATURE, **PENALTIES[0]}
    bodies = {
        "soak-1": {**sampled, "prompt": "old stone bridges"},  # unseeded: the gateway's seed
        "soak-2": {**sampled, "prompt": "cold rain", "seed": 7},
        "soak-3": {**base, "prompt": "the lazy dog", "temperature": 0.0},
        "soak-4": {**sampled, "prompt": "seven wizards"},  # the client got another id's seed
        "soak-5": {**sampled, "prompt": "jovial bankers", "seed": 9},  # finish reason differs
        "soak-6": {**base, "prompt": "never recovered", "temperature": 0.0},
    }
    params = {rid: twin_params(rid, b, KEY) for rid, b in bodies.items()}
    assert params["soak-1"].seed == assigned_seed(KEY, "soak-1") and params["soak-2"].seed == 7
    params["soak-4"] = replace(params["soak-4"], seed=assigned_seed(KEY, "soak-40"))
    served = twins_engine.run([(b["prompt"], params[rid]) for rid, b in bodies.items()])
    completed = {rid: Completed(b, text, finish) for (rid, b), (text, finish) in zip(bodies.items(), served, strict=True)}
    completed["soak-5"] = replace(completed["soak-5"], finish_reason="stop")
    completed["soak-6"] = replace(completed["soak-6"], text="garbage")  # not recovered: not checked
    check = check_twins({"soak-1", "soak-2", "soak-3", "soak-4", "soak-5", "soak-9"}, completed, twins_engine, KEY)
    assert (check.checked, check.sampled) == (5, 4)  # soak-9 was recovered but never completed
    assert [m.split()[0] for m in check.mismatches] == ["soak-4", "soak-5"]


# ---------------------------------------------------------------- the script


def test_fault_times_default_and_are_checked() -> None:
    args = parse_args(["--minutes", "8"])
    assert (args.hang_at_minute, args.restart_at_minute, args.stall_timeout, args.sampled_fraction) == (2, 4, 3, 0.5)
    for bad in (["--hang-at-minute", "10"], ["--restart-at-minute", "-1"], ["--sampled-fraction", "1.5"],
                ["--hang-after-steps", "0"]):
        with pytest.raises(SystemExit) as e:
            parse_args(["--minutes", "10", *bad])
        assert e.value.code == 2, bad


def test_short_soak_with_a_killed_and_a_hung_decode_worker_passes(tmp_path: Path) -> None:
    """Both faults at t=0; the traffic (all sampled, no aborts, so every recovered stream
    completes) goes on until the replacement registered and the hung worker was marked
    stalled, whatever the time that takes on a loaded machine."""
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "bench.soak", "--minutes", "0.05", "--warmup-s", "2", "--concurrency", "4",
           "--abort-fraction", "0", "--sampled-fraction", "1", "--hang-at-minute", "0", "--restart-at-minute", "0",
           "--hang-after-steps", "20", "--log-dir", str(tmp_path / "logs"), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["passed"] and result["errors"] == []
    faults = result["faults"]
    assert faults["killed"] == "decode2" and "replacement_ready_t" in faults
    assert faults["hung"] == "decode4" and faults["stalled_t"] is not None
    assert faults["hung_alive_at_end"] is True  # it hung; it did not die
    twins = result["twins"]
    assert twins["sampled"] == twins["checked"] > 0 and twins["mismatches"] == []
    assert "VERDICT: PASS" in proc.stdout
