"""A real worker publishes its pool's block events as vLLM does (`--kv-events-config`):
a ZeroMQ SUB in the test, decoding with plain msgpack in vLLM's layout, sees the blocks
of a request's prompt stored (their chained keys, parent, token ids), then removed when
other prompts evict them, in batches numbered one after another; the replay endpoint then
resends the whole stream from 0, which starts with `AllBlocksCleared`. With a host and a
disk tier the same stream tells where else the blocks are: stored in medium "CPU" and
"DISK" (after the pool's "GPU") once the tier writer wrote them, removed from "CPU" when
the host tier's bound evicts them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from pdserve.common.block_hash import prefix_block_keys
from pdserve.common.hosts import free_ports
from tests.e2e.cluster import Cluster, http, metric_value, wait_for, worker_metrics
from tests.e2e.conftest import Reference

BLOCK = 16
NUM_BLOCKS = 14  # 13 usable: a second and third prompt of ~9 blocks each evict the first's
WORDS = ("amber", "basin", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "juniper")


def text(seed: int, n: int) -> str:
    return " ".join(f"{WORDS[(seed * 3 + i) % len(WORDS)]}{seed}" for i in range(n))


class Subscriber:
    """Every (seq, events) the worker published since the subscription took hold."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"pd")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.batches: list[tuple[int, list[Any]]] = []

    def drain(self, wait_ms: int) -> None:
        while self.sock.poll(wait_ms):
            topic, seq, payload = self.sock.recv_multipart()
            assert topic == b"pd"
            ts, events, dp_rank = msgpack.unpackb(payload)  # vLLM's KVEventBatch, array-like
            assert isinstance(ts, float) and dp_rank == 0
            self.batches.append((int.from_bytes(seq, "big"), events))
            wait_ms = 0

    def events(self, tag: str) -> list[list[Any]]:
        return [e for _, evs in self.batches for e in evs if e[0] == tag]

    def until(self, cond: Any, what: str, timeout: float = 60.0) -> None:
        wait_for(cond, lambda: f"{what}; got {self.batches}", timeout, 0, step=lambda: self.drain(200))


@pytest.fixture()
def worker(log_dir: Path) -> Iterator[tuple[Cluster, str, str]]:
    c = Cluster(log_dir)
    endpoint, replay = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay, "topic": "pd"}
    try:
        c.start_gateway()
        c.add_worker("worker", "--num-blocks", str(NUM_BLOCKS), "--kv-events-config", json.dumps(config))
        c.wait_roles(colocated=1)
        yield c, endpoint, replay
    finally:
        c.stop()


@pytest.fixture()
def tiered_worker(log_dir: Path, tmp_path: Path, reference: Reference) -> Iterator[tuple[Cluster, str, Path]]:
    """A worker with a host tier of 12 blocks (a temp dir stands in for /dev/shm) and a disk tier."""
    from kv_transfer.tiers.record import HEADER_BYTES, block_payload_bytes

    record = HEADER_BYTES + block_payload_bytes(reference.engine.runner.layout)
    c = Cluster(log_dir)
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    config = {"enable_kv_cache_events": True, "endpoint": endpoint, "topic": "pd"}
    host = tmp_path / "host-tier"
    try:
        c.start_gateway()
        c.add_worker("worker", "--kv-events-config", json.dumps(config), "--kv-offload-memory", str(12 * record),
                     "--kv-offload-memory-dir", str(host), "--kv-offload-dir", str(tmp_path / "disk-tier"))
        c.wait_roles(colocated=1)
        yield c, endpoint, host
    finally:
        c.stop()


