"""A worker publishes its prefix-cache events to a gateway (pdserve/worker/kv_events.py): a
snapshot right after registering, then numbered batches each tick something changed,
a snapshot with the current number when the gateway asks, and a snapshot to everyone
when the cache was reset. Driven through the real runtime against a ROUTER socket
standing in for the gateway."""

from __future__ import annotations

import threading

import zmq

from pdserve.common import protocol as p
from pdserve.common.block_hash import ROOT_DIGEST
from pdserve.common.hosts import free_port
from pdserve.engine.core.block_events import (
    AllCleared,
    BlockEvent,
    BlockEventLog,
    BlocksRemoved,
    BlocksStored,
)
from pdserve.worker.gateways import GatewayLinks
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.runtime import RuntimeConfig, WorkerRuntime
from tests.worker.test_runtime_snapshot import ScriptedNode, run_in_main_thread


def _digest(key: int) -> bytes:
    """A block digest whose control-plane key (`block_key`) is `key`."""
    return (key << 1).to_bytes(8, "big") + bytes(24)


class LockedLog(BlockEventLog):
    """A block event log the test thread appends to while the runtime drains it."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(16)
        self.lock = lock

    def drain(self) -> list[BlockEvent]:
        with self.lock:
            return super().drain()


class CachingNode(ScriptedNode):
    """A node whose cache changes the test scripts (handed over under a lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.log = LockedLog(self.lock)
        self.keys: list[int] = []

    def cached_keys(self) -> list[int]:
        with self.lock:
            return list(self.keys)

    def change(self, events: list[BlockEvent], keys: list[int]) -> None:
        with self.lock:
            self.log.events.extend(events)
            self.keys = keys


def _next_kv(sock: zmq.Socket[bytes]) -> p.KvEvents:
    """The next KvEvents the worker sent (registration and other traffic skipped)."""
    while True:
        assert sock.poll(20_000), "the worker sent nothing"
        ident, frame = sock.recv_multipart()
        assert ident == b"cache-test"
        msg = p.decode(frame)
        if isinstance(msg, p.KvEvents):
            return msg


def test_snapshot_on_register_then_numbered_batches_and_snapshots_on_request() -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    gateway = f"tcp://127.0.0.1:{port}"
    config = RuntimeConfig((gateway,), "cache-test", metrics_port=free_port(), heartbeat_s=3600.0)
    runtime = WorkerRuntime(config, GatewayLinks((gateway,), "cache-test"), WorkerMetrics("prefill", "cache-test"))
    node = CachingNode()
    node.keys = [7]

    def body() -> None:
        assert _next_kv(sock) == p.KvEvents("cache-test", 0, [7], snapshot=True)
        node.change([BlocksStored([_digest(8), _digest(9)], None, list(range(32)), ROOT_DIGEST)], [7, 8, 9])
        assert _next_kv(sock) == p.KvEvents("cache-test", 1, [8, 9], [])
        # one tick's changes netted per key: 6, stored and removed again, goes out as removed
        node.change([BlocksRemoved([_digest(7)]), BlocksStored([_digest(6)], None, [0] * 16, ROOT_DIGEST),
                     BlocksRemoved([_digest(6)])], [8, 9])
        assert _next_kv(sock) == p.KvEvents("cache-test", 2, [], [7, 6])
        sock.send_multipart([b"cache-test", p.encode(p.KvSnapshotRequest("cache-test"))])
        assert _next_kv(sock) == p.KvEvents("cache-test", 2, [8, 9], snapshot=True)
        node.change([AllCleared()], [])
        assert _next_kv(sock) == p.KvEvents("cache-test", 3, [], snapshot=True)

    try:
        run_in_main_thread(runtime, node, body)
    finally:
        sock.close(linger=0)
