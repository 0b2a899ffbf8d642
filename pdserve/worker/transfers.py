"""Transfer bookkeeping shared by the prefill and decode nodes: the lease every
transfer gets, which states count as failed, cancelled transfers whose blocks wait
for a terminal state, and the metrics and reply of a finished or failed transfer.

The KV peer is the node's side of the handoff (`kv_transfer.api.KVSender` on
prefill, `KVReceiver` on decode); both report progress through `poll()`, and a
terminal state promises the peer never touches the transfer's blocks again. So a
cancelled transfer's request keeps its blocks until then, and only `reap()` gives
them back to the engine.
"""

from __future__ import annotations

import logging
import time

from kv_transfer.api import KVReceiver, KVSender, TransferState
from pdserve.common import protocol as p
from pdserve.common.kv_layout import KVLayout
from pdserve.common.logs import request_fields
from pdserve.common.transport import transport_kind
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# A transfer not COMPLETE within this long fails on both sides and its blocks come back.
TRANSFER_LEASE_S = 30.0
# How long a decode reservation waits for its prefill worker to start pushing: the prompt
# may queue there behind others for longer than a transfer takes (and the gateway aborts
# the reservation at once when that worker or the client goes away). Once the writer
# claims the blocks, the push has TRANSFER_LEASE_S.
RESERVATION_LEASE_S = 600.0
FAILED_STATES = frozenset({TransferState.FAILED, TransferState.ABORTED})

KVPeer = KVSender | KVReceiver


class Transfers:
    """One node's transfers through its KV peer: cancellations waiting to be reaped,
    and the accounting of transfers that ended."""

    def __init__(self, peer: KVPeer, engine: LLMEngine, layout: KVLayout, metrics: WorkerMetrics) -> None:
        self.peer = peer
        self.engine = engine
        self.metrics = metrics
        self.block_bytes = layout.block_bytes_per_layer * layout.num_layers
        # transfer_id -> request id: cancelled, but a reader or writer may still use the blocks.
        self._cancelling: dict[str, str] = {}

    def cancel(self, transfer_id: str, request_id: str) -> None:
        """Cancel a transfer; its request's blocks are freed by `reap()` once it is terminal."""
        self.peer.cancel(transfer_id)
        self._cancelling[transfer_id] = request_id

    def reap(self) -> None:
        """Free the blocks of every cancelled transfer that has become terminal."""
        for tid, rid in list(self._cancelling.items()):
            if self.peer.poll(tid).terminal:
                del self._cancelling[tid]
                self.peer.forget(tid)
                self.engine.abort(rid)

    def cancelling(self) -> bool:
        return bool(self._cancelling)

    def completed(self, started_at: float, kv_address: str, num_blocks: int) -> None:
        """Record a COMPLETE transfer of `num_blocks` blocks over the transport `kv_address` names."""
        self.metrics.transfer_seconds.observe(time.monotonic() - started_at)
        self.metrics.add_transfer_bytes(transport_kind(kv_address), num_blocks * self.block_bytes)

    def failed(self, request_id: str, transfer_id: str, state: TransferState) -> p.RequestFailed:
        """Record a failed transfer; the reply tells the gateway to retry the request."""
        self.metrics.transfer_failures.inc()
        log.warning("KV transfer %s of %s ended %s", transfer_id, request_id, state.name,
                    extra=request_fields(request_id))
        return p.RequestFailed(request_id, f"kv transfer {state.name.lower()}", retryable=True,
                               transfer_id=transfer_id)