def complete(c: Cluster, model: str, prompt: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    status, out = http("POST", f"{c.url}/v1/completions", body, timeout=120)
    assert status == 200, out


def test_a_request_publishes_its_prompt_blocks_then_their_eviction(
        worker: tuple[Cluster, str, str], reference: Reference) -> None:
    c, endpoint, replay = worker
    sub = Subscriber(endpoint)
    try:
        # A SUB that has just connected misses what is sent before its subscription reaches
        # the PUB: warm up with prompts of their own until one's events arrive.
        for seed in range(100, 140):
            complete(c, reference.model_name, text(seed, 6))
            sub.drain(500)
            if sub.batches:
                break
        assert sub.batches, "no KV events reached the subscriber"
        sub.batches.clear()

        prompt = text(1, 14)
        ids = reference.completion_ids(prompt)
        keys = prefix_block_keys(ids, BLOCK)
        assert len(keys) >= 2
        complete(c, reference.model_name, prompt)

        def stored() -> list[int]:
            return [h for e in sub.events("BlockStored") for h in e[1]]

        sub.until(lambda: set(keys) <= set(stored()), "the prompt's blocks stored")
        first = next(e for e in sub.events("BlockStored") if keys[0] in e[1])
        _, hashes, parent, token_ids, block_size, lora_id, medium = first
        assert hashes == keys[: len(hashes)] and parent is None  # a run from the prompt's first block
        assert token_ids == ids[: len(hashes) * BLOCK] and block_size == BLOCK
        assert lora_id is None and medium == "GPU"

        def removed() -> list[int]:
            return [h for e in sub.events("BlockRemoved") for h in e[1]]

        for seed in (2, 3, 4, 5):  # other prompts take the pool; the first's blocks go
            complete(c, reference.model_name, text(seed, 26))
            sub.drain(300)
            if set(keys) <= set(removed()):
                break
        sub.until(lambda: set(keys) <= set(removed()), "the prompt's blocks removed")
        assert all(e[2] == "GPU" for e in sub.events("BlockRemoved"))
        seqs = [s for s, _ in sub.batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # one after another, no gap
        metrics = worker_metrics(c.worker_list()[0])
        assert metric_value(metrics, "llm_kv_events_published_batches_total") >= seqs[-1] + 1
        assert metric_value(metrics, "llm_kv_events_dropped_batches_total") == 0
        replayed = replay_from(replay, 0)
        assert replayed[0] == (0, [["AllBlocksCleared"]])  # a worker starts its stream with a clear
        assert [seq for seq, _ in replayed] == list(range(len(replayed)))
        assert dict(replayed).items() >= dict(sub.batches).items()  # what the SUB got, resent as it was
    finally:
        sub.sock.close()


def test_tier_writes_and_evictions_are_published_in_the_tiers_mediums(
        tiered_worker: tuple[Cluster, str, Path], reference: Reference) -> None:
    c, endpoint, host = tiered_worker
    sub = Subscriber(endpoint)
    try:
        for seed in range(100, 140):  # warm up until the subscription took hold
            complete(c, reference.model_name, text(seed, 6))
            sub.drain(500)
            if sub.batches:
                break
        assert sub.batches, "no KV events reached the subscriber"

        prompt = text(1, 14)
        keys = prefix_block_keys(reference.completion_ids(prompt), BLOCK)
        assert len(keys) >= 2
        complete(c, reference.model_name, prompt)

        def hashes(tag: str, medium: str) -> list[int]:
            return [h for e in sub.events(tag) if e[-1] == medium for h in e[1]]

        sub.until(lambda: set(keys) <= set(hashes("BlockStored", "CPU")) and
                  set(keys) <= set(hashes("BlockStored", "DISK")), "the prompt's blocks stored in the tiers")
        assert set(keys) <= set(hashes("BlockStored", "GPU"))  # the same hashes as the pool's
        order = [(e[0], e[-1], h) for _, evs in sub.batches for e in evs if e[0] != "AllBlocksCleared"
                 for h in e[1]]
        for h in keys:  # a tier's stored after the pool's
            assert order.index(("BlockStored", "GPU", h)) < order.index(("BlockStored", "CPU", h))
            assert order.index(("BlockStored", "GPU", h)) < order.index(("BlockStored", "DISK", h))
        cpu = next(e for e in sub.events("BlockStored") if e[-1] == "CPU" and keys[0] in e[1])
        assert cpu[2:6] == [None, [], BLOCK, None]  # by hash only, as vLLM's offloading connector

        for seed in range(2, 12):  # other prompts fill the 12-block host tier; the first's go
            complete(c, reference.model_name, text(seed, 26))
            sub.drain(300)
            if set(keys) <= set(hashes("BlockRemoved", "CPU")):
                break
        sub.until(lambda: set(keys) <= set(hashes("BlockRemoved", "CPU")), "the prompt's blocks evicted from CPU")
        removed = set(hashes("BlockRemoved", "CPU"))
        assert removed <= set(hashes("BlockStored", "CPU"))  # only what it said it stored
        assert not hashes("BlockRemoved", "DISK")  # the disk tier (16GiB by default) evicted nothing
        assert len(list(host.rglob("*.kv"))) <= 12
    finally:
        sub.sock.close()


def replay_from(endpoint: str, start: int) -> list[tuple[int, list[Any]]]:
    """vLLM's replay protocol: the start sequence number after REQ's empty delimiter (a
    DEALER, which may read the many replies), answered by (seq, payload) pairs, then -1."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[tuple[int, list[Any]]] = []
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert sock.poll(20_000), "the replay endpoint did not answer"
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    finally:
        sock.close()
