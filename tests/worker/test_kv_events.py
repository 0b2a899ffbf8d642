"""A worker publishes its prefix-cache events to a gateway (pdserve/worker/kv_events.py): a
snapshot right after registering, then numbered batches each tick something changed,
a snapshot with the current number when the gateway asks, and a snapshot to everyone
when the cache was reset. Driven through the real runtime against a ROUTER socket
standing in for the gateway."""

from __future__ import annotations

import threading

import zmq

from pdserve.common import protocol as p
from pdserve.common.transport import free_port
from pdserve.engine.core.cache_events import CacheEvents
from pdserve.worker.gateways import GatewayLinks
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.runtime import RuntimeConfig, WorkerRuntime
from tests.worker.test_runtime_snapshot import ScriptedNode, run_in_main_thread


class CachingNode(ScriptedNode):
    """A node whose cache changes the test scripts (handed over under a lock)."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.pending: list[CacheEvents] = []
        self.keys: list[int] = []

    def cache_events(self) -> CacheEvents:
        with self.lock:
            return self.pending.pop(0) if self.pending else CacheEvents([], [])

    def cached_keys(self) -> list[int]:
        with self.lock:
            return list(self.keys)

    def change(self, events: CacheEvents, keys: list[int]) -> None:
        with self.lock:
            self.pending.append(events)
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
        node.change(CacheEvents([8, 9], []), [7, 8, 9])
        assert _next_kv(sock) == p.KvEvents("cache-test", 1, [8, 9], [])
        node.change(CacheEvents([], [7]), [8, 9])
        assert _next_kv(sock) == p.KvEvents("cache-test", 2, [], [7])
        sock.send_multipart([b"cache-test", p.encode(p.KvSnapshotRequest("cache-test"))])
        assert _next_kv(sock) == p.KvEvents("cache-test", 2, [8, 9], snapshot=True)
        node.change(CacheEvents([], [], reset=True), [])
        assert _next_kv(sock) == p.KvEvents("cache-test", 3, [], snapshot=True)

    try:
        run_in_main_thread(runtime, node, body)
    finally:
        sock.close(linger=0)
