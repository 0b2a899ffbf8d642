"""Metric formulas on synthetic timestamp streams with known answers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.loadgen.config import SLOConfig, parse_slo
from pdserve.loadgen.metrics import (
    allocate_tokens,
    e2e,
    itls,
    meets_slo,
    run_duration,
    stats,
    summarize,
    tpot,
    ttft,
)
from pdserve.loadgen.records import RequestRecord


def rec(
    send: float,
    chunks: list[float],
    end: float,
    tokens: int | None = None,
    prompt_tokens: int | None = 10,
    **kw: object,
) -> RequestRecord:
    r = RequestRecord(tag="t", send_time=send, max_tokens=tokens or len(chunks), **kw)  # type: ignore[arg-type]
    r.chunk_times = list(chunks)
    r.chunk_chars = [1] * len(chunks)
    r.end_time = end
    r.completion_tokens = tokens
    r.prompt_tokens = prompt_tokens
    return r


def test_stats_percentiles_known_answers() -> None:
    s = stats(float(i) for i in range(1, 101))
    assert s.count == 100
    assert s.mean == pytest.approx(50.5)
    assert s.p50 == pytest.approx(50.5)
    assert s.p90 == pytest.approx(90.1)
    assert s.p95 == pytest.approx(95.05)
    assert s.p99 == pytest.approx(99.01)
    assert s.max == 100.0
    assert stats([]).p50 is None and stats([]).count == 0
    one = stats([0.25])
    assert one.p50 == one.p99 == one.max == one.mean == 0.25


def test_allocate_tokens_rule() -> None:
    assert allocate_tokens(4, 4) == [1, 1, 1, 1]
    assert allocate_tokens(7, 3) == [1, 3, 3]  # extras never to the first chunk
    assert allocate_tokens(8, 3) == [1, 4, 3]  # tie: the earlier chunk
    assert allocate_tokens(3, 1) == [3]
    assert allocate_tokens(6, 3, estimates=[3, 1, 2]) == [3, 1, 2]
    assert allocate_tokens(12, 3, estimates=[3, 1, 2]) == [7, 1, 4]  # scaled to the reported count
    assert allocate_tokens(0, 0) == []
    with pytest.raises(ValueError):
        allocate_tokens(2, 3)


def test_single_token_chunks_ttft_itl_tpot_e2e() -> None:
    r = rec(10.0, [10.1, 10.2, 10.4], end=10.45, tokens=3)
    assert ttft(r) == pytest.approx(0.1)
    assert e2e(r) == pytest.approx(0.45)
    assert itls(r) == pytest.approx([0.1, 0.2])
    assert tpot(r) == pytest.approx((0.45 - 0.1) / 2)


def test_multi_token_chunks_are_spread() -> None:
    # 5 tokens in 3 chunks: k = [1, 2, 2]; gaps 0.1 and 0.2 split in halves.
    r = rec(0.0, [0.1, 0.2, 0.4], end=0.4, tokens=5)
    assert itls(r) == pytest.approx([0.05, 0.05, 0.1, 0.1])
    assert tpot(r) == pytest.approx(0.3 / 4)
    # A tokenizer estimate saying the first chunk held 2 tokens adds a 0 gap.
    r.chunk_token_est = [2, 1, 2]
    assert itls(r) == pytest.approx([0.0, 0.1, 0.1, 0.1])


def test_fewer_tokens_than_chunks_uses_raw_gaps() -> None:
    r = rec(0.0, [0.1, 0.2, 0.4], end=0.5, tokens=2)
    assert itls(r) == pytest.approx([0.1, 0.2])


def test_one_token_request_has_no_tpot_or_itl() -> None:
    r = rec(0.0, [0.3], end=0.35, tokens=1)
    assert tpot(r) is None
    assert itls(r) == []
    assert meets_slo(r, SLOConfig(ttft_s=0.5, tpot_s=0.001, itl_s=0.001))
    assert not meets_slo(r, SLOConfig(ttft_s=0.2))


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30),
    extra=st.integers(0, 40),
)
def test_itl_samples_count_and_sum(gaps: list[float], extra: int) -> None:
    times = [0.5]
    for g in gaps:
        times.append(times[-1] + g)
    n = len(times) + extra
    r = rec(0.0, times, end=times[-1], tokens=n)
    samples = itls(r)
    assert len(samples) == n - 1
    assert math.isclose(sum(samples), times[-1] - times[0], abs_tol=1e-9)
    assert tpot(r) == pytest.approx(sum(samples) / (n - 1))


def test_slo_all_terms_must_hold() -> None:
    r = rec(0.0, [0.4, 0.5, 0.6], end=0.6, tokens=3)  # ttft .4, tpot .1, max itl .1
    assert meets_slo(r, SLOConfig(ttft_s=0.5, tpot_s=0.1, itl_s=0.1, e2e_s=0.6))
    assert not meets_slo(r, SLOConfig(ttft_s=0.3))
    assert not meets_slo(r, SLOConfig(ttft_s=0.5, tpot_s=0.09))
    assert not meets_slo(r, SLOConfig(itl_s=0.05))
    assert not meets_slo(r, SLOConfig(e2e_s=0.59))
    r.error = "http_503"
    assert not meets_slo(r, SLOConfig(ttft_s=10))


def test_parse_slo() -> None:
    assert parse_slo("ttft=0.5,tpot=0.05,e2e=10") == SLOConfig(ttft_s=0.5, tpot_s=0.05, e2e_s=10)
    assert parse_slo("") == SLOConfig()
    for bad in ("ttft", "speed=1", "ttft=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_summarize_rates_goodput_failures() -> None:
    a = rec(0.0, [0.2, 0.3, 0.4, 0.5], end=0.5, tokens=4, prompt_tokens=100)  # ttft .2, tpot .1
    b = rec(1.0, [1.5, 1.7, 1.9], end=2.0, tokens=3, prompt_tokens=50)  # ttft .5, tpot .25
    failed = rec(0.5, [], end=0.6, tokens=None)
    failed.error = "http_503"
    cancelled = rec(1.5, [1.6], end=3.0, tokens=None)
    cancelled.cancelled = True
    cancelled.error = None
    s = summarize([a, b, failed, cancelled], parse_slo("ttft=0.3"))
    assert run_duration([a, b, failed, cancelled]) == pytest.approx(2.0)
    assert s["duration_s"] == pytest.approx(2.0)
    assert (s["num_requests"], s["completed"], s["failed"], s["cancelled"]) == (3, 2, 1, 1)
    assert s["failures"] == {"http_503": 1}
    assert s["request_throughput"] == pytest.approx(2 / 2.0)
    assert s["output_throughput"] == pytest.approx(7 / 2.0)
    assert s["prefill_throughput"] == pytest.approx(150 / 2.0)
    assert s["total_token_throughput"] == pytest.approx(157 / 2.0)
    assert s["decode_throughput"] == pytest.approx(5 / 2.0)
    # decode time: (0.5 - 0.2) + (1.0 - 0.5) = 0.8 s for 5 tokens
    assert s["decode_rate_per_stream"] == pytest.approx(5 / 0.8)
    assert s["prefill_rate_per_request"]["p50"] == pytest.approx((100 / 0.2 + 50 / 0.5) / 2)
    assert s["ttft"]["mean"] == pytest.approx(0.35)
    assert s["ttft"]["max"] == pytest.approx(0.5)
    assert s["tpot"]["p50"] == pytest.approx(0.175)
    assert s["itl"]["count"] == 5
    assert s["itl"]["max"] == pytest.approx(0.2)
    assert s["e2e"]["p50"] == pytest.approx(0.75)
    g = s["goodput"]
    assert g["requests_met"] == 1
    assert g["fraction_met"] == pytest.approx(1 / 3)
    assert g["request_goodput"] == pytest.approx(0.5)
    assert summarize([a], SLOConfig())["goodput"]["requests_met"] is None


def test_usage_missing_falls_back_to_chunks() -> None:
    r = rec(0.0, [0.1, 0.2], end=0.3, tokens=None, prompt_tokens=None, prompt_tokens_est=7)
    s = summarize([r], SLOConfig())
    assert s["total_output_tokens"] == 2
    assert s["total_prompt_tokens"] == 7
    assert s["requests_without_usage"] == 1
