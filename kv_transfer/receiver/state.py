"""Decode-side record of one expected transfer (guarded by the receiver lock, see
receiver_core.py for the lease rules its states follow)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kv_transfer.api import TransferState


@dataclass
class ReservationRecord:
    transfer_id: str
    request_id: str
    dst_ids: tuple[int, ...]
    index: dict[int, int]  # block id -> its position in dst_ids
    deadline: float
    covered: np.ndarray  # [layer, block position] -> arrived and verified
    state: TransferState = TransferState.RESERVED
    reason: str = ""
    peer: bytes | None = None
    shm_granted: bool = False
    writer_done: bool = False
    cancel_sent: bool = False
    cancel_sent_at: float = 0.0
    final: TransferState | None = field(default=None)  # outcome waiting for the writer to stop
    claim_lease: bool = False  # `deadline` waits for the writer's claim; the claim restarts it
    lease_s: float = 0.0  # the transfer's own lease, from the claim (with `claim_lease`)

    def finish(self, state: TransferState, reason: str) -> None:
        """Move to `state`, or to a holding state while a shared-memory writer may be active."""
        self.reason = reason
        if state is TransferState.COMPLETE or not self.shm_granted or self.writer_done:
            self.state = state
            return
        self.final = state
        self.state = (TransferState.CANCELLING if state is TransferState.ABORTED
                      else TransferState.TRANSFERRING)
