"""In-process fake transport with the same interfaces as the real ones.

`FakeFabric` is an explicit in-process "network" (create one per test or per
process; there is no global registry). `FakeReceiver` and `fake_sender(...)`
run the real `ReceiverCore` and `Sender` state machines and the real wire
encoding, but messages are handed over by function call instead of sockets.
The conformance suite in tests/kv_transfer runs against it and the real
transports alike, so it cannot drift from them.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.faults import FaultConfig
from kv_transfer.links import DONE, InboxLink, Parts, Sent
from kv_transfer.pool.shm import ShmPool
from kv_transfer.receiver.core import CoreReceiver, ReceiverCore
from kv_transfer.sender.sender import Sender
from pdserve.common.kv_layout import KVLayout
from pdserve.common.parallel_layout import ParallelLayout

SCHEME = "fake://"


class FakeFabric:
    """Maps fake addresses to receivers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._receivers: dict[str, FakeReceiver] = {}
        self._ids = itertools.count(1)

    def register(self, receiver: FakeReceiver) -> str:
        with self._lock:
            address = f"{SCHEME}{next(self._ids)}"
            self._receivers[address] = receiver
            return address

    def unregister(self, address: str) -> None:
        with self._lock:
            self._receivers.pop(address, None)

    def lookup(self, endpoint: str) -> FakeReceiver | None:
        with self._lock:
            return self._receivers.get(endpoint)


class _FakeLink(InboxLink):
    _keys = itertools.count(1)

    def __init__(self, fabric: FakeFabric, endpoint: str, wake: Callable[[], None]) -> None:
        super().__init__()
        self.key = f"fake-link-{next(self._keys)}".encode()
        self.wake = wake
        self._fabric = fabric
        self._endpoint = endpoint

    def send(self, parts: Parts) -> Sent:
        receiver = self._fabric.lookup(self._endpoint)
        if receiver is not None:  # else: like a dead peer, the message is lost
            receiver._deliver(self, parts)  # synchronous: the frame is consumed on return
        return DONE

    def close(self) -> None:
        self.inbox.clear()


class FakeLinkFactory:
    def __init__(self, fabric: FakeFabric) -> None:
        self._fabric = fabric

    def open(self, endpoint: str, wake: Callable[[], None]) -> _FakeLink:
        if not endpoint.startswith(SCHEME):
            raise ValueError(f"fake links only reach {SCHEME} addresses, not {endpoint!r}")
        return _FakeLink(self._fabric, endpoint, wake)

    def close(self) -> None:
        pass


def fake_sender(layout: KVLayout, pool: np.ndarray, fabric: FakeFabric, **kwargs: Any) -> Sender:
    """A `Sender` whose links are in-process (same constructor options as the real one)."""
    return Sender(layout, pool, links=FakeLinkFactory(fabric), **kwargs)


class FakeReceiver(CoreReceiver):
    """Implements `kv_transfer.api.KVReceiver` without sockets or threads."""

    def __init__(self, layout: KVLayout, pool: np.ndarray | ShmPool, fabric: FakeFabric, *,
                 shared: bool = False, faults: FaultConfig | None = None, grace_s: float = 1.0,
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 parallel: ParallelLayout | None = None) -> None:
        array = pool.array if isinstance(pool, ShmPool) else pool
        shm = pool.descriptor if shared and isinstance(pool, ShmPool) else None
        self._links: dict[bytes, _FakeLink] = {}
        self.core = ReceiverCore(
            layout, array, shm=shm, grace_s=grace_s, max_frame_bytes=max_frame_bytes,
            faults=FaultConfig() if faults is None else faults, wake=self._route, parallel=parallel)
        self._fabric = fabric
        endpoint = fabric.register(self)
        self._address = ("shm+" if shm else "") + endpoint
        self._endpoint = endpoint

    def _deliver(self, link: _FakeLink, parts: Parts) -> None:
        """Called by a sender's I/O thread: the fake's 'network receive'."""
        self._links[link.key] = link
        frame = memoryview(parts[1]).cast("B") if len(parts) > 1 else None
        self.core.handle(link.key, bytes(parts[0]), frame)
        self._route()

    def _route(self) -> None:
        for peer, msg in self.core.take_outbox():
            link = self._links.get(peer)
            if link is not None:
                link.inbox.append([memoryview(wire.encode(msg))])
                link.wake()

    def poll(self, transfer_id: str) -> TransferState:
        self.core.tick()
        state = self.core.poll(transfer_id)
        self._route()
        return state

    def close(self) -> None:
        self._fabric.unregister(self._endpoint)
