"""Fault injection only when asked for: PDSERVE_FAULTS / PDSERVE_KV_FAULTS arm nothing
unless the worker was started with --enable-fault-injection."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.fake import FakeFabric, FakeReceiver, fake_sender
from kv_transfer.faults import FaultConfig
from pdserve.worker.faults import NO_FAULTS, InjectedFaults, WorkerFaults, injected_faults
from tests.e2e.cluster import Cluster, http, metric_value, worker_metrics
from tests.e2e.conftest import Reference
from tests.kv_transfer.harness import TINY

# Each would be fatal if armed: the prefill worker exits on its first request, and
# its first KV chunk is corrupted.
FATAL = {"PDSERVE_FAULTS": "exit_on_prefill=1", "PDSERVE_KV_FAULTS": "corrupt_chunk=0"}


def test_fault_env_arms_nothing_without_the_flag(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    for name, value in FATAL.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="pdserve.worker.faults"):
        assert injected_faults(False) == NO_FAULTS
        assert "ignored" in caplog.text and "is ON" not in caplog.text
        caplog.clear()
        armed = injected_faults(True)
        assert "fault injection is ON" in caplog.text
    assert armed == InjectedFaults(WorkerFaults(exit_on_prefill=1), FaultConfig(corrupt_chunk=0))
    # What the runtime and the transfer layer pick up on their own: nothing.
    assert WorkerFaults.from_env() == WorkerFaults()
    pool = np.zeros(TINY.pool_shape(4), dtype=np.float16)
    fabric = FakeFabric()
    assert fake_sender(TINY, pool, fabric).faults == FaultConfig()
    assert FakeReceiver(TINY, pool.copy(), fabric).core.faults == FaultConfig()
    # A malformed spec cannot stop a worker that never asked for faults.
    monkeypatch.setenv("PDSERVE_FAULTS", "no_such_fault=1")
    assert injected_faults(False) == NO_FAULTS
    with pytest.raises(ValueError, match="no_such_fault"):
        injected_faults(True)


def test_real_workers_ignore_fatal_fault_env_without_the_flag(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        prefill = c.add_worker("prefill", env=FATAL)
        c.add_worker("decode", "--kv-transport", "tcp", env=FATAL)  # tcp: checksummed frames
        c.wait_roles(prefill=1, decode=1)
        prompt = "A stray environment must never take a worker down"
        want = reference.generate(reference.completion_ids(prompt), max_tokens=6, temperature=0.0)[0]
        status, out = http("POST", f"{c.url}/v1/completions",
                           {"model": reference.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert status == 200, out
        assert out["choices"][0]["text"] == reference.text(want)
        assert prefill.alive(), prefill.log()
        failures = sum(metric_value(worker_metrics(w), "llm_kv_transfer_failures_total") for w in c.worker_list())
        assert failures == 0  # no corrupted chunk was sent
        assert "ignored: fault injection needs --enable-fault-injection" in prefill.log()
        assert "fault injection is ON" not in prefill.log()
        c.wait_idle()
    finally:
        c.stop()
