"""Tensor-parallel workers through real processes: a TP group is one worker (one
registration), serves exactly what the single-process engine generates, hands KV to
and from workers of another TP size, and dies whole when one of its ranks dies --
the gateway then recovers its streams on another worker, token for token."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, CountedStreams, http
from tests.e2e.conftest import Reference

PROMPTS = ["The quick brown fox", "Once upon a time in a land", "1, 2, 3, 4,"]
LONG = 160


def follower_pids(worker_pid: int) -> list[int]:
    """The worker's spawned rank processes (children running multiprocessing's spawn_main)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == worker_pid and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _completion(c: Cluster, reference: Reference, prompt: str) -> None:
    body = {"model": reference.model_name, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    status, out = http("POST", f"{c.url}/v1/completions", body)
    assert status == 200, out
    want = reference.generate(reference.completion_ids(prompt), max_tokens=24, temperature=0.0, ignore_eos=True)[0]
    assert out["choices"][0]["text"] == reference.text(want), prompt


def test_colocated_tp2_worker_is_one_worker_serving_the_engines_tokens(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        proc = c.add_worker("worker", "--tensor-parallel-size", "2")
        [worker] = c.wait_roles(colocated=1)
        assert worker["pid"] == proc.popen.pid
        assert len(follower_pids(proc.popen.pid)) == 1
        for prompt in PROMPTS:
            _completion(c, reference, prompt)
        c.wait_idle()
    finally:
        c.stop()


TP2 = ("--tensor-parallel-size", "2")
PP2 = ("--pipeline-parallel-size", "2")


@pytest.mark.parametrize(("prefill", "decode", "transport"), [
    ((), TP2, "auto"), (TP2, (), "auto"), (TP2, TP2, "tcp"), (PP2, (), "auto"), ((), PP2, "auto"),
    (PP2, TP2, "tcp"),
], ids=["tp1-tp2", "tp2-tp1", "tp2-tp2-tcp", "pp2-tp1", "tp1-pp2", "pp2-tp2-tcp"])
def test_kv_handoff_between_parallel_layouts_equals_the_engine(
    log_dir: Path, reference: Reference, prefill: tuple[str, ...], decode: tuple[str, ...], transport: str
) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        c.add_worker("prefill", *prefill, "--kv-transport", transport)
        c.add_worker("decode", *decode, "--kv-transport", transport)
        c.wait_roles(prefill=1, decode=1)
        for prompt in PROMPTS:
            _completion(c, reference, prompt)
        c.wait_idle()
    finally:
        c.stop()


def test_kill9_of_a_decode_rank_takes_the_worker_out_and_streams_recover(
    log_dir: Path, reference: Reference
) -> None:
    c = Cluster(log_dir)
    try:
        # least-loaded: decode placement by most free KV (kv-aware would spread by running count).
        c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded")
        c.add_worker("prefill")
        # Twice the blocks: the gateway routes every stream to the TP group first.
        group = c.add_worker("decode", "--tensor-parallel-size", "2", "--num-blocks", "512")
        c.add_worker("decode")
        c.wait_roles(prefill=1, decode=2)
        [rank1] = follower_pids(group.popen.pid)
        prompts = [f"Stream {i} keeps going and going" for i in range(4)]
        streams = CountedStreams(c.url, reference.model_name, prompts, LONG)
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(streams.run, i) for i in range(len(prompts))]
            streams.wait_under_way()
            on_group = next(w for w in c.worker_list() if w["pid"] == group.popen.pid)
            assert on_group["inflight_requests"] == len(prompts), on_group
            os.kill(rank1, signal.SIGKILL)
            killed_at = streams.least()
            assert group.popen.wait(30) == 70, group.log()  # the whole worker went, not half of it
            texts = [f.result(timeout=120) for f in futures]
        assert killed_at < LONG, "streams finished before the kill: the test proved nothing"
        for i, text in enumerate(texts):
            want = reference.generate(reference.completion_ids(prompts[i]), max_tokens=LONG, temperature=0.0,
                                      ignore_eos=True)[0]
            assert text == reference.text(want), f"stream {i}"
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()
