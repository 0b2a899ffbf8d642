"""A worker's control channels to every gateway replica.

`--gateway` takes `tcp://HOST:PORT` (one gateway) or `dns+tcp://NAME:PORT`: NAME
is resolved to all its A records (a Kubernetes headless Service lists every
gateway pod) and re-resolved every `resolve_every_s`, so replicas that come and
go are followed. Each gateway gets its own channel; the runtime registers and
heartbeats on each independently, and the node's replies go back on the channel
its request came from (origin is tracked per request id).

Routing invariants:
- A reply whose origin is unknown (never seen, evicted, or its gateway gone) is
  sent to every gateway; a gateway drops replies for request ids it does not
  hold, so this costs traffic, never correctness.
- A gateway that vanishes from DNS keeps its channel for `retire_grace_s` (it may
  be draining its streams: not-ready pods can leave the DNS answer); after that
  its channel closes and the requests it sent are handed back for abort.
- A failed lookup keeps the current set: a DNS blip never drops a live gateway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlparse

import zmq

from pdserve.common import protocol as p
from pdserve.common.transport import CurveClient, WorkerChannel

log = logging.getLogger(__name__)

DNS_SCHEME = "dns+tcp"
MAX_ORIGINS = 1 << 17  # request ids remembered; beyond it the oldest fall back to broadcast

Resolver = Callable[[str, int], list[str]]


def parse_gateway(text: str) -> str:
    """Validate one `--gateway` value (`tcp://HOST:PORT` or `dns+tcp://NAME:PORT`)."""
    url = urlparse(text)
    try:
        port = url.port
    except ValueError:
        port = None
    if (
        url.scheme not in ("tcp", DNS_SCHEME)
        or not url.hostname
        or not port
        or url.path not in ("", "/")
    ):
        raise ValueError(
            f"gateway address {text!r} is not tcp://HOST:PORT or {DNS_SCHEME}://NAME:PORT"
        )
    return text.rstrip("/")


def dns_a_records(name: str, port: int) -> list[str]:
    """Every IPv4 address `name` resolves to (all A records of a headless Service)."""
    infos = socket.getaddrinfo(name, port, socket.AF_INET, socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def resolve(spec: str, resolver: Resolver = dns_a_records) -> set[str] | None:
    """The tcp:// addresses `spec` stands for now; None when a lookup failed."""
    url = urlparse(spec)
    if url.scheme != DNS_SCHEME:
        return {spec}
    assert url.hostname and url.port
    try:
        return {f"tcp://{ip}:{url.port}" for ip in resolver(url.hostname, url.port)}
    except OSError as e:
        log.warning("resolving %s failed (%s); keeping the current gateways", spec, e)
        return None


def request_ids(msg: p.Message) -> list[str]:
    if isinstance(msg, p.TokenBatch):
        return [d.request_id for d in msg.deltas]
    rid = getattr(msg, "request_id", None)
    if isinstance(rid, str):
        return [rid]
    return list(getattr(msg, "request_ids", []) or [])


