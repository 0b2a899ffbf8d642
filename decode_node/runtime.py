"""The process shell shared by every worker role: control channel, registration,
heartbeats, the metrics server, and graceful SIGTERM.

The node (prefill, decode or colocated) supplies the work; the loop is:

    while running:
        handle every control message that arrived
        node.step()                     # one engine step, if there is work
        (idle: wait for a message, briefly)

Heartbeats go from a thread on their own socket (identity `<worker id>/hb`), so
a long engine step never makes a live worker look dead; the thread stops
heartbeating if the loop has not ticked for `stall_s` (a hung worker is
dropped and its requests recovered).

SIGTERM (or SIGINT) drains: the worker sends `Deregister(final=False)` so the
gateway stops routing to it, finishes what it holds, sends
`Deregister(final=True)` and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from decode_node.faults import FaultInjector, WorkerFaults
from decode_node.worker_metrics import MetricsServer, WorkerMetrics
from pdserve import protocol as p
from pdserve.transport import LOOPBACK, CurveClient, WorkerChannel, host_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeConfig:
    gateway: str  # the gateway's control address, e.g. tcp://127.0.0.1:5555
    worker_id: str
    metrics_host: str = LOOPBACK
    metrics_port: int = 0
    heartbeat_s: float = 0.5
    drain_timeout_s: float = 60.0
    idle_wait_ms: int = 5
    stall_s: float = 60.0  # loop silent this long: stop heartbeating
    curve: CurveClient | None = None


class NodeRegistration(NamedTuple):
    kv_address: str
    kv_shm: str
    compat_hash: str
    total_blocks: int
    block_size: int


class NodeLoad(NamedTuple):
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    running_seqs: int
    waiting_seqs: int


class Node(Protocol):
    role: str

    def registration(self) -> NodeRegistration: ...

    def handle(self, msg: p.Message) -> None: ...

    def step(self) -> bool:
        """Do one unit of work; False when there was nothing to do."""
        ...

    def load(self) -> NodeLoad: ...

    def busy(self) -> bool:
        """True while the node holds requests (draining waits for False)."""
        ...

    def close(self) -> None: ...


Sender = Callable[[p.Message], None]


class WorkerRuntime:
    def __init__(self, config: RuntimeConfig, channel: WorkerChannel, metrics: WorkerMetrics) -> None:
        self.config = config
        self.channel = channel
        self.metrics = metrics
        self._stop_requested = False
        self._last_tick = time.monotonic()
        self._hb_stop = threading.Event()
        self.faults = FaultInjector(WorkerFaults.from_env())
        self._registered_at = 0.0

    def request_stop(self, *_: Any) -> None:
        self._stop_requested = True

    def run(self, node: Node) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        server = MetricsServer(self.metrics, self.config.metrics_host, self.config.metrics_port,
                               health=lambda: not self._stop_requested)  # fmt: skip
        server.start()
        self._register(node, server.port)
        hb = threading.Thread(target=self._heartbeat_loop, args=(node,), name="heartbeat", daemon=True)
        hb.start()
        log.info("%s worker %s up; metrics on port %d", node.role, self.config.worker_id, server.port)
        try:
            self._serve(node, server.port)
            self._drain(node)
        finally:
            log.debug("stopping: heartbeats")
            self._hb_stop.set()
            hb.join(timeout=5)
            self.channel.send(p.Deregister(self.config.worker_id, final=True, reason="exit"))
            log.debug("stopping: node")
            node.close()
            log.debug("stopping: metrics server")
            server.close()
            self.channel.close()
            log.debug("stopped")
        return 0

    def _serve(self, node: Node, metrics_port: int) -> None:
        while not self._stop_requested:
            self._tick(node, metrics_port)

    def _drain(self, node: Node) -> None:
        self.channel.send(p.Deregister(self.config.worker_id, final=False, reason="draining"))
        deadline = time.monotonic() + self.config.drain_timeout_s
        while node.busy() and time.monotonic() < deadline:
            self._tick(node, 0)

    def _tick(self, node: Node, metrics_port: int) -> None:
        for msg in self.channel.recv_all():
            if isinstance(msg, p.RegisterAck):
                now = time.monotonic()
                if not msg.accepted and metrics_port and now - self._registered_at > 1.0:
                    log.warning("gateway does not know us (%s); registering again", msg.reason)
                    self._register(node, metrics_port)
            else:
                self.faults.on_message(msg)
                node.handle(msg)
        worked = node.step()
        self.faults.after_step(worked)
        self._last_tick = time.monotonic()
        if not worked:
            self.channel.wait(self.config.idle_wait_ms)

    def _register(self, node: Node, metrics_port: int) -> None:
        self._registered_at = time.monotonic()
        reg = node.registration()
        self.channel.send(p.RegisterWorker(
            self.config.worker_id, node.role, host_id(), reg.kv_address, reg.kv_shm,
            reg.compat_hash, reg.total_blocks, reg.block_size, metrics_port, os.getpid(),
        ))  # fmt: skip

    def _heartbeat_loop(self, node: Node) -> None:
        channel = WorkerChannel(self.config.gateway, f"{self.config.worker_id}/hb", self.config.curve, lossy=True)
        try:
            while not self._hb_stop.wait(self.config.heartbeat_s):
                if time.monotonic() - self._last_tick < self.config.stall_s:
                    channel.send(self._heartbeat(node))
                channel.recv_all()  # the gateway answers heartbeats only on the main socket
        finally:
            channel.close()

    def _heartbeat(self, node: Node) -> p.Heartbeat:
        load = node.load()
        m = self.metrics
        m.free_blocks.set(load.free_blocks)
        m.kv_usage.set((load.total_blocks - load.free_blocks) / max(load.total_blocks, 1))
        m.waiting.set(load.waiting_seqs)
        if node.role != "prefill":
            m.batch_size.set(load.running_seqs)
        return p.Heartbeat(self.config.worker_id, *load, gauges=m.gauges())
