"""The soak verdict (bench/soak_verdict.py) on synthetic samples: no cluster."""

from __future__ import annotations

from bench.soak_verdict import MIB, ErrorEvent, ProcSample, error_code, is_explained, judge

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
