"""bench/disagg_vs_colocated.py's verdicts: per-run ratios of 1P+1D to colocated for
the short prompts' TTFT p95, the decode ITL p99 and the long prompts' TTFT p50, and
PASS/MISS on their median."""

from __future__ import annotations

from typing import Any

from bench.disagg_vs_colocated import verdicts


def summary(short_p95: float, itl_p99: float, long_p50: float) -> dict[str, Any]:
    return {"decode": {"ttft": {"p95": short_p95}, "itl": {"p99": itl_p99}}, "long_prompt": {"ttft": {"p50": long_p50}}}


def test_verdicts_take_the_median_of_the_per_run_ratios() -> None:
    colocated = summary(1.0, 1.5, 1.6)
    runs = [{"1P+1D": summary(s, 0.15, 2.6), "colocated": colocated} for s in (0.5, 1.2, 0.9)]
    short, itl, long = verdicts(runs)
    assert short == ("VERDICT short TTFT p95 1P+1D/colocated: per run 0.500, 1.200, 0.900; median 0.900 "
                     "(target <= 1.0): PASS")
    assert itl.endswith("median 0.100 (target <= 0.2): PASS")
    assert long.startswith("VERDICT TTFT p50 ms") and long.endswith("(target <= 1.5): MISS")
    missing = verdicts([{"1P+1D": {"decode": {}}, "colocated": colocated}])
    assert missing[0].endswith("median - (target <= 1.0): MISS")
