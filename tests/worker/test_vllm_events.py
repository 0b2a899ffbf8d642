"""KV events in vLLM's format (pdserve/worker/vllm_events/): the flag's JSON, the block
manager's ordered log, the frames on a real ZeroMQ SUB socket decoded with plain
msgpack in vLLM's layout, replay, and a publisher that never makes the caller wait."""

from __future__ import annotations

import threading
from typing import Any

import msgpack
import pytest
import zmq

from pdserve.common.block_hash import ROOT_DIGEST, prefix_block_keys, prefix_root
from pdserve.common.hosts import free_port
from pdserve.engine.core.block_events import AllCleared, BlockEvent, BlocksStored
from pdserve.engine.core.block_manager import BlockManager
from pdserve.worker.vllm_events.config import KVEventsConfig, binds, is_local
from pdserve.worker.vllm_events.publisher import KVEventPublisher, _Batch
from pdserve.worker.vllm_events.wire import END_SEQ

BS = 4


def test_config_reads_vllms_json_and_refuses_unknown_keys() -> None:
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv", "buffer_steps": 5}')
    assert c.enabled and c.publisher == "zmq" and c.topic == "kv" and c.buffer_steps == 5
    assert c.endpoint == "tcp://127.0.0.1:5557"  # loopback by default
    assert not KVEventsConfig.from_json('{"endpoint": "tcp://127.0.0.1:1"}').enabled  # vLLM: off unless enabled
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    assert KVEventsConfig.from_json(c.to_json()) == c
    for bad, why in (('{"enable_kv_cache_events": true, "port": 1}', "unknown key 'port'"),
                     ('{"hwm": "10"}', "hwm must be an integer"),
                     ('{"publisher": "kafka"}', "publisher must be one of"),
                     ('{"endpoint": "http://x:1"}', "endpoint must be"),
                     ('{"buffer_steps": 0}', "buffer_steps must be at least 1"), ("[1]", "JSON object")):
        with pytest.raises(ValueError, match=why):
            KVEventsConfig.from_json(bad)


def test_exposure_binding_and_per_worker_offsets() -> None:
    assert is_local("tcp://127.0.0.1:5557") and is_local("tcp://[::1]:5557") and is_local("ipc:///tmp/e")
    assert not is_local("tcp://*:5557") and not is_local("tcp://10.0.0.5:5557")
    assert binds("tcp://*:1") and binds("tcp://127.0.0.1:1") and binds("ipc:///tmp/e")
    assert not binds("tcp://10.0.0.5:1")  # another host: connect to its SUB, as vLLM does
    on = KVEventsConfig(True, endpoint="tcp://*:5557", replay_endpoint="tcp://127.0.0.1:5600")
    assert on.exposed == ["tcp://*:5557"]
    assert KVEventsConfig(False, endpoint="tcp://*:5557").exposed == []  # off: nothing is exposed
    w2 = on.for_worker(2)
    assert (w2.endpoint, w2.replay_endpoint) == ("tcp://*:5559", "tcp://127.0.0.1:5602")
    assert KVEventsConfig(True, endpoint="ipc:///tmp/ev").for_worker(1).endpoint == "ipc:///tmp/ev-1"


def test_block_manager_logs_runs_of_blocks_with_parents_tokens_and_evictions() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)  # 3 usable blocks
    log = bm.record_events()
    prompt = list(range(100, 109))  # 2 full blocks + 1 token
    bm.allocate_slots(1, len(prompt), 0)
    bm.cache_full_blocks(1, prompt, 4)  # block 0 computed first (chunked prefill) ...
    bm.cache_full_blocks(1, prompt, 9)  # ... then block 1: one run, parent chained
    events = log.drain()
    assert len(events) == 1 and isinstance(events[0], BlocksStored)
    stored = events[0]
    keys = prefix_block_keys(prompt, BS)
    assert stored.parent is None and stored.token_ids == prompt[:8] and len(stored.digests) == 2
    bm.free(1)
    other = list(range(500, 512))  # 3 blocks: evicts both cached ones
    bm.allocate_slots(2, len(other), 0)
    removed = log.drain()
    assert [type(e).__name__ for e in removed] == ["BlocksRemoved"]
    from pdserve.worker.vllm_events.wire import event_array

    assert sorted(event_array(removed[0], BS)[1]) == sorted(keys)
    bm.reset_prefix_cache()
    assert log.drain() == [AllCleared()]
    assert bm.check_integrity()


