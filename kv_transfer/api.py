"""The two interfaces of the KV handoff and the state both sides report.

Receiver (decode worker) life of a transfer:
 1. `expect()` registers the destination blocks (RESERVED) before any data may land.
 2. The sender claims the reservation and streams chunks (TRANSFERRING).
 3. COMPLETE once every layer of every block arrived and every checksum verified;
    FAILED (with `reason()`) on a bad checksum, a compat mismatch, a sender abort
    or lease expiry; ABORTED after `cancel()`.
 4. The worker frees or admits the blocks, then calls `forget()`.

Sender (prefill worker) life of a transfer:
 1. `begin()` (RESERVED), then `send_layer()` per computed layer or `send_all()`.
 2. TRANSFERRING while chunks are in flight.
 3. COMPLETE only when the receiver acked the complete, verified transfer: only
    then may the source blocks be freed. FAILED on a nack, a compat mismatch or
    when no ack came before the lease deadline; ABORTED after `cancel()`.
 4. `forget()`.

A terminal state (COMPLETE, FAILED, ABORTED) also promises that this side's I/O
thread will never touch the transfer's blocks again, so the worker may free them.
CANCELLING is not terminal: a cancel was requested but a writer may still be
active (shared memory); the state becomes ABORTED when it is safe.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class TransferState(enum.Enum):
    RESERVED = "reserved"
    TRANSFERRING = "transferring"
    CANCELLING = "cancelling"
    COMPLETE = "complete"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({TransferState.COMPLETE, TransferState.FAILED, TransferState.ABORTED})


class UnknownTransfer(KeyError):
    """No transfer with this id is registered (never begun, or already forgotten)."""


class KVReceiver(Protocol):
    """Decode side. All methods are thread-safe and never block on the network."""

    @property
    def address(self) -> str:
        """What senders pass as `peer_address`."""
        ...

    def expect(self, transfer_id: str, request_id: str, dst_block_ids: Sequence[int],
               lease_s: float, claim_lease_s: float | None = None) -> None:
        """Reserve `dst_block_ids` for a transfer; FAILED if not COMPLETE within `lease_s`
        (with `claim_lease_s`: of the writer's claim, which must come within that)."""
        ...

    def poll(self, transfer_id: str) -> TransferState: ...

    def reason(self, transfer_id: str) -> str:
        """Why a transfer FAILED or was ABORTED ('' otherwise)."""
        ...

    def cancel(self, transfer_id: str) -> None: ...

    def forget(self, transfer_id: str) -> None:
        """Drop a transfer in a terminal state (ValueError otherwise)."""
        ...

    def close(self) -> None: ...


class KVSender(Protocol):
    """Prefill side. All methods are thread-safe and never block on the network."""

    def begin(self, transfer_id: str, request_id: str, peer_address: str,
              src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              lease_s: float) -> None:
        """Start a transfer; FAILED unless the receiver acks it within `lease_s`."""
        ...

    def send_layer(self, transfer_id: str, layer: int, ready: object = None) -> None:
        """Queue layer `layer` of all source blocks (returns at once). `ready`: a device
        event recorded once the layer is written (the copy waits for it, not the host)."""
        ...

    def send_all(self, transfer_id: str, ready: object = None) -> None:
        """Queue every layer (whole-request mode)."""
        ...

    def poll(self, transfer_id: str) -> TransferState: ...

    def reason(self, transfer_id: str) -> str: ...

    def cancel(self, transfer_id: str) -> None: ...

    def forget(self, transfer_id: str) -> None: ...

    def close(self) -> None: ...
