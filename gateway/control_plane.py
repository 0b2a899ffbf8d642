"""The gateway's control plane: the ZeroMQ ROUTER socket workers connect to, the
worker registry it feeds, and the registry views the HTTP layer reads.

`ControlPlane` binds the socket (CURVE when configured), answers `RegisterWorker`,
records `Heartbeat`s, handles `Deregister` (draining, then gone), expires silent
workers and marks stalled ones (heartbeating, holding work, step counter standing
still for `stall_timeout_s`: listed as unhealthy, not routed), and keeps the KV index
(gateway/kv_index.py) from each worker's `KvEvents`, asking a worker whose batches
show a gap for a snapshot. It knows nothing
about requests: it hands each worker event for a request, and each worker that
left, to the `WorkerEvents` it was built with (the gateway's flight table,
gateway/flights.py). The request flow itself lives in gateway/cluster.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zmq
import zmq.asyncio

from gateway.backend import (
    FleetSample,
    ReadyState,
)
from gateway.kv_index import KvIndex
from gateway.kv_router import RouterConfig
from gateway.registry import WorkerInfo, WorkerRegistry
from pdserve.common import protocol as p
from pdserve.common.hosts import LOOPBACK
from pdserve.common.roles import Role
from pdserve.common.transport import (
    CurveServer,
    ZapLog,
    apply_curve_server,
    limit_incoming,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    control_host: str = LOOPBACK
    control_port: int = 0  # 0: a free port, see ControlPlane.control_address
    heartbeat_timeout_s: float = 3.0
    stall_timeout_s: float = 30.0  # holding work without a step this long: stalled; 0 disables
    max_recoveries: int = 3
    reserve_timeout_s: float = 10.0
    reserve_retry_s: float = 0.05  # a full decode worker is retried after this
    no_worker_wait_s: float = 0.0  # how long to wait for an empty pool to fill
    curve: CurveServer | None = None  # encrypt and authenticate the control plane
    # Keys the seeds the gateway gives unseeded requests (gateway/cluster.py); None: a
    # random key per process. Set only where a test must reproduce a sampled run.
    seed_key: bytes | None = None
    router: str = "kv-aware"  # kv-aware | least-loaded | round-robin (gateway/kv_router.py)
    local_prefill_threshold: int = 0  # uncached tokens a decode worker prefills itself; 0: off

    def __post_init__(self) -> None:
        if self.stall_timeout_s < 0:
            raise ValueError("stall_timeout_s must be >= 0 (0 disables stall detection)")
        if self.seed_key is not None and not 1 <= len(self.seed_key) <= 64:
            raise ValueError("seed_key must be 1 to 64 bytes")
        RouterConfig(self.router, self.local_prefill_threshold)  # refuses a bad router now

    @property
    def router_config(self) -> RouterConfig:
        return RouterConfig(self.router, self.local_prefill_threshold)


class WorkerEvents(Protocol):
    """Where the control plane sends what concerns requests."""

    def deliver(self, sender: str, wid: str, event: Any) -> None:
        """Worker `sender`'s event for worker-side request id `wid`."""
        ...

    def lost(self, w: WorkerInfo | None) -> None:
        """`w` left the registry (expired or deregistered for good) or stalled: its
        requests must go elsewhere."""
        ...


