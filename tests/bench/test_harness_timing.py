"""bench/harness.py's timing and report half, driven by a fake clock: the order in which
things take turns, the medians, laps and minima of known timings, the warm-up dropped,
the untimed setup, the ratio table's cells, the verdict and machine lines; and
bench/client.py's streamed completion against a server of known timing."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from bench import client, harness
from pdserve.loadgen.compare import Column
from tests.bench.fake_openai import FakeOpenAIServer

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    """A clock that moves only when a fake call says it took so long."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def call(self, name: str, durations: list[float]) -> Callable[[], None]:
        """A fn that records its name and takes the next of `durations` seconds."""
        left = iter(durations)

        def fn() -> None:
            self.calls.append(name)
            self.now += next(left)

        return fn


def test_turns_interleave_the_keys_after_the_warm_up_rounds() -> None:
    assert list(harness.turns(["a", "b", "c"], 2, warmup=1)) == [
        (-1, "a"), (-1, "b"), (-1, "c"), (0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (1, "c")]
    assert [k for _, k in harness.turns(["a", "b"], 4, alternate=True)] == list("abbaabba")


def test_rounds_take_turns_and_drop_the_warm_up_results() -> None:
    order: list[str] = []

    def counter(name: str) -> Callable[[], int]:
        n = iter(range(100))

        def fn() -> int:
            order.append(name)
            return next(n)

        return fn

    got = harness.rounds({"x": counter("x"), "y": counter("y")}, 3, warmup=2)
    assert order == ["x", "y"] * 5
    assert got == {"x": [2, 3, 4], "y": [2, 3, 4]}  # the first two calls were the warm-up's


def test_medians_of_known_timings_interleaved_with_the_setup_untimed() -> None:
    clock = FakeClock()
    fns = {"a": clock.call("a", [100.0, 5.0, 1.0, 3.0]), "b": clock.call("b", [100.0, 2.0, 2.0, 8.0])}

    def barrier() -> None:
        clock.calls.append("setup")
        clock.now += 1000.0  # a slow barrier: none of it may be counted

    # with the warm-up's 100 s the medians would be 4 and 5; with the barrier's, over 1000
    assert harness.medians(fns, 3, warmup=1, setup=barrier, clock=clock) == {"a": 3.0, "b": 2.0}
    assert clock.calls == ["setup", "a", "setup", "b"] * 4
    clock.calls.clear()
    fns = {"a": clock.call("a", [5.0, 1.0, 3.0]), "b": clock.call("b", [2.0, 2.0, 8.0])}
    assert harness.medians(fns, 3, warmup=0, clock=clock) == {"a": 3.0, "b": 2.0}
    assert clock.calls == ["a", "b"] * 3


def test_seconds_timed_fastest_and_stopwatch_laps() -> None:
    clock = FakeClock()
    assert harness.seconds(clock.call("f", [2.5]), clock) == 2.5
    assert harness.timed(lambda: (clock.call("g", [1.5])(), "out")[1], clock) == (1.5, "out")
    assert harness.fastest(clock.call("h", [3.0, 1.0, 2.0]), 3, clock) == 1.0
    watch = harness.Stopwatch(clock)
    clock.now += 2.0
    assert watch.lap() == 2.0
    clock.now += 0.5
    assert watch.lap() == 0.5  # from the previous lap, not the start


def test_device_seconds_on_cpu_is_the_mean_after_the_warm_up() -> None:
    clock = FakeClock()
    fn = clock.call("step", [50.0, 50.0, 1.0, 2.0, 6.0])
    assert harness.device_seconds(fn, 3, 2, "cpu", clock) == 3.0
    assert clock.calls == ["step"] * 5


class Rates(NamedTuple):
    prefill: float
    decode: float


@dataclasses.dataclass(frozen=True)
class Speed:
    itl: float


def test_median_of_records_field_by_field() -> None:
    assert harness.median_of([Rates(1, 30), Rates(9, 10), Rates(5, 20)]) == Rates(5, 20)
    assert harness.median_of([Speed(1.0), Speed(4.0)]) == Speed(2.5)
    assert harness.median_of([{"s": 1.0, "c": 7.0}, {"s": 3.0, "c": 5.0}, {"s": 2.0, "c": 6.0}]) == {"s": 2.0, "c": 6.0}


def test_median_summary_per_column_in_the_summary_unit() -> None:
    cols = (Column("ITL p50 ms", ("decode", "itl", "p50")), Column("out tok/s", ("all", "tok_s"), scale=1),
            Column("never", ("all", "missing")))
    runs = [{"decode": {"itl": {"p50": v}}, "all": {"tok_s": t}} for v, t in ((0.1, 9), (0.3, 7), (0.2, 8))]
    runs.append({"decode": {"itl": {"p50": None}}, "all": {"tok_s": 1}})  # no ITL in this run: left out
    got = harness.median_summary(runs, cols)
    assert got["decode"]["itl"]["p50"] == pytest.approx(0.2)
    assert got["all"] == {"tok_s": 7.5}  # no "missing": a column without values is absent


def test_verdict_takes_the_median_of_the_runs_it_has() -> None:
    line = harness.verdict("TTFT x", [3.5, None, 2.0, 4.0], ">= 3", lambda m: m >= 3)
    assert line == "VERDICT TTFT x: per run 3.50, -, 2.00, 4.00; median 3.50 (target >= 3): PASS"
    assert harness.verdict("cut", [0.7, 0.9], ">= 80%", lambda m: m >= 0.81, "{:.0%}").endswith(
        "per run 70%, 90%; median 80% (target >= 80%): MISS")
    assert harness.verdict("none", [None], "<= 1", lambda m: True).endswith("median - (target <= 1): MISS")


def test_ratio_table_cells() -> None:
    table = harness.RatioTable((("threads", 7), ("N x K", 10), ("M", 4)), ("aten", "gemv", "auto"))
    head = table.header()
    assert head.split() == ["threads", "N", "x", "K", "M", "bf16", "us", "ratio", "to", "bf16:", "aten", "gemv",
                            "auto"]
    row = table.row((2, "64x128", 4), {"bf16": 100e-6, "aten": 50e-6, "auto": 250e-6})
    assert row.split() == ["2", "64x128", "4", "100.0", "0.50", "-", "2.50"]  # gemv does not run at 4 rows
    # the same cells against another path as the base, in another format
    row = table.row(("", "vs GEMV", 4), {"gemv": 2e-3, "aten": 1e-3, "auto": 4e-3}, base="gemv", fmt="8.0f")
    assert row.split() == ["vs", "GEMV", "4", "2000", "0.50", "1.00", "2.00"]
    assert len(row.splitlines()[0]) == len(table.row(("", "x", 4), {"bf16": 1e-4}))  # the columns line up
    gbps = harness.RatioTable((("rows", 4),), ("avx", "amx"), base="F.linear", width=13, gbps=True)
    assert gbps.header().split()[-4:] == ["F.linear", "(GB/s):", "avx", "amx"]
    # 2 MB read: 2 GB/s in 1 ms, 4 GB/s in 0.5 ms
    assert gbps.row((16,), {"F.linear": 1e-3, "avx": 0.5e-3}, nbytes=2_000_000).split() == [
        "16", "1000.0", "2.0", "0.50", "(4.0)", "-"]


def test_sweep_sets_each_thread_count_in_the_tables_order() -> None:
    prev = torch.get_num_threads()
    seen = []
    try:
        for t, m, n, k in harness.sweep([1, 2], [4, 8], [(3, 5)]):
            seen.append((t, m, n, k, torch.get_num_threads()))
    finally:
        torch.set_num_threads(prev)
    assert seen == [(1, 4, 3, 5, 1), (1, 8, 3, 5, 1), (2, 4, 3, 5, 2), (2, 8, 3, 5, 2)]


def test_read_bandwidth_streams_and_restores_the_threads() -> None:
    prev = torch.get_num_threads()
    assert harness.read_bandwidth(threads=1, mib=8, reps=2) > 1e8  # any machine streams 100 MB/s
    assert torch.get_num_threads() == prev


def test_machine_line_names_the_commit_and_the_cpu() -> None:
    line = harness.machine_line()
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert line.startswith(f"commit {head}")
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    model = next(x.split(":", 1)[1].strip() for x in cpuinfo.splitlines() if x.startswith("model name"))
    flags = next(x.split(":", 1)[1].split() for x in cpuinfo.splitlines() if x.startswith("flags"))
    assert model in line and "load average" in line
    assert all((f in line.split("; ")[3].split()) == (f in flags) for f in harness.SIMD_FLAGS)


def test_speed_args_quick_full_and_explicit() -> None:
    def parse(*argv: str) -> argparse.Namespace:
        return harness.parse_speed_args(argparse.ArgumentParser(), list(argv), quick=(16, 4), full=(128, 64))

    quick, full = parse("--quick"), parse()
    assert (quick.prompt_len, quick.decode_tokens, quick.reps) == (16, 4, 1)
    assert (full.prompt_len, full.decode_tokens, full.reps) == (128, 64, 3)
    assert (parse("--quick", "--reps", "5", "--prompt-len", "7").reps, parse("--prompt-len", "7").prompt_len) == (5, 7)
    prev = torch.get_num_threads()
    try:
        assert parse("--threads", "1").threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(prev)


def test_stream_completion_against_a_server_with_known_timing(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.05, 0.02
    assert client.served_model(fake_server.url) == "fake-model"
    got = client.stream_completion(fake_server.url, "fake-model", "one two three", 4)
    assert got.text == " w w w w" and got.usage["prompt_tokens"] == 3 and got.usage["completion_tokens"] == 4
    # the server sends the first text 50 ms after the request came, the last 3 x 20 ms after that at the earliest
    assert got.first_s >= 0.05 and got.last_s >= 0.05 + 3 * 0.02 and got.last_s > got.first_s
    sent = fake_server.requests[-1]
    assert (sent["temperature"], sent["ignore_eos"], sent["stream"], sent["max_tokens"]) == (0, True, True, 4)
    with pytest.raises(RuntimeError, match="HTTP 503"):
        client.stream_completion(fake_server.url, "fake-model", "FAIL503", 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_seconds_on_cuda_times_the_queued_work() -> None:
    spin = functools.partial(torch.cuda._sleep, 10_000_000)  # ~ms of GPU cycles a call, queued at once
    watch = harness.Stopwatch()
    per_call = harness.device_seconds(spin, 4, 1, "cuda")
    wall = watch.lap()  # the warm-up call and the 4 timed ones, synchronized at the end
    assert 0 < 4 * per_call < wall


def test_at_once_runs_every_item_in_its_own_thread_and_raises_the_first_error() -> None:
    import threading

    barrier = threading.Barrier(3, timeout=30)  # passes only if all three run at the same time
    seen: list[int] = []

    def meet(i: int) -> None:
        barrier.wait()
        seen.append(i)

    client.at_once(meet, [0, 1, 2])
    assert sorted(seen) == [0, 1, 2]
    done: list[int] = []

    def fail_on_one(i: int) -> None:
        if i == 1:
            raise ValueError("one failed")
        done.append(i)

    with pytest.raises(ValueError, match="one failed"):
        client.at_once(fail_on_one, range(4))
    assert sorted(done) == [0, 2, 3]  # the others still ran to their end