def _sub(endpoint: str, topic: bytes = b"") -> zmq.Socket[Any]:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, topic)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _joined(pub: KVEventPublisher, sub: zmq.Socket[Any], block_size: int) -> None:
    """Publish `AllBlocksCleared` probes until the subscriber gets one (a SUB that has just
    connected misses what was sent before its subscription reached the PUB)."""
    for _ in range(400):
        pub.publish([AllCleared()], block_size)
        if sub.poll(50):
            return
    raise AssertionError("the subscriber never joined")


def test_frames_decode_with_plain_msgpack_in_vllms_layout() -> None:
    port = free_port()
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}", topic="kv"))
    sub = _sub(pub.endpoint, b"kv")
    try:
        _joined(pub, sub, BS)
        bm = BlockManager(num_blocks=8, block_size=BS)
        log = bm.record_events()
        root = prefix_root("adapter-fp")
        prompt = list(range(1, 10))
        bm.allocate_slots(1, len(prompt), 0)
        bm.cache_full_blocks(1, prompt, 9, root)
        pub.publish(log.drain(), BS)
        assert pub.flush()
        last = pub.counts().published - 1  # the stored batch is the last one published
        seqs = []
        while True:  # the probes still on their way, then the stored batch
            assert sub.poll(10_000)
            topic, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            if seqs[-1] == last:
                break
        assert topic == b"kv" and seqs == sorted(set(seqs))  # numbered one after another
        ts, events, dp_rank = msgpack.unpackb(payload)
        assert isinstance(ts, float) and dp_rank == 0
        keys = prefix_block_keys(prompt, BS, root)
        from pdserve.common.block_hash import block_key

        assert events == [["BlockStored", keys, None, prompt[:8], BS, block_key(root), "GPU"]]
        assert keys != prefix_block_keys(prompt, BS, ROOT_DIGEST)  # an adapter's blocks are its own
    finally:
        sub.close()
        pub.close()


def test_replay_resends_buffered_batches_from_a_sequence_number() -> None:
    port, replay_port = free_port(), free_port()
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}",
                                          replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=3))
    # A DEALER speaks REQ's framing (empty delimiter, then the request) and may read the
    # many replies one request gets (a REQ socket takes only the first).
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    try:
        for _ in range(5):  # seq 0..4; the buffer keeps 2, 3, 4
            pub.publish([AllCleared()], BS)
        assert pub.flush()
        req.connect(pub.replay_endpoint or "")
        req.send_multipart((b"", (1).to_bytes(8, "big")))
        got = []
        while True:
            assert req.poll(10_000)
            delimiter, seq, payload = req.recv_multipart()
            assert delimiter == b""
            if seq == END_SEQ:
                assert payload == b""
                break
            got.append(int.from_bytes(seq, "big"))
            assert msgpack.unpackb(payload)[1] == [["AllBlocksCleared"]]
        assert got == [2, 3, 4]
        assert pub.counts().replayed == 3
    finally:
        req.close()
        pub.close()


def test_a_subscriber_that_never_reads_never_stalls_the_publisher() -> None:
    port = free_port()
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{port}", hwm=1))
    sub = _sub(pub.endpoint)
    sub.setsockopt(zmq.RCVHWM, 1)
    try:
        _joined(pub, sub, BS)
        big: list[BlockEvent] = [BlocksStored([bytes(32)] * 64, None, list(range(64 * BS)), ROOT_DIGEST)]
        for _ in range(2000):
            assert pub.publish(list(big), BS)  # never refused, never waits
        assert pub.flush(30.0)  # the thread sent (ZeroMQ dropped) them all: nothing waits on the reader
        assert pub.counts().published >= 2000
    finally:
        sub.close()
        pub.close()


class _StuckPublisher(KVEventPublisher):
    """A publisher thread that cannot keep up: it blocks on its first batch."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        super().__init__(config)

    def _send(self, batch: _Batch) -> None:
        self.entered.set()
        assert self.release.wait(30)
        super()._send(batch)


def test_a_full_queue_drops_a_batch_counted_and_numbered() -> None:
    pub = _StuckPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}", max_queue_size=2))
    try:
        assert pub.publish([AllCleared()], BS)  # seq 0: the thread takes it and sticks
        assert pub.entered.wait(10)
        assert pub.publish([AllCleared()], BS) and pub.publish([AllCleared()], BS)  # 1, 2 fill the queue
        assert not pub.publish([AllCleared()], BS)  # 3: dropped at once, not waited for
        assert pub.counts().dropped == 1
        pub.release.set()
        assert pub.flush()
        assert pub.publish([AllCleared()], BS)  # 4: the gap at 3 is what a subscriber sees
        assert pub.flush()
        assert [seq for seq, _ in pub._buffer] == [0, 1, 2, 4]
    finally:
        pub.release.set()
        pub.close()
