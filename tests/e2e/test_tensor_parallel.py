"""Tensor-parallel workers through real processes: a TP group is one worker (one
registration), serves exactly what the single-process engine generates, hands KV to
and from workers of another TP size, and dies whole when one of its ranks dies --
the gateway then recovers its streams on another worker, token for token."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, CountedStreams, http, wait_for
from tests.e2e.conftest import Reference

PROMPTS = ["The quick brown fox", "Once upon a time in a land", "1, 2, 3, 4,"]
LONG = 96  # tokens a kill-test stream runs: enough that the kill lands mid-stream


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


@pytest.fixture(scope="module")
def kill_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A gateway, a prefill worker and the decode worker the streams recover on; each
    kill case adds (and loses) its own parallel decode group."""
    c = Cluster(tmp_path_factory.mktemp("kill9"))
    try:
        # least-loaded: decode placement by most free KV (kv-aware would spread by running count).
        c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded")
        c.add_worker("prefill")
        c.add_worker("decode")
        c.wait_roles(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


def rank_pid(worker_pid: int, rank: int) -> int:
    """The pid of follower rank `rank` (it names itself `pdserve-rank<r>`)."""
    [pid] = [p for p in follower_pids(worker_pid)
             if Path(f"/proc/{p}/comm").read_text().strip() == f"pdserve-rank{rank}"]
    return pid


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# Greedy and seeded-sampled streams alike must recover token for token.
STREAM_PARAMS: list[dict[str, Any]] = [{}, {"temperature": 0.9, "seed": 71}, {}, {"temperature": 0.7, "seed": 5}]


@pytest.mark.parametrize(("layout", "victim"), [(TP2, 1), ((*TP2, *PP2), 3)],
                         ids=["tp2-rank1", "tp2xpp2-last-stage-rank1"])
def test_kill9_of_a_decode_rank_takes_the_worker_out_and_streams_recover(
    kill_cluster: Cluster, reference: Reference, layout: tuple[str, ...], victim: int
) -> None:
    c = kill_cluster
    # Twice the blocks: the gateway routes every stream to the parallel group first.
    group = c.add_worker("decode", *layout, "--num-blocks", "512")
    c.wait_roles(prefill=1, decode=2)
    ranks = follower_pids(group.popen.pid)
    assert len(ranks) == victim, ranks  # the victim is the group's last rank
    doomed = rank_pid(group.popen.pid, victim)
    prompts = [f"Stream {i} keeps going and going" for i in range(len(STREAM_PARAMS))]
    streams = CountedStreams(c.url, reference.model_name, prompts, LONG, STREAM_PARAMS)
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(streams.run, i) for i in range(len(prompts))]
        streams.wait_under_way()
        on_group = next(w for w in c.worker_list() if w["pid"] == group.popen.pid)
        assert on_group["inflight_requests"] == len(prompts), on_group
        os.kill(doomed, signal.SIGKILL)
        killed_at = streams.least()
        assert group.popen.wait(30) == 70, group.log()  # the whole worker went, not half of it
        texts = [f.result(timeout=120) for f in futures]
    assert killed_at < LONG, "streams finished before the kill: the test proved nothing"
    # No half-alive group: every other rank follows rank 0 out (each watches its parent).
    wait_for(lambda: all(_gone(pid) for pid in ranks), lambda: [p for p in ranks if not _gone(p)], 30, 0.05)
    for i, text in enumerate(texts):
        want = reference.generate(reference.completion_ids(prompts[i]), max_tokens=LONG, ignore_eos=True,
                                  **{"temperature": 0.0, **STREAM_PARAMS[i]})[0]
        assert text == reference.text(want), f"stream {i} ({STREAM_PARAMS[i]})"
    c.wait_roles(prefill=1, decode=1)
    c.wait_idle(timeout=50)
