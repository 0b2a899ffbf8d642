"""Prefill-side sender: one I/O thread drives every transfer over per-peer links.

The worker thread only registers work (`begin`, `send_layer`, `send_all`) and
reads state (`poll`); the I/O thread connects, handshakes, claims, gathers,
checksums and sends, so a `send_layer` call never waits on the network.

Peer address schemes: `tcp://`/`ipc://` ship tensor frames inline (zero-copy
sends); `shm+tcp://`/`shm+ipc://` copy blocks straight into the receiver's
shared-memory pool (advertised in its HelloAck) and send only control headers,
falling back to inline frames if the segment cannot be mapped. Any other
`scheme://` is handed to the link factory as is (the fake uses `fake://`).

Lease rule on this side: every read of the source pool and every write into a
peer's shared pool happens on the I/O thread *under the sender lock*, after
checking that the transfer is live and (for shared memory) that its write
deadline -- the earlier of our lease and the receiver's grant -- has not
passed. `poll`, `cancel` and lease expiry take the same lock, so once a
terminal state is visible no read of the source blocks is in progress or will
start: the worker may free them.

This module is the worker API and the I/O loop; the records live in
sender_state.py, chunk planning and production in sender_chunks.py, and what
the handshake and the receiver's replies do in sender_replies.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from kv_transfer import wire
from kv_transfer.api import TransferState, UnknownTransfer
from kv_transfer.faults import FaultConfig
from kv_transfer.links import LinkFactory, Parts, Waker
from kv_transfer.pool.blocks import check_block_ids, check_pool
from kv_transfer.pool.copy_threads import DEFAULT_COPY_THREADS, CopyThreads
from kv_transfer.pool.ops import pool_ops
from kv_transfer.pool.shm import LivenessLock
from kv_transfer.sender.chunks import ChunkMaker
from kv_transfer.sender.replies import accept_hello_ack, apply_reply
from kv_transfer.sender.state import PeerRecord, TransferRecord
from pdserve.common.kv_layout import KVLayout
from pdserve.common.parallel_layout import ParallelLayout

log = logging.getLogger(__name__)
DEFAULT_CHUNK_BYTES = 8 << 20
# A shared-memory chunk is a unit of verification (and of the write-deadline check).
# The receiver verifies chunk i while this side copies chunk i + 1; below ~8 MiB the
# two sides' memory traffic interferes more than it overlaps (bench/kv_transfer.py).
DEFAULT_SHM_CHUNK_BYTES = 16 << 20
DIRECT_PREFIXES = ("shm+", "cuda+")
IDLE_POLL_MS = 20
MAX_BYTES_PER_ROUND = 32 << 20  # bound one service round so replies are read promptly


class Sender:
    """Implements `kv_transfer.api.KVSender` over any `LinkFactory`."""

    def __init__(self, layout: KVLayout, pool: Any, *, links: LinkFactory,
                 faults: FaultConfig | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 shm_chunk_bytes: int = DEFAULT_SHM_CHUNK_BYTES,
                 copy_threads: int = DEFAULT_COPY_THREADS,
                 clock: Callable[[], float] = time.monotonic,
                 parallel: ParallelLayout | None = None) -> None:
        """`parallel`: this worker's rank layout, said in the handshake (None: not said)."""
        self.layout = layout
        self._compat = layout.compat_hash
        self._parallel = () if parallel is None else parallel.encode()
        # Helpers for the I/O thread's copies; each copy is complete before the I/O
        # thread goes on (and releases the lock), so the lease rule below still holds.
        self._copy = CopyThreads(copy_threads)
        # A device pool (anything but numpy) is handled through cupy, see cuda_ipc.py.
        self._ops = pool_ops(pool, self._copy)
        self.pool = self._ops.array
        self.num_blocks = check_pool(layout, self.pool)
        self.faults = FaultConfig() if faults is None else faults
        self._chunks = ChunkMaker(layout, self._ops, self._copy, self.faults,
                                  chunk_bytes=chunk_bytes, shm_chunk_bytes=shm_chunk_bytes,
                                  clock=clock)
        self._links = links
        self._clock = clock
        self._lock = threading.Lock()
        self._transfers: dict[str, TransferRecord] = {}
        # Forgotten transfers whose Abort the I/O thread has not sent yet: the receiver
        # holds their blocks until it hears that we stopped writing (or its lease ends).
        self._owed: dict[str, TransferRecord] = {}
        self._peers: dict[str, PeerRecord] = {}  # I/O thread only
        self._waker = Waker()
        # Held until close(): a same-host receiver sees its release when this process
        # has stopped writing for good (closed, or died).
        self._liveness = LivenessLock.create()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-sender-io", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- worker API
    def begin(self, transfer_id: str, request_id: str, peer_address: str,
              src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              lease_s: float) -> None:
        src = check_block_ids(src_block_ids, self.num_blocks, "src_block_ids")
        dst = check_block_ids(dst_block_ids, 1 << 31, "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        if not lease_s > 0:
            raise ValueError("lease_s must be positive")
        if "://" not in peer_address:
            raise ValueError(f"peer address {peer_address!r} has no scheme")
        with self._lock:
            if transfer_id in self._transfers:
                raise ValueError(f"transfer {transfer_id!r} already begun")
            self._transfers[transfer_id] = TransferRecord(
                transfer_id, request_id, peer_address, src, dst, self._clock() + lease_s)
        self._waker.wake()

    def send_layer(self, transfer_id: str, layer: int, ready: Any = None) -> None:
        """`ready`: for a device pool, an event the compute stream recorded after writing
        layer `layer` (the copy waits for it on the device; None: already written)."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        self._queue(transfer_id, layer, layer + 1, ready)

    def send_all(self, transfer_id: str, ready: Any = None) -> None:
        self._queue(transfer_id, 0, self.layout.num_layers, ready)

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            t = self._get(transfer_id)
            t.expire(self._clock())
            return t.visible_state

    def reason(self, transfer_id: str) -> str:
        with self._lock:
            return self._get(transfer_id).reason

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            t = self._get(transfer_id)
            if not t.state.terminal:
                t.end(TransferState.ABORTED, "cancelled by sender")
        self._waker.wake()

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            t = self._get(transfer_id)
            t.expire(self._clock())
            if not t.visible_state.terminal:
                raise ValueError(f"transfer {transfer_id!r} is {t.visible_state.name}; cancel it first")
            del self._transfers[transfer_id]
            if t.abort_pending:
                self._owed[transfer_id] = t
        self._waker.wake()

    def close(self) -> None:
        """Stop the I/O thread; live transfers are aborted (peers are told, best effort)."""
        if self._stop.is_set():
            return
        with self._lock:
            for t in self._transfers.values():
                if not t.state.terminal:
                    t.end(TransferState.ABORTED, "sender closed")
        self._stop.set()
        self._waker.wake()
        self._thread.join()
        if self._liveness is not None:
            self._liveness.close()  # after the I/O thread, which does every write
        self._copy.close()
        self._waker.close()
        self._links.close()

    @property
    def staged_bytes(self) -> int:
        """Bytes a device pool sent through host staging buffers (0 for a host pool)."""
        return int(getattr(self._ops, "staged_bytes", 0))

    @property
    def chunk_bytes(self) -> int:
        return self._chunks.chunk_bytes

    @property
    def shm_chunk_bytes(self) -> int:
        return self._chunks.shm_chunk_bytes

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- shared helpers
    def _queue(self, transfer_id: str, l0: int, l1: int, ready: Any) -> None:
        with self._lock:
            t = self._get(transfer_id)
            if t.state.terminal:
                return  # a failed transfer swallows further layers; the worker sees it in poll
            t.pending_layers.append((l0, l1, ready))
        self._waker.wake()

    def _get(self, transfer_id: str) -> TransferRecord:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise UnknownTransfer(transfer_id)
        return t

    # ---------------------------------------------------------------- I/O thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._waker.fileno(), zmq.POLLIN)
        busy = False
        try:
            while not self._stop.is_set():
                for peer in self._peers.values():
                    if peer.link.socket is not None:
                        flags = zmq.POLLIN | (zmq.POLLOUT if peer.blocked else 0)
                        poller.register(peer.link.socket, flags)
                poller.poll(0 if busy else IDLE_POLL_MS)
                self._waker.drain()
                try:
                    for peer in list(self._peers.values()):
                        while (parts := peer.link.recv()) is not None:
                            self._on_reply(peer, parts)
                    busy = self._service()
                except Exception:  # a bug must not kill the I/O thread: leases still run
                    log.exception("kv sender: I/O round failed")
                    busy = False
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._service_control()
        for peer in self._peers.values():
            self._flush_control(peer)
            peer.link.close()
            if peer.direct is not None:
                peer.direct.close()

    def _service(self) -> bool:
        """One round of work; True if data is still waiting to be sent."""
        self._service_control()
        busy = False
        for peer in self._peers.values():
            if self._flush_control(peer) and peer.ready:
                busy |= self._flush_data(peer)
        return busy

    def _service_control(self) -> None:
        now = self._clock()
        with self._lock:
            transfers = list(self._transfers.values())
            for t in transfers:
                t.expire(now)
            transfers += self._owed.values()
            self._owed.clear()
            lapsed = {t.peer for t in transfers if t.lapsed}
            for t in transfers:
                t.lapsed = False
        for t in transfers:
            if t.state.terminal and not t.abort_pending:
                continue  # nothing left to say about it; never reconnect for it
            peer = self._peers.get(t.peer) or self._open_peer(t)
            if peer is None:
                continue
            with self._lock:
                if t.abort_pending:
                    t.abort_pending = False
                    peer.control.append([wire.encode(wire.Abort(t.transfer_id, t.reason))])
                if t.state.terminal:
                    continue
                if peer.refused:
                    t.end(TransferState.FAILED, peer.refused)
                elif peer.ready and not t.claim_sent:
                    t.claim_sent = True
                    peer.control.append([wire.encode(wire.Claim(
                        t.transfer_id, t.request_id, self._compat, t.dst_ids))])
                elif t.granted:
                    self._chunks.plan(peer, t)
        self._drop_lapsed_peers(lapsed)

    def _drop_lapsed_peers(self, lapsed: set[str]) -> None:
        """A peer whose transfer ran out of lease (no ack: the decode worker may be dead)
        and that has nothing else live is closed now -- its mapped pool (shared memory or
        CUDA IPC) included, which would otherwise stay mapped until this sender closes.
        A later transfer to the same address reconnects and maps it afresh."""
        for address in lapsed:
            peer = self._peers.get(address)
            if peer is None or peer.direct is None:
                continue
            with self._lock:
                if any(t.peer == address and (not t.state.terminal or t.copying)
                       for t in self._transfers.values()):
                    continue
            self._flush_control(peer)  # the Aborts of the lapsed transfers, best effort
            del self._peers[address]
            peer.link.close()
            peer.direct_ops = None  # its views of the mapping go first
            peer.direct.close()
            peer.direct = None
            log.info("kv sender: closed the mapped pool of %s (lease lapsed)", address)

    def _open_peer(self, t: TransferRecord) -> PeerRecord | None:
        want_direct = t.peer.startswith(DIRECT_PREFIXES)
        endpoint = t.peer.split("+", 1)[1] if want_direct else t.peer
        try:
            link = self._links.open(endpoint, self._waker.wake)
        except (ValueError, zmq.ZMQError) as exc:
            with self._lock:
                if not t.state.terminal:
                    t.end(TransferState.FAILED, f"cannot connect to {t.peer}: {exc}")
                    t.abort_pending = False
            return None
        peer = PeerRecord(t.peer, link, want_direct)
        liveness = self._liveness.name if want_direct and self._liveness is not None else ""
        peer.control.append([wire.encode(wire.Hello(self._compat, liveness, self._parallel))])
        self._peers[t.peer] = peer
        return peer

    def _flush_control(self, peer: PeerRecord) -> bool:
        """Send queued control messages; False while the link would block."""
        if peer.blocked is not None and not self._send(peer, *peer.blocked):
            return False
        while peer.control:
            if peer.link.send(peer.control[0]) is None:
                return False
            peer.control.popleft()
        return True

    def _send(self, peer: PeerRecord, parts: Parts, buffer: np.ndarray | None) -> bool:
        """Send one message, keeping it as `peer.blocked` if the link would block."""
        sent = peer.link.send(parts)
        if sent is None:
            peer.blocked = (parts, buffer)
            return False
        peer.blocked = None
        if buffer is not None:
            self._chunks.staging.give(buffer, sent)
        return True

    def _flush_data(self, peer: PeerRecord) -> bool:
        """Round-robin one chunk per transfer until the link blocks or the round is full."""
        sent = 0
        while sent < MAX_BYTES_PER_ROUND:
            with self._lock:
                ready = [t for t in self._transfers.values()
                         if t.peer == peer.address and t.spans and not t.state.terminal]
            if not ready:
                return False
            for t in ready:
                if self.faults.delay_s:
                    time.sleep(self.faults.delay_s)  # never under the lock
                made = self._chunks.produce(self._lock, peer, t)
                if made is None:
                    continue
                sent += made.buffer.nbytes if made.buffer is not None else self.shm_chunk_bytes
                if not self._send(peer, made.parts, made.buffer):
                    return False
        return True

    def _on_reply(self, peer: PeerRecord, parts: list[memoryview]) -> None:
        try:
            msg = wire.decode(parts[0])
        except wire.WireError:
            return  # a broken receiver: its transfers fail at their deadline
        if isinstance(msg, wire.HelloAck):
            accept_hello_ack(peer, msg, self.layout, self._ops.on_device)
        elif isinstance(msg, (wire.Grant, wire.Ack, wire.Cancel)):
            with self._lock:
                t = self._transfers.get(msg.transfer_id)
                apply_reply(peer, msg, t, msg.transfer_id in self._owed)
