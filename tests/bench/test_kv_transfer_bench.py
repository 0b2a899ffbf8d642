"""bench/kv_transfer.py end to end on a small transfer: a receiver process, real sockets."""

from __future__ import annotations

import numpy as np
import pytest

from bench.kv_transfer import Memcpy, bench_one


@pytest.mark.parametrize("transport", ["shm", "ipc"])
def test_bench_one_times_a_verified_transfer_against_its_own_memcpy(transport: str) -> None:
    r = bench_one("llama-125m", transport, tokens=64, runs=2)
    nbytes = 64 * 12 * 2 * 4 * 64 * 2  # tokens x layers x K/V x kv heads x head dim x fp16
    assert r.nbytes == nbytes
    assert 0 < r.data_s <= r.latency_s and r.cpu_s > 0 and r.memcpy_s > 0
    assert 0 < r.ratio <= r.data_ratio


def test_memcpy_baseline_copies_the_source_bytes() -> None:
    src = np.arange(1000, dtype=np.float16).reshape(10, 100)
    m = Memcpy(src, 1000)
    assert m.seconds(repeats=2) > 0
    assert m._dst.tobytes() == src.tobytes()[:1000]


def test_hostcopy_bench_reports_rates_for_the_transfer_bytes() -> None:
    from bench.hostcopy import bench_kernel

    r = bench_kernel("llama-125m", tokens=32, repeats=2)
    assert r.nbytes == 32 * 12 * 2 * 4 * 64 * 2
    assert min(r.memcpy_gbps, r.copy_gbps, r.sum_gbps) > 0
