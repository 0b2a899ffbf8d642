"""The process shell shared by every worker role: control channel, registration,
heartbeats, the metrics server, and graceful SIGTERM.

The node (prefill, decode or colocated) supplies the work; the loop is:

    while running:
        handle every control message that arrived
        node.step()                     # one engine step, if there is work
        (idle: wait for a message or a wake-up, briefly)

After every tick the loop publishes a `LoadSnapshot` (the node's load and the
worker's gauges, set right there), so `/metrics` is current at every scrape.
Heartbeats go from a thread on their own socket (identity `<worker id>/hb`), so
a long engine step never makes a live worker look dead; that thread only sends
the latest snapshot and never reads engine state. It stops heartbeating if the
loop has not ticked for `stall_s` (a hung worker is dropped and its requests
recovered). Each heartbeat lists the requests that arrived since the previous one
(pdserve/worker/arrivals.py), so the gateway knows which of its routed requests the load counts.

With several gateways (`--gateway` repeated, or a `dns+tcp://` name resolving to
every replica; see `pdserve.worker.gateways`) the worker registers and heartbeats with
each on its own channel, reports its total load to each, and sends every reply
back on the channel its request came from. After every tick it also broadcasts the
prefix-cache blocks stored and evicted (`KvEvents`, pdserve/worker/kv_events.py) for the
gateways' KV-aware routing. With `--kv-events-config` it also hands the tick's ordered
block events to the vLLM-format publisher (pdserve/worker/vllm_events/), which sends
them from its own thread: the step loop never waits on a subscriber. The same batch
carries, after the pool's, what the KV tiers' writer stored and evicted since
(`TierEventLog`, kv_transfer/tiers/events.py), each in its tier's medium.

`SwitchRole` flips the worker's role live (pdserve/worker/role_switch.py): drain, rebuild
the node for the other role, register again.

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_transfer.tiers import TierEventLog
from pdserve.common import protocol as p
from pdserve.common.hosts import LOOPBACK
from pdserve.common.roles import Role
from pdserve.common.transport import CurveClient, WorkerChannel, host_id, transport_kind
from pdserve.engine.core.block_events import AllCleared
from pdserve.worker.arrivals import ArrivalCursor, ArrivalLog, Arrivals
from pdserve.worker.faults import FaultInjector, WorkerFaults
from pdserve.worker.gateways import GatewayLinks
from pdserve.worker.kv_events import CachePublisher
from pdserve.worker.metrics import MetricsServer, WorkerMetrics
from pdserve.worker.node_api import Node, NodeLoad
from pdserve.worker.role_switch import RoleSwitcher, misrouted
from pdserve.worker.vllm_events.config import KVEventsConfig
from pdserve.worker.vllm_events.publisher import KVEventPublisher, PublisherCollector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RuntimeConfig:
    gateways: tuple[str, ...]  # control addresses: tcp://HOST:PORT or dns+tcp://NAME:PORT
    worker_id: str
    metrics_host: str = LOOPBACK
    metrics_port: int = 0
    heartbeat_s: float = 0.5
    drain_timeout_s: float = 60.0
    idle_wait_ms: int = 5
    stall_s: float = 60.0  # loop silent this long: stop heartbeating
    curve: CurveClient | None = None
    kv_events: KVEventsConfig | None = None  # vLLM-format KV events (None or disabled: none)


@dataclass(frozen=True)
class LoadSnapshot:
    """What the main loop last saw: handed to the heartbeat thread whole, never mutated."""

    load: NodeLoad
    gauges: Mapping[str, float]
    arrivals: Arrivals = Arrivals()  # the requests handed to the node before `load` was read


class WorkerRuntime:
    def __init__(self, config: RuntimeConfig, channel: GatewayLinks, metrics: WorkerMetrics,
                 faults: WorkerFaults | None = None, switcher: RoleSwitcher | None = None,
                 tier_events: TierEventLog | None = None) -> None:
        self.config = config
        self.tier_events = tier_events  # the KV tiers' writes and evictions (None: events off)
        self.switcher = switcher  # None: this worker keeps its role
        self._switch_to: Role | None = None  # a SwitchRole's role, acted on after the tick that read it
        self.channel = channel
        self.metrics = metrics
        self._stop_requested = False
        self._last_tick = time.monotonic()
        self._hb_stop = threading.Event()
        self.faults = FaultInjector(faults or WorkerFaults())  # none unless the worker was asked
        self._registered_at: dict[str, float] = {}  # gateway address -> last RegisterWorker
        self._snapshot: LoadSnapshot | None = None  # replaced (never mutated) by the main loop
        self.cache = CachePublisher(config.worker_id)
        self._arrivals = ArrivalLog()
        events = config.kv_events
        # Bound here, so a busy endpoint fails the worker's start.
        self.events = KVEventPublisher(events) if events is not None and events.enabled else None
        self._events_registry: Any = None  # the metrics registry that exports the publisher's counters

    def request_stop(self, *_: Any) -> None:
        self._stop_requested = True

    def run(self, node: Node) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        server = MetricsServer(self.metrics, self.config.metrics_host, self.config.metrics_port,
                               health=lambda: not self._stop_requested)
        server.start()
        self._follow_block_events(node)
        self._publish(node)
        self._follow_gateways(node, server.port)
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        log.info("%s worker %s up; metrics on port %d", node.role, self.config.worker_id, server.port)
        kv_address = node.registration().kv_address
        if kv_address:
            log.info("%s worker %s KV receiver on %s (%s)", node.role, self.config.worker_id, kv_address,
                     transport_kind(kv_address))
        self._server = server
        try:
            node = self._serve(node, server.port)
            self._drain(node)
        finally:
            log.debug("stopping: heartbeats")
            self._hb_stop.set()
            hb.join(timeout=5)
            self.channel.broadcast(p.Deregister(self.config.worker_id, final=True, reason="exit"))
            log.debug("stopping: node")
            node.close()
            log.debug("stopping: metrics server")
            server.close()
            if self.events is not None:
                self.events.close()
            self.channel.close()
            log.debug("stopped")
        return 0

    def _serve(self, node: Node, metrics_port: int) -> Node:
        while not self._stop_requested:
            self._tick(node, metrics_port)
            if self._switch_to:
                node = self._switch_role(node, metrics_port)
        return node

    def _switch_role(self, node: Node, metrics_port: int) -> Node:
        """Drain, rebuild the node as the asked role, register again (pdserve/worker/role_switch.py)."""
        role, self._switch_to = self._switch_to, None
        assert role is not None
        refusal = self.switcher.refusal(role) if self.switcher else None
        if refusal is None or not refusal.ok or role == node.role:
            if role != node.role:
                log.warning("not switching to %s: %s", role, refusal.reason if refusal else "no builders")
            return self._register_all(node, metrics_port)
        self.channel.broadcast(p.Deregister(self.config.worker_id, final=False, reason=f"switching to {role}"))
        deadline = time.monotonic() + self.config.drain_timeout_s
        while node.busy() and time.monotonic() < deadline and not self._stop_requested:
            self._tick(node, 0)
        if node.busy() or self._stop_requested:
            log.warning("not switching to %s: still busy after draining", role)
            return self._register_all(node, metrics_port)
        assert self.switcher is not None
        node = self.switcher.switch(node, role)
        if self.switcher.metrics is not None:  # the new role's metrics (role label)
            self.metrics = self._server.metrics = self.switcher.metrics
            self.metrics.role_flips.inc(self.switcher.flips)
        self._follow_block_events(node)
        return self._register_all(node, metrics_port)

    def _follow_block_events(self, node: Node) -> None:
        """Publish the (new) node's block events, starting from an empty pool: subscribers
        are told to forget what this endpoint held before (a restart, a role flip)."""
        if self.events is None:
            return
        self.events.publish([AllCleared()], node.block_event_log().block_size)
        if self.metrics.registry is not self._events_registry:  # a flip brings the new role's metrics
            self.metrics.registry.register(PublisherCollector(self.events, self.metrics.labels))
            self._events_registry = self.metrics.registry

    def _register_all(self, node: Node, metrics_port: int) -> Node:
        self._publish(node)
        for gateway in self.channel.addresses:
            self._register(node, metrics_port, gateway)
        return node

    def _drain(self, node: Node) -> None:
        self.channel.broadcast(p.Deregister(self.config.worker_id, final=False, reason="draining"))
        deadline = time.monotonic() + self.config.drain_timeout_s
        while node.busy() and time.monotonic() < deadline:
            self._tick(node, 0)

    def _tick(self, node: Node, metrics_port: int) -> None:
        self._follow_gateways(node, metrics_port)
        for gateway, msg in self.channel.recv_all():
            if isinstance(msg, p.RegisterAck):
                now = time.monotonic()
                if not msg.accepted and metrics_port and now - self._registered_at.get(gateway, 0.0) > 1.0:
                    log.warning("gateway %s does not know us (%s); registering again", gateway, msg.reason)
                    self._register(node, metrics_port, gateway)
            elif isinstance(msg, p.KvSnapshotRequest):
                self.channel.send_to(gateway, self.cache.snapshot(node))
            elif isinstance(msg, p.SwitchRole):
                self._switch_to = msg.role if msg.worker_id == self.config.worker_id else None
            elif (failed := misrouted(node.role, msg)) is not None:
                self.channel.send(failed)  # for the role this worker left: the gateway re-routes it
            else:
                self.faults.on_message(msg)
                if isinstance(msg, (p.DecodeReserve, p.PrefillRequest, p.RunRequest)):
                    self._arrivals.record(msg.request_id)
                node.handle(msg)
        worked = node.step()
        self.faults.after_step(worked)
        self._publish(node)
        self._publish_block_events(node)
        self._last_tick = time.monotonic()
        if not worked:
            self.channel.wait(self.config.idle_wait_ms)

    def _publish_block_events(self, node: Node) -> None:
        """The tick's block events, in order, to both feeds: netted to the gateways' KV
        index, as they are to vLLM-format subscribers, followed there by the tiers' writes
        and evictions. The pool's log is drained first: a block's tier write, offered after
        the step that registered it, lands in this batch or a later one, never before the
        pool's BlockStored (a block copied up from a lower tier is queued as its read
        lands, so its host-tier BlockStored may come first)."""
        log = node.block_event_log()
        events = log.drain()
        batch = self.cache.next_batch(node, events)
        if batch is not None:
            self.channel.broadcast(batch)
        if self.events is None:
            return
        tiers = self.tier_events.drain() if self.tier_events is not None else []
        if events or tiers:
            self.events.publish([*events, *tiers], log.block_size)

    def _follow_gateways(self, node: Node, metrics_port: int) -> None:
        """Register with gateways that appeared (not while draining); abort the requests
        of gateways gone for good."""
        added, orphaned = self.channel.refresh()
        for gateway in added if metrics_port else ():
            self._register(node, metrics_port, gateway)
        if orphaned:
            node.handle(p.Abort(orphaned, "gateway gone"))

    def _register(self, node: Node, metrics_port: int, gateway: str) -> None:
        self._registered_at[gateway] = time.monotonic()
        reg = node.registration()
        self.channel.send_to(gateway, p.RegisterWorker(
            self.config.worker_id, node.role, host_id(), reg.kv_address, reg.kv_shm,
            reg.compat_hash, reg.total_blocks, reg.block_size, metrics_port, os.getpid(),
            quantization=reg.quantization, kv_cache_dtype=reg.kv_cache_dtype,
            lm_head_quantization=reg.lm_head_quantization, kv_tiers=list(reg.kv_tiers) or None,
        ))
        self.channel.send_to(gateway, self.cache.snapshot(node))  # what the gateway's KV index starts from

    def _heartbeat_loop(self) -> None:
        """One lossy socket per gateway; each gets the worker's total load."""
        channels: dict[str, WorkerChannel] = {}
        cursor = ArrivalCursor()
        try:
            while not self._hb_stop.wait(self.config.heartbeat_s):
                self._sync_heartbeat_channels(channels)
                snap = self._snapshot
                if snap is not None and channels and time.monotonic() - self._last_tick < self.config.stall_s:
                    beat = self._heartbeat(snap, cursor)
                    for ch in channels.values():
                        ch.send(beat)
                for ch in channels.values():
                    ch.recv_all()  # the gateway answers heartbeats only on the main socket
        finally:
            for ch in channels.values():
                ch.close()

    def _sync_heartbeat_channels(self, channels: dict[str, WorkerChannel]) -> None:
        current = set(self.channel.addresses)
        for addr in set(channels) - current:
            channels.pop(addr).close()
        for addr in current - set(channels):
            channels[addr] = WorkerChannel(addr, f"{self.config.worker_id}/hb", self.config.curve, lossy=True)

    def _publish(self, node: Node) -> None:
        """Main loop only: read the node's load, set the gauges, hand the heartbeat thread a snapshot."""
        load = node.load()
        self.metrics.set_load(load)
        self._snapshot = LoadSnapshot(load, self.metrics.gauges(), self._arrivals.snapshot())

    def _heartbeat(self, snap: LoadSnapshot, cursor: ArrivalCursor) -> p.Heartbeat:
        """Heartbeat thread only: `snap` as a message, with the arrivals not yet reported."""
        load, report = snap.load, cursor.next_report(snap.arrivals)
        return p.Heartbeat(self.config.worker_id, load.queued_prefill_tokens, load.free_blocks, load.total_blocks,
                           load.running_seqs, load.waiting_seqs, gauges=dict(snap.gauges), steps=load.steps,
                           received=report.received, seq=report.seq, loras=list(load.loras) or None)
