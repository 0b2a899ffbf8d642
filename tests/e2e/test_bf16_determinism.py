"""One answer at bf16 whatever else is happening (docs/determinism.md), with real
processes at bfloat16, as each CPU kind this host can emulate (`PDSERVE_CPU_FEATURES`:
its own kernels, `-amx` on an AMX host, `avx2`): the same seeded sampled requests give
the same text

- sent one by one to a colocated worker (the reference), and again all at once, when
  every prompt is a prefix-cache hit (`cached_tokens` > 0);
- through 1P+2D, whose prefill worker computes each prompt in chunks of 16 tokens (the
  colocated worker takes it in one) and ships the KV over shared memory;
- with n-gram speculative decoding on (drafts verified as several rows of one step);
- across a kill -9 of the decode worker mid-stream: every stream resumes on the other
  decode worker, whose KV arrives over TCP.

No token may depend on the batch, the chunk, a cache hit, the worker or a recovery
(with `PDSERVE_NATIVE_KERNELS=0`, aten's kernels, these tests fail)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, http, metric_value, worker_metrics
from tests.e2e.test_bf16_masks import MASKS
from tests.e2e.test_exact_recovery import Stream

BF16 = ("--dtype", "bfloat16")
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})
PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The dog sat on the log. The dog sat on the",
    "Once upon a time, in a land far away, there lived a king who had three daughters, and each",
    "one two three four five six seven eight nine ten one two three four five six seven eight",
]
PARAMS = {"max_tokens": 48, "temperature": 0.9, "top_p": 0.95, "frequency_penalty": 0.3,
          "presence_penalty": 0.3, "ignore_eos": True}
JOBS = [(prompt, seed) for seed in (7, 8) for prompt in PROMPTS]
KILL_AFTER = 4  # chunks each stream has read before its decode worker is killed


def _body(model: str, prompt: str, seed: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "seed": seed, **PARAMS}


def _complete(c: Cluster, body: dict[str, Any]) -> tuple[str, int]:
    """The text and the prompt tokens the server's cache gave."""
    status, out = http("POST", f"{c.url}/v1/completions", body)
    assert status == 200, out
    return str(out["choices"][0]["text"]), int(out["usage"]["prompt_tokens_details"]["cached_tokens"])


def _together(c: Cluster, model: str) -> list[tuple[str, int]]:
    with cf.ThreadPoolExecutor(len(JOBS)) as pool:
        return list(pool.map(lambda j: _complete(c, _body(model, *j)), JOBS))


@pytest.fixture(scope="module", params=MASKS)
def mask(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment that makes a worker run as that CPU kind."""
    return {"PDSERVE_CPU_FEATURES": "" if request.param == "native" else str(request.param)}


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory, mask: dict[str, str]) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("bf16-colocated"))
    try:
        c.start_gateway()
        c.add_worker("worker", *BF16, env=mask)
        c.wait_roles(colocated=1)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def reference_texts(colocated: Cluster, model_dir: Path) -> list[str]:
    """Each job alone on a cold colocated worker: the text every other run must give."""
    alone = [_complete(colocated, _body(model_dir.name, *j)) for j in JOBS]
    assert len({t for t, _ in alone}) == len(JOBS)  # the seeds and prompts do sample apart
    return [t for t, _ in alone]


def test_repeated_at_once_from_the_prefix_cache_equals_alone_and_cold(
        colocated: Cluster, reference_texts: list[str], model_dir: Path) -> None:
    for _ in range(2):
        got = _together(colocated, model_dir.name)
        assert [t for t, _ in got] == reference_texts
        assert all(cached > 0 for _, cached in got), got  # every prompt was a cache hit
    colocated.wait_idle()


def test_speculative_decoding_on_equals_off(tmp_path_factory: pytest.TempPathFactory, mask: dict[str, str],
                                            reference_texts: list[str], model_dir: Path) -> None:
    c = Cluster(tmp_path_factory.mktemp("bf16-spec"))
    try:
        c.start_gateway()
        w = c.add_worker("worker", *BF16, "--speculative-config", NGRAM, env=mask)
        c.wait_roles(colocated=1)
        assert [t for t, _ in _together(c, model_dir.name)] == reference_texts
        accepted = metric_value(worker_metrics(c.worker_list()[0]), "llm_spec_decode_num_accepted_tokens_total")
        assert accepted > 0, w.log()  # drafts were verified and taken, not all refused
        c.wait_idle()
    finally:
        c.stop()


def test_1p2d_chunked_and_a_kill_9_of_the_decode_worker_equal_colocated(
        tmp_path_factory: pytest.TempPathFactory, mask: dict[str, str], reference_texts: list[str],
        model_dir: Path) -> None:
    c = Cluster(tmp_path_factory.mktemp("bf16-1p2d"))
    try:
        # least-loaded: decode placement by most free KV, so the larger victim takes every stream.
        c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded")
        c.add_worker("prefill", *BF16, "--max-num-batched-tokens", "16", env=mask)
        victim = c.add_worker("decode", *BF16, "--num-blocks", "1024", "--kv-transport", "shm",
                              "--enable-fault-injection", env={**mask, "PDSERVE_FAULTS": "step_delay_s=0.05"})
        c.add_worker("decode", *BF16, "--kv-transport", "tcp", env=mask)
        c.wait_roles(prefill=1, decode=2)

        assert [t for t, _ in _together(c, model_dir.name)] == reference_texts
        c.wait_idle()

        streams = [Stream(c.url, f"bf16-kill-{i}", _body(model_dir.name, *j)) for i, j in enumerate(JOBS)]
        for s in streams:
            s.thread.start()
        for s in streams:
            s.wait_chunks(KILL_AFTER)
        victim.signal(signal.SIGKILL)
        texts = [s.result()[0][0] for s in streams]
        assert texts == reference_texts
        gateway_log = c.gateway.log_path.read_text() if c.gateway else ""
        assert all(f"recovering {s.rid} " in gateway_log for s in streams), gateway_log[-2000:]
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()