class GatewayLinks:
    """One `WorkerChannel` per gateway, from static and DNS `--gateway` specs.

    Single-threaded: the worker's main loop calls everything here (the heartbeat
    thread reads only `addresses`, a tuple replaced whole)."""

    def __init__(self, specs: Iterable[str], worker_id: str, curve: CurveClient | None = None,
                 resolve_every_s: float = 10.0, retire_grace_s: float = 120.0,
                 resolver: Resolver = dns_a_records) -> None:
        self.specs = tuple(parse_gateway(s) for s in specs)
        if not self.specs:
            raise ValueError("at least one gateway address is needed")
        self.worker_id = worker_id
        self.curve = curve
        self.resolve_every_s = resolve_every_s
        self.retire_grace_s = retire_grace_s
        self._resolver = resolver
        self._resolved: dict[str, set[str]] = {}  # spec -> addresses at its last good lookup
        self._channels: dict[str, WorkerChannel] = {}
        self._retiring: dict[str, float] = {}  # address -> when it vanished
        self._origin: dict[str, str] = {}  # request id -> gateway address (insertion ordered)
        self._poller = zmq.Poller()
        # Another thread's `wake` (a KV tier read landed) ends the loop's idle wait at once.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()
        self._poller.register(self._wake_fd, zmq.POLLIN)
        self.addresses: tuple[str, ...] = ()
        self._lookup_done = threading.Event()
        self._stop = threading.Event()
        self._resolve_all()
        self._lookups: threading.Thread | None = None
        if any(urlparse(s).scheme == DNS_SCHEME for s in self.specs):
            # Lookups block (a slow DNS server can take seconds): never in the engine loop.
            self._lookups = threading.Thread(
                target=self._resolve_loop, name="gateway-dns", daemon=True
            )
            self._lookups.start()

    def _resolve_all(self) -> None:
        resolved = dict(self._resolved)
        for spec in self.specs:
            found = resolve(spec, self._resolver)
            if found is not None:
                resolved[spec] = found
        self._resolved = resolved  # replaced whole: the main loop reads it without a lock
        self._lookup_done.set()

    def _resolve_loop(self) -> None:
        # Until a first gateway appears (e.g. workers started before the gateways), look every second.
        while not self._stop.wait(
            self.resolve_every_s if self.addresses else min(1.0, self.resolve_every_s)
        ):
            self._resolve_all()

    # --- membership --------------------------------------------------------

    def refresh(self, now: float | None = None) -> tuple[list[str], list[str]]:
        """After a lookup: open channels for new gateways, close long-vanished ones.

        Returns (new addresses, request ids orphaned by closed channels)."""
        now = time.monotonic() if now is None else now
        if not self._lookup_done.is_set() and not self._retiring:
            return [], []
        self._lookup_done.clear()
        wanted: set[str] = set().union(*self._resolved.values())
        added = sorted(wanted - set(self._channels))
        for addr in added:
            self._open(addr)
        for addr in wanted:
            self._retiring.pop(addr, None)
        orphaned: list[str] = []
        for addr in set(self._channels) - wanted:
            since = self._retiring.setdefault(addr, now)
            if now - since >= self.retire_grace_s:
                log.info("gateway %s is gone; closing its channel", addr)
                orphaned += self._close(addr)
        self.addresses = tuple(sorted(self._channels))
        return added, orphaned

    def _open(self, addr: str) -> None:
        log.info("connecting to gateway %s", addr)
        ch = WorkerChannel(addr, self.worker_id, self.curve)
        self._channels[addr] = ch
        self._poller.register(ch.socket, zmq.POLLIN)

    def _close(self, addr: str) -> list[str]:
        self._retiring.pop(addr, None)
        ch = self._channels.pop(addr)
        self._poller.unregister(ch.socket)
        ch.close()
        orphaned = [rid for rid, a in self._origin.items() if a == addr]
        for rid in orphaned:
            del self._origin[rid]
        return orphaned

    # --- traffic -----------------------------------------------------------

    def recv_all(self) -> list[tuple[str, p.Message]]:
        """Every message ready now, with the gateway it came from; origins recorded."""
        out: list[tuple[str, p.Message]] = []
        for addr, ch in list(self._channels.items()):
            for msg in ch.recv_all():
                if isinstance(msg, p.Abort):
                    for rid in msg.request_ids:
                        self._origin.pop(rid, None)
                elif not isinstance(msg, p.RegisterAck):
                    self._remember(request_ids(msg), addr)
                out.append((addr, msg))
        return out

    def _remember(self, rids: list[str], addr: str) -> None:
        for rid in rids:
            self._origin.pop(rid, None)
            self._origin[rid] = addr
        while len(self._origin) > MAX_ORIGINS:
            del self._origin[next(iter(self._origin))]

    def wait(self, timeout_ms: int) -> bool:
        """Block up to `timeout_ms` for a message on any channel or a `wake`; True if
        either came."""
        events = dict(self._poller.poll(timeout_ms))
        if self._wake_fd in events:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
        return bool(events)

    def wake(self) -> None:
        """From any thread: end the current (or the next) `wait` now (after `close`: nothing)."""
        with self._wake_lock:  # never a write to a closed (maybe reused) descriptor number
            if self._wake_fd >= 0:
                os.eventfd_write(self._wake_fd, 1)

    def send(self, msg: p.Message) -> None:
        """A node's reply: to the gateway its request came from (all when unknown)."""
        if isinstance(msg, p.TokenBatch):
            by_addr: dict[str | None, list[p.TokenDelta]] = {}
            for d in msg.deltas:
                by_addr.setdefault(self._origin_of(d.request_id), []).append(d)
            for addr, deltas in by_addr.items():
                self._send_or_broadcast(addr, p.TokenBatch(msg.worker_id, deltas))
            return
        rids = request_ids(msg)
        addr = self._origin_of(rids[0]) if rids else None
        if isinstance(msg, p.RequestFailed):
            self._origin.pop(msg.request_id, None)  # a failed attempt's id is never used again
        self._send_or_broadcast(addr, msg)

    def _origin_of(self, rid: str) -> str | None:
        addr = self._origin.get(rid)
        return addr if addr in self._channels else None

    def _send_or_broadcast(self, addr: str | None, msg: p.Message) -> None:
        if addr is not None:
            self._channels[addr].send(msg)
        else:
            self.broadcast(msg)

    def send_to(self, addr: str, msg: p.Message) -> None:
        ch = self._channels.get(addr)
        if ch is not None:
            ch.send(msg)

    def broadcast(self, msg: p.Message) -> None:
        for ch in self._channels.values():
            ch.send(msg)

    def close(self) -> None:
        self._stop.set()
        if self._lookups is not None:
            self._lookups.join(timeout=1)
        for addr in list(self._channels):
            self._close(addr)
        self.addresses = ()
        with self._wake_lock:
            if self._wake_fd >= 0:
                self._poller.unregister(self._wake_fd)
                os.close(self._wake_fd)
                self._wake_fd = -1
