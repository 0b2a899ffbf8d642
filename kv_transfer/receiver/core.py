"""Decode-side transfer bookkeeping, independent of any socket.

`ReceiverCore` owns the reservation table. Transports feed it decoded peer
messages (`handle`) and send what it queues in its outbox; the worker thread
calls `expect/poll/cancel/forget`. One lock guards the table *and* every write
into the pool, which gives the lease rule for inline (socket) transfers:

  * data is written only under the lock, only for a live (non-terminal)
    reservation, and only before its deadline;
  * `poll` evaluates expiry under the same lock,
so once `poll` reports a terminal state no write to those blocks is in progress
or will ever start; the worker may free them.

Shared memory is different: the *sender* writes into this pool directly. The
rule there (same host, so both sides read the same CLOCK_MONOTONIC):

  * a sender writes only after a `Grant`, which carries the reservation's
    absolute deadline, and starts no chunk copy at or after that deadline;
  * the receiver treats a granted shared-memory reservation as possibly being
    written until the sender's writes are known to be over (all chunks
    committed, the sender sent `Abort`, which it does only after its last
    write, or the sender's liveness lock was released, which happens only once
    its process closed the sender or died) or until deadline + `grace_s`
    (covering one chunk copy started just before the deadline). Until then a failed or cancelled reservation reports
    TRANSFERRING / CANCELLING, never a terminal state.

This module is the table and the handshake/claim/grant protocol; each
reservation's record and holding states are in receiver_state.py, and the checks
and checksum verification of a chunk's bytes in receiver_frames.py.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kv_transfer import wire
from kv_transfer.api import TransferState, UnknownTransfer
from kv_transfer.faults import FaultConfig
from kv_transfer.liveness_table import LivenessTable
from kv_transfer.pool.blocks import check_block_ids, check_pool
from kv_transfer.pool.copy_threads import CopyThreads
from kv_transfer.pool.ops import pool_ops
from kv_transfer.receiver.frames import FrameCheck
from kv_transfer.receiver.pending_claims import PendingClaims
from kv_transfer.receiver.state import ReservationRecord
from pdserve.common.kv_layout import KVLayout
from pdserve.common.parallel_layout import LayoutPairError, ParallelLayout, check_pair

log = logging.getLogger(__name__)
# A cancelled shared-memory transfer waits for the sender's Abort; the Cancel asking
# for it is repeated this often in case it was lost (full or reconnecting link).
CANCEL_RESEND_S = 0.5
# Said to a peer whose Hello does not match; it names no hash and no layout.
REFUSED = "compatibility hash mismatch"
# How often descriptors on gone senders' liveness locks are closed.
LIVENESS_SWEEP_S = 1.0
_R = TypeVar("_R", bound="CoreReceiver")


@dataclass(frozen=True)
class ReceiverStats:
    malformed: int  # headers that failed to decode or validate
    rejected: int  # well-formed messages refused (unknown transfer, bad blocks, mismatch)
    completed: int
    staged_bytes: int = 0  # inline bytes written into a device pool through host staging


class ReceiverCore:
    def __init__(self, layout: KVLayout, pool: Any, *, shm: wire.ShmDescriptor | None,
                 grace_s: float, max_frame_bytes: int, faults: FaultConfig,
                 wake: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 copy_threads: int = 1, parallel: ParallelLayout | None = None) -> None:
        self.layout = layout
        self.parallel = parallel  # this worker's rank layout; checked against a sender's
        self._copy = CopyThreads(copy_threads)  # helpers for scattering and verifying
        # A device pool (anything but numpy) is handled through cupy, see cuda_ipc.py.
        self._ops = pool_ops(pool, self._copy)
        self.pool = self._ops.array
        self.num_blocks = check_pool(layout, self.pool)
        self.shm = shm
        self.grace_s = grace_s
        self.max_frame_bytes = max_frame_bytes
        self.faults = faults
        self._frames = FrameCheck(layout, self._ops, self._copy,
                                  max_frame_bytes=max_frame_bytes, shared=shm is not None)
        self._wake = wake
        self._clock = clock
        self._lock = threading.RLock()
        self._res: dict[str, ReservationRecord] = {}
        self._reserved_blocks: set[int] = set()
        self._pending = PendingClaims()
        # Same-host senders' liveness locks (bounded, swept: liveness_table.py): a cancelled
        # shared-memory transfer is released as soon as its writer is known dead.
        self._liveness = LivenessTable()
        self._next_sweep = 0.0
        self._outbox: list[tuple[bytes, wire.Message]] = []
        self._malformed = self._rejected = self._completed = 0
        self._refused_hellos = 0

    # ---------------------------------------------------------------- worker API
    def expect(self, transfer_id: str, request_id: str, dst_block_ids: Sequence[int],
               lease_s: float, claim_lease_s: float | None = None) -> None:
        """Reserve `dst_block_ids`. FAILED unless COMPLETE within `lease_s`; with
        `claim_lease_s`, the reservation first waits up to that long for its writer's
        claim (no byte can land before one), and the claim gives the transfer `lease_s`
        from then: a prompt queued behind others on its prefill worker keeps its blocks."""
        ids = check_block_ids(dst_block_ids, self.num_blocks, "dst_block_ids")
        if not lease_s > 0 or (claim_lease_s is not None and not claim_lease_s > 0):
            raise ValueError("lease_s and claim_lease_s must be positive")
        with self._lock:
            if transfer_id in self._res:
                raise ValueError(f"transfer {transfer_id!r} already expected")
            overlap = self._reserved_blocks.intersection(ids)
            if overlap:
                raise ValueError(f"blocks {sorted(overlap)[:4]} already reserved by a transfer")
            self._reserved_blocks.update(ids)
            self._res[transfer_id] = ReservationRecord(
                transfer_id, request_id, ids, {b: i for i, b in enumerate(ids)},
                self._clock() + (lease_s if claim_lease_s is None else claim_lease_s),
                np.zeros((self.layout.num_layers, len(ids)), bool),
                claim_lease=claim_lease_s is not None, lease_s=lease_s)
            self._pending.expected(transfer_id)
            pending = self._pending.pop(transfer_id)
            if pending is not None:
                self._on_claim(pending.peer, pending.claim)
        self._wake()

    def poll(self, transfer_id: str) -> TransferState:
        with self._lock:
            res = self._get(transfer_id)
            self._expire(res, self._clock())
            return res.state

    def reason(self, transfer_id: str) -> str:
        with self._lock:
            return self._get(transfer_id).reason

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            res = self._get(transfer_id)
            if res.state.terminal or res.state is TransferState.CANCELLING:
                return
            res.finish(TransferState.ABORTED, "cancelled by receiver")
            self._send_cancel(res, "cancelled by receiver")
        self._wake()

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            res = self._get(transfer_id)
            self._expire(res, self._clock())
            if not res.state.terminal:
                raise ValueError(f"transfer {transfer_id!r} is {res.state.name}; cancel it first")
            del self._res[transfer_id]
            self._reserved_blocks.difference_update(res.dst_ids)
            if res.peer is None:  # never claimed: a claim now comes too late
                self._pending.cancelled(transfer_id)

    def stats(self) -> ReceiverStats:
        with self._lock:
            return ReceiverStats(self._malformed, self._rejected, self._completed,
                                 getattr(self._ops, "staged_bytes", 0))

    def close(self) -> None:
        """Stop the copy helper threads (after the transport stopped calling `handle`)."""
        self._copy.close()
        with self._lock:
            self._liveness.close()

    # ---------------------------------------------------------------- transport side
    def take_outbox(self) -> list[tuple[bytes, wire.Message]]:
        with self._lock:
            out, self._outbox = self._outbox, []
            return out

    def tick(self) -> None:
        """Expire leases and stale pending claims (called periodically by the I/O thread)."""
        now = self._clock()
        with self._lock:
            for res in self._res.values():
                self._expire(res, now)
            for held in self._pending.expire(now):
                self._outbox.append((held.peer, wire.Ack(held.claim.transfer_id, False,
                                                         "no reservation for transfer")))
            if now >= self._next_sweep:
                self._next_sweep = now + LIVENESS_SWEEP_S
                self._liveness.sweep(self._peers_in_use())

    def liveness_fds(self) -> int:
        """Descriptors held on senders' liveness locks now (bounded, see liveness_table.py)."""
        with self._lock:
            return len(self._liveness)

    def _peers_in_use(self) -> set[bytes]:
        return {res.peer for res in self._res.values() if res.peer is not None and not res.state.terminal}

    def note_malformed(self) -> None:
        """A message with the wrong number of parts, seen by the transport."""
        with self._lock:
            self._malformed += 1

    def handle(self, peer: bytes, header: bytes | memoryview, frame: memoryview | None) -> None:
        """Process one message from `peer`. Never raises on bad input: it counts and drops."""
        try:
            msg = wire.decode(header)
        except wire.WireError:
            with self._lock:
                self._malformed += 1
            return
        with self._lock:
            if isinstance(msg, wire.Hello):
                self._on_hello(peer, msg)
            elif isinstance(msg, wire.Claim):
                self._on_claim(peer, msg)
            elif isinstance(msg, wire.Chunk):
                self._on_chunk(peer, msg, frame)
            elif isinstance(msg, wire.Abort):
                self._on_abort(peer, msg)
            else:
                self._rejected += 1

    # ---------------------------------------------------------------- message handlers
    def _on_hello(self, peer: bytes, msg: wire.Hello) -> None:
        mine = self.layout.compat_hash
        ok = msg.compat_hash == mine
        if not ok:  # a refusal reveals nothing about this receiver: no hash, frame limit or pool
            self._rejected += 1
            self._refused_hellos += 1
            n = self._refused_hellos
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood cannot flood the log
                log.warning("refused a KV handshake (%d so far): sender compatibility hash %.80r, "
                            "ours %s", n, msg.compat_hash, mine)
            self._outbox.append((peer, wire.HelloAck("", False, REFUSED, 0, None)))
            return
        unmappable = self._unmappable(msg)
        if unmappable:
            self._rejected += 1
            log.warning("refused a KV handshake: %s", unmappable)
            self._outbox.append((peer, wire.HelloAck("", False, unmappable[:wire.MAX_REASON_LEN], 0, None)))
            return
        # The pool's name and shape go only to a sender that asks to write into it and
        # proves a live process on this host holds the lock it names.
        watched = self.shm is not None and self._liveness.watch(peer, msg.liveness, self._peers_in_use())
        shm = self.shm if watched else None
        self._outbox.append((peer, wire.HelloAck(mine, ok, "", self.max_frame_bytes, shm)))

    def _unmappable(self, msg: wire.Hello) -> str:
        """Why KV from a sender of `msg`'s rank layout cannot land in this pool ("": it can;
        a side that says no layout is taken as mappable)."""
        if self.parallel is None or not msg.parallel:
            return ""
        try:
            check_pair(ParallelLayout.decode(msg.parallel), self.parallel)
        except LayoutPairError as e:
            return str(e)
        return ""

    def _on_claim(self, peer: bytes, msg: wire.Claim) -> None:
        tid = msg.transfer_id
        if msg.compat_hash != self.layout.compat_hash:
            self._reject(peer, tid, REFUSED)
            return
        res = self._res.get(tid)
        if res is None:  # the sender may be faster than the decode worker's expect()
            self._hold_claim(peer, msg)
            return
        self._expire(res, self._clock())
        if res.state.terminal or res.state is TransferState.CANCELLING:
            self._reject(peer, tid, f"transfer is {res.state.name}: {res.reason}")
        elif res.peer is not None and res.peer != peer:
            self._reject(peer, tid, "transfer already claimed by another sender")
        elif sorted(msg.dst_block_ids) != sorted(res.dst_ids):
            self._reject(peer, tid, "claimed blocks differ from the reserved blocks")
        else:
            res.peer = peer
            if res.claim_lease:  # before any byte lands and before the Grant states the deadline
                res.deadline = self._clock() + res.lease_s
            res.state = TransferState.TRANSFERRING
            res.shm_granted = self.shm is not None
            self._outbox.append((peer, wire.Grant(tid, res.deadline)))

    def _on_chunk(self, peer: bytes, msg: wire.Chunk, frame: memoryview | None) -> None:
        res = self._res.get(msg.transfer_id)
        problem = self._frames.problem(peer, msg, frame, res)
        if problem:
            self._rejected += 1
            if res is not None and res.peer == peer and not res.state.terminal:
                self._fail(res, problem)
            return
        assert res is not None
        now = self._clock()
        self._expire(res, now)
        if res.state.terminal or res.state is TransferState.CANCELLING or now >= res.deadline:
            return  # too late: never write into a reservation that is over
        if not self._frames.land(msg, frame):
            self._fail(res, f"checksum mismatch in layers {msg.layer_start}..{msg.layer_end - 1}")
            return
        cols = [res.index[b] for b in msg.dst_block_ids]
        res.covered[msg.layer_start:msg.layer_end, cols] = True
        if res.covered.all():
            res.writer_done = True
            self._completed += 1
            res.finish(TransferState.COMPLETE, "")
            if not self.faults.drop_acks:
                self._outbox.append((peer, wire.Ack(res.transfer_id, True, "")))

    def _hold_claim(self, peer: bytes, msg: wire.Claim) -> None:
        """Keep a claim until its reservation arrives (pending_claims.py bounds the table);
        one that no reservation of this pool could match is refused at once."""
        if self._pending.was_cancelled(msg.transfer_id):
            self._reject(peer, msg.transfer_id, "transfer was cancelled")
            return
        ids = msg.dst_block_ids
        fits = 0 < len(ids) <= self.num_blocks and all(0 < b < self.num_blocks for b in ids)
        held, evicted = self._pending.hold(peer, msg, self._clock()) if fits else (False, None)
        if not held:
            self._reject(peer, msg.transfer_id, "no reservation for transfer")
        if evicted is not None:
            self._reject(evicted.peer, evicted.claim.transfer_id, "no reservation for transfer")

    def _on_abort(self, peer: bytes, msg: wire.Abort) -> None:
        self._pending.pop(msg.transfer_id, peer)
        res = self._res.get(msg.transfer_id)
        if res is None or (res.peer is not None and res.peer != peer):
            return  # only the sender holding the grant (or, before a grant, any) can abort
        res.writer_done = True
        if res.state is TransferState.CANCELLING:
            res.finish(TransferState.ABORTED, res.reason)
        elif not res.state.terminal:
            res.finish(TransferState.FAILED, f"sender aborted: {msg.reason}")

    # ---------------------------------------------------------------- state changes
    def _reject(self, peer: bytes, tid: str, reason: str) -> None:
        self._rejected += 1
        self._outbox.append((peer, wire.Ack(tid, False, reason)))

    def _fail(self, res: ReservationRecord, reason: str) -> None:
        res.finish(TransferState.FAILED, reason)
        if res.peer is not None:
            self._outbox.append((res.peer, wire.Ack(res.transfer_id, False, reason)))

    def _send_cancel(self, res: ReservationRecord, reason: str) -> None:
        if res.peer is not None and not res.cancel_sent:
            res.cancel_sent = True
            res.cancel_sent_at = self._clock()
            self._outbox.append((res.peer, wire.Cancel(res.transfer_id, reason)))

    def _expire(self, res: ReservationRecord, now: float) -> None:
        if res.state.terminal:
            return
        if res.final is not None:  # waiting for a shared-memory writer to stop
            if res.writer_done or now >= res.deadline + self.grace_s or self._writer_dead(res):
                res.state = res.final
            elif not res.cancel_sent or now - res.cancel_sent_at >= CANCEL_RESEND_S:
                res.cancel_sent = False
                self._send_cancel(res, res.reason)
            return
        if now >= res.deadline:
            self._send_cancel(res, "lease expired")
            res.finish(TransferState.FAILED, "lease expired before the transfer completed")
            if res.final is not None:
                self._expire(res, now)

    def _writer_dead(self, res: ReservationRecord) -> bool:
        """The granted sender's process is gone (its liveness lock was released)."""
        if not self._liveness.holder_gone(res.peer):
            return False
        res.writer_done = True
        res.reason = f"{res.reason} (sender gone)"
        return True

    def _get(self, transfer_id: str) -> ReservationRecord:
        res = self._res.get(transfer_id)
        if res is None:
            raise UnknownTransfer(transfer_id)
        return res


class CoreReceiver:
    """A `kv_transfer.api.KVReceiver` whose calls the `ReceiverCore` answers: a transport
    sets `core` and `_address` and writes its own `close`."""

    core: ReceiverCore
    _address: str

    @property
    def address(self) -> str:
        return self._address

    def expect(self, transfer_id: str, request_id: str, dst_block_ids: Sequence[int],
               lease_s: float, claim_lease_s: float | None = None) -> None:
        self.core.expect(transfer_id, request_id, dst_block_ids, lease_s, claim_lease_s)

    def poll(self, transfer_id: str) -> TransferState:
        return self.core.poll(transfer_id)

    def reason(self, transfer_id: str) -> str:
        return self.core.reason(transfer_id)

    def cancel(self, transfer_id: str) -> None:
        self.core.cancel(transfer_id)

    def forget(self, transfer_id: str) -> None:
        self.core.forget(transfer_id)

    def stats(self) -> ReceiverStats:
        return self.core.stats()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
