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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from common.kv_layout import KVLayout
from kv_transfer import wire
from kv_transfer.api import TransferState, UnknownTransfer
from kv_transfer.blocks import (
    check_block_ids,
    check_pool,
    frame_nbytes,
    gather_with_sums,
    plan_chunks,
)
from kv_transfer.checksum import digest
from kv_transfer.copy_threads import DEFAULT_COPY_THREADS, CopyThreads
from kv_transfer.faults import FaultConfig
from kv_transfer.links import LinkFactory, Parts, StagingBuffers, Waker
from kv_transfer.pool_ops import pool_ops
from kv_transfer.sender_state import PeerRecord, TransferRecord, attach_direct
from kv_transfer.shm_pool import LivenessLock

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
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self._compat = layout.compat_hash
        # Helpers for the I/O thread's copies; each copy is complete before the I/O
        # thread goes on (and releases the lock), so the lease rule below still holds.
        self._copy = CopyThreads(copy_threads)
        # A device pool (anything but numpy) is handled through cupy, see cuda_ipc.py.
        self._ops = pool_ops(pool, self._copy)
        self.pool = self._ops.array
        self.num_blocks = check_pool(layout, self.pool)
        self.faults = FaultConfig() if faults is None else faults
        self.chunk_bytes = chunk_bytes
        self.shm_chunk_bytes = shm_chunk_bytes
        self._links = links
        self._clock = clock
        self._lock = threading.Lock()
        self._transfers: dict[str, TransferRecord] = {}
        # Forgotten transfers whose Abort the I/O thread has not sent yet: the receiver
        # holds their blocks until it hears that we stopped writing (or its lease ends).
        self._owed: dict[str, TransferRecord] = {}
        self._peers: dict[str, PeerRecord] = {}  # I/O thread only
        self._chunks_made = 0  # I/O thread only; numbers chunks for fault injection
        self._staging = StagingBuffers()  # I/O thread only
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

    def send_layer(self, transfer_id: str, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        self._queue(transfer_id, layer, layer + 1)

    def send_all(self, transfer_id: str) -> None:
        self._queue(transfer_id, 0, self.layout.num_layers)

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            t = self._get(transfer_id)
            self._expire(t, self._clock())
            return t.state

    def reason(self, transfer_id: str) -> str:
        with self._lock:
            return self._get(transfer_id).reason

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            t = self._get(transfer_id)
            if not t.state.terminal:
                self._end(t, TransferState.ABORTED, "cancelled by sender")
        self._waker.wake()

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            t = self._get(transfer_id)
            self._expire(t, self._clock())
            if not t.state.terminal:
                raise ValueError(f"transfer {transfer_id!r} is {t.state.name}; cancel it first")
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
                    self._end(t, TransferState.ABORTED, "sender closed")
        self._stop.set()
        self._waker.wake()
        self._thread.join()
        if self._liveness is not None:
            self._liveness.close()  # after the I/O thread, which does every write
        self._copy.close()
        self._waker.close()
        self._links.close()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- shared helpers
    def _queue(self, transfer_id: str, l0: int, l1: int) -> None:
        with self._lock:
            t = self._get(transfer_id)
            if t.state.terminal:
                return  # a failed transfer swallows further layers; the worker sees it in poll
            t.pending_layers.append((l0, l1))
        self._waker.wake()

    def _get(self, transfer_id: str) -> TransferRecord:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise UnknownTransfer(transfer_id)
        return t

    def _end(self, t: TransferRecord, state: TransferState, reason: str) -> None:
        """Caller holds the lock. A non-COMPLETE end tells the receiver we stopped writing."""
        t.state, t.reason = state, reason
        t.spans.clear()
        t.pending_layers.clear()
        t.abort_pending = state is not TransferState.COMPLETE

    def _expire(self, t: TransferRecord, now: float) -> None:
        if not t.state.terminal and now >= t.deadline:
            self._end(t, TransferState.FAILED, "no ack from the receiver before the lease deadline")

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
                self._expire(t, now)
            transfers += self._owed.values()
            self._owed.clear()
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
                    self._end(t, TransferState.FAILED, peer.refused)
                elif peer.ready and not t.claim_sent:
                    t.claim_sent = True
                    peer.control.append([wire.encode(wire.Claim(
                        t.transfer_id, t.request_id, self._compat, t.dst_ids))])
                elif t.granted:
                    direct = peer.direct_ops is not None
                    limit = min(self.shm_chunk_bytes if direct else self.chunk_bytes,
                                peer.max_frame)
                    while t.pending_layers:
                        l0, l1 = t.pending_layers.popleft()
                        t.spans.extend(plan_chunks(self.layout, len(t.src_ids), l0, l1, limit))

    def _open_peer(self, t: TransferRecord) -> PeerRecord | None:
        want_direct = t.peer.startswith(DIRECT_PREFIXES)
        endpoint = t.peer.split("+", 1)[1] if want_direct else t.peer
        try:
            link = self._links.open(endpoint, self._waker.wake)
        except (ValueError, zmq.ZMQError) as exc:
            with self._lock:
                if not t.state.terminal:
                    self._end(t, TransferState.FAILED, f"cannot connect to {t.peer}: {exc}")
                    t.abort_pending = False
            return None
        peer = PeerRecord(t.peer, link, want_direct)
        liveness = self._liveness.name if want_direct and self._liveness is not None else ""
        peer.control.append([wire.encode(wire.Hello(self._compat, liveness))])
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
            self._staging.give(buffer, sent)
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
                made = self._make_chunk(peer, t)
                if made is None:
                    continue
                parts, buffer = made
                sent += buffer.nbytes if buffer is not None else self.shm_chunk_bytes
                if not self._send(peer, parts, buffer):
                    return False
        return True

    def _make_chunk(self, peer: PeerRecord, t: TransferRecord) -> tuple[Parts, np.ndarray | None] | None:
        """Produce the next chunk of `t`: (message, its frame buffer or None).

        Inline: gather the blocks into a reusable buffer that travels zero-copy.
        Shared memory: checksum the source blocks in place and copy them straight
        into the receiver's pool; the message is only the header.
        """
        if self.faults.delay_s:
            time.sleep(self.faults.delay_s)
        index = self._chunks_made
        self._chunks_made += 1
        with self._lock:
            if t.state.terminal or not t.spans:
                return None
            span = t.spans.popleft()
            l0, l1 = span.layer_start, span.layer_end
            src = t.src_ids[span.first:span.last]
            dst = t.dst_ids[span.first:span.last]
            nbytes = frame_nbytes(self.layout, l1 - l0, len(src))
            if index == self.faults.drop_chunk:
                return None
            buffer: np.ndarray | None = None
            if peer.direct_ops is not None:
                if self._clock() >= t.write_deadline:
                    self._end(t, TransferState.FAILED, "write deadline passed before the copy")
                    return None
                checksum = digest(self._ops.copy_to(peer.direct_ops, l0, l1, src, dst))
                if index == self.faults.corrupt_chunk:
                    peer.direct_ops.flip_byte(l0, dst[0])
            else:
                buffer = self._staging.take(nbytes)
                _, sums = gather_with_sums(self.pool, l0, l1, src, buffer, self._copy)
                checksum = digest(sums)
                if index == self.faults.corrupt_chunk:
                    buffer[nbytes // 2] ^= 0xFF
        header = wire.encode(wire.Chunk(t.transfer_id, t.request_id, self._compat,
                                        dst, l0, l1, nbytes, checksum, buffer is not None))
        return ([header], None) if buffer is None else ([header, buffer], buffer)

    def _on_reply(self, peer: PeerRecord, parts: list[memoryview]) -> None:
        try:
            msg = wire.decode(parts[0])
        except wire.WireError:
            return  # a broken receiver: its transfers fail at their deadline
        if isinstance(msg, wire.HelloAck):
            self._on_hello_ack(peer, msg)
            return
        if not isinstance(msg, (wire.Grant, wire.Ack, wire.Cancel)):
            return
        with self._lock:
            t = self._transfers.get(msg.transfer_id)
            if isinstance(msg, wire.Cancel) and (t is None or (t.peer == peer.address and t.state.terminal)):
                # Not writing it (writes happen only under this lock, for live records):
                # say so, or the receiver keeps the blocks until its lease ends.
                if msg.transfer_id not in self._owed and not (t is not None and t.abort_pending):
                    peer.control.append([wire.encode(wire.Abort(msg.transfer_id, "not sending"))])
                return
            if t is None or t.peer != peer.address or t.state.terminal:
                return
            if isinstance(msg, wire.Grant):
                t.granted = True
                t.write_deadline = min(t.deadline, msg.deadline)
                t.state = TransferState.TRANSFERRING
            elif isinstance(msg, wire.Ack) and msg.ok:
                self._end(t, TransferState.COMPLETE, "")
            elif isinstance(msg, wire.Ack):
                self._end(t, TransferState.FAILED, f"receiver rejected: {msg.reason}")
            else:
                self._end(t, TransferState.FAILED, f"receiver cancelled: {msg.reason}")

    def _on_hello_ack(self, peer: PeerRecord, msg: wire.HelloAck) -> None:
        mine = self._compat
        if not msg.ok or msg.compat_hash != mine:
            # A receiver names no hash of its own when it refuses; ours is what an operator needs.
            peer.refused = f"handshake refused: {msg.reason or 'compatibility hash mismatch'} (sender {mine})"
            return
        peer.max_frame = msg.max_frame_bytes
        if peer.want_direct and msg.shm is not None:
            try:
                peer.direct = attach_direct(self.layout, msg.shm, self._ops.on_device)
                peer.direct_ops = pool_ops(peer.direct.array)
            except (OSError, ValueError, ImportError, RuntimeError):
                peer.direct = None  # another host or namespace: fall back to inline frames
        if self._ops.on_device and peer.direct_ops is None:
            peer.refused = "a device pool can only be sent to a cuda+ receiver on this host"
            return
        peer.ready = True