class ControlPlane:
    """Socket loop and registry; request events go to `events`."""

    def __init__(self, config: ClusterConfig, events: WorkerEvents) -> None:
        self.config = config
        self.events = events
        self.registry = WorkerRegistry(self.config.heartbeat_timeout_s)
        self.kv_index = KvIndex()  # every worker's prefix cache, from its KvEvents
        self.role_flips: dict[tuple[str, str], int] = {}  # (from role, to role) -> completed flips
        self.control_address = ""
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._auth: Any = None

    # --- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        if self._sock is not None:
            return
        ctx = zmq.asyncio.Context.instance()
        curve = self.config.curve
        if curve is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._auth = AsyncioAuthenticator(ctx, log=ZapLog(logging.getLogger("pdserve.control"), {}))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=curve.authorized_keys_dir)
        sock = ctx.socket(zmq.ROUTER)
        if curve is not None:
            apply_curve_server(sock, curve)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        limit_incoming(sock, p.MAX_MESSAGE_BYTES)
        host, port = self.config.control_host, self.config.control_port
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.control_address = f"tcp://{host}:{port}"
        self._sock = sock
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._reap_loop())]
        log.info("control plane listening on %s", self.control_address)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # --- registry views ----------------------------------------------------

    def mode(self) -> str | None:
        if self.registry.pool(Role.PREFILL) and self.registry.pool(Role.DECODE):
            return "disagg"
        if self.registry.pool(Role.COLOCATED):
            return "colocated"
        return None

    def ready(self) -> ReadyState:
        detail: dict[str, Any] = {r: len(self.registry.pool(r)) for r in p.ROLES}
        detail["stalled"] = sorted(w.worker_id for w in self.registry.all() if w.stalled)
        if self.mode() is None:
            return ReadyState(False, "need a prefill and a decode worker, or a colocated one", detail)
        return ReadyState(True, "", detail)

    def workers(self) -> Sequence[Mapping[str, Any]]:
        now = time.monotonic()
        return [w.describe(now) | {"kv_index_blocks": self.kv_index.num_blocks(w.worker_id)}
                for w in self.registry.all()]

    def fleet_metrics(self) -> Sequence[FleetSample]:
        out: list[FleetSample] = []
        for w in self.registry.all():
            labels = {"role": w.role, "worker": w.worker_id}
            hb = w.load
            total = hb.total_blocks if hb else w.reg.total_blocks
            free = hb.free_blocks if hb else total
            usage = (total - free) / total if total else 0.0
            out.append(FleetSample("llm_kv_cache_usage_ratio", "KV cache usage (0-1)", labels, usage))
            if w.role != Role.PREFILL:
                running = float(hb.running_seqs) if hb else 0.0
                out.append(FleetSample("llm_current_batch_size", "Running sequences", labels, running))
            for name, value in sorted((hb.gauges if hb else {}).items()):
                if name.startswith("llm_") and name not in ("llm_kv_cache_usage_ratio", "llm_current_batch_size"):
                    out.append(FleetSample(name, "Worker-reported gauge", labels, float(value)))
        return out

    # --- socket loops ------------------------------------------------------

    def send(self, worker_id: str, msg: p.Message) -> None:
        if self._sock is None or not worker_id:
            return
        try:
            sent = self._sock.send_multipart([worker_id.encode(), p.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # unroutable: the worker is gone; the reaper recovers
            log.debug("send to %s failed: %s", worker_id, e)
            return
        # zmq.asyncio reports a failed send (ROUTER_MANDATORY: host unreachable) through
        # the returned future rather than raising; read it so it is handled, not lost.
        if isinstance(sent, asyncio.Future):
            sent.add_done_callback(functools.partial(_log_send_failure, worker_id))

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                continue
            sender = frames[0].decode(errors="replace")
            try:
                msg = p.decode(frames[1])
            except p.ProtocolError as e:
                log.warning("dropped malformed frame from %r: %s", sender[:64], e)
                continue
            self._handle(sender, msg)

    def _handle(self, sender: str, msg: p.Message) -> None:
        now = time.monotonic()
        if isinstance(msg, p.RegisterWorker):
            old = self.registry.get(msg.worker_id)
            outcome = self.registry.register(msg, now) if msg.worker_id == sender else None
            accepted = bool(outcome and outcome.accepted)
            reason = outcome.reason if outcome else "worker id does not match the connection"
            if accepted:
                log.info("worker %s (%s) registered", msg.worker_id, msg.role)
                if old is not None and old.role != msg.role:  # a live role flip completed
                    key = (old.role, msg.role)
                    self.role_flips[key] = self.role_flips.get(key, 0) + 1
                self.kv_index.reset_worker(msg.worker_id, now)
                self.kv_index.tiers.attach(msg.worker_id, msg.host_id, msg.compat_hash, msg.kv_tiers or [])
            else:
                log.warning("refused worker %s: %s", sender, reason)
            self.send(sender, p.RegisterAck(msg.worker_id, accepted, reason))
        elif isinstance(msg, p.Heartbeat):
            # Heartbeats come from the worker's own heartbeat socket, `<worker id>/hb`.
            if sender not in (msg.worker_id, f"{msg.worker_id}/hb"):
                return
            if not self.registry.heartbeat(msg, now):
                self.send(msg.worker_id, p.RegisterAck(msg.worker_id, False, "unknown worker"))
        elif isinstance(msg, p.Deregister):
            self._deregister(sender, msg)
        elif isinstance(msg, p.KvEvents):
            if sender == msg.worker_id and self.kv_index.apply(msg, now):
                log.info("worker %s: gap in its KV events; asking for a snapshot", sender)
                self.send(sender, p.KvSnapshotRequest(sender))
        elif isinstance(msg, p.TokenBatch):
            self.registry.touch(sender, now)
            for d in msg.deltas:
                self.events.deliver(sender, d.request_id, d)
        elif isinstance(msg, (p.ReserveResult, p.FirstToken, p.RequestFailed)):
            self.registry.touch(sender, now)
            self.events.deliver(sender, msg.request_id, msg)

    def _deregister(self, sender: str, msg: p.Deregister) -> None:
        w = self.registry.get(sender)
        if w is None:
            return
        if msg.final:
            self.kv_index.drop_worker(sender)
            self.events.lost(self.registry.remove(sender))
        else:
            w.draining = True  # routable no more; in-flight requests still finish there

    async def _reap_loop(self) -> None:
        interval = max(0.05, self.config.heartbeat_timeout_s / 6)
        last = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            stalled, last = now - last > self.config.heartbeat_timeout_s / 2, now
            if stalled:
                # This loop was starved: heartbeats may be queued unread, so silence
                # proves nothing yet. Give the receive loop a round to catch up.
                continue
            for w in self.registry.expire(now):
                self.kv_index.drop_worker(w.worker_id)
                self.events.lost(w)
            if self.config.stall_timeout_s > 0:
                for w in self.registry.find_stalled(now, self.config.stall_timeout_s):
                    log.warning("worker %s (%s) stalled: holds work, no engine step for %.1f s",
                                w.worker_id, w.role, now - w.progress_at)
                    self.events.lost(w)


def _log_send_failure(worker_id: str, fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("send to %s failed: %s", worker_id, fut.exception())
