"""Draft-model KV made on the prefill worker and shipped with the target's
(`--speculative-config '{..., "draft_kv": "prefill"}'`).

Both workers hold a draft pool (the `DraftModelProposer` their engine built) and one
more kv_transfer peer over it: a sender on the prefill worker, a receiver on the decode
worker. A request's draft KV is one more transfer, `draft_transfer_id(target's)`, with
the kv_transfer protocol's own checksums, lease and handshake (over the draft's layout).

Life of a request's draft KV:
1. Decode (`DraftReceipts.reserve`), with the target's reservation: blocks for every
   prompt token in the draft pool, expected by the draft receiver; they travel to the
   prefill worker in `ReserveResult.draft` -> `TransferTarget.draft`. No room: no
   draft blocks, and the decode worker prefills the draft itself as without this option.
2. Prefill (`DraftShipper.ship`), once the target prefill is done and the target is
   known: the draft prefills the same tokens into its pool and the blocks are pushed.
3. Decode admits the request on the target's KV alone, never waiting for the draft's
   (`admit`): a draft transfer COMPLETE by then is adopted as the sequence's computed
   draft KV (its first speculative step prefills no draft). One still under way lets
   the sequence decode without drafts, and is adopted if it lands within
   `DRAFT_WAIT_STEPS` decode steps (`poll`); the tokens decoded meanwhile are caught up
   at the first draft. One that failed, or does not land in time, is given up: its
   blocks move off the sequence's id and come back once the cancelled transfer is
   terminal, and the draft is prefilled locally (output is exact either way). So a
   stalled draft transfer never holds a stream, and costs it a few steps' drafts.
4. Both sides free the draft blocks when the request ends: at once when the draft
   transfer is terminal, else after cancelling it, once terminal (`reap`).
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from kv_transfer.api import KVReceiver, KVSender, TransferState
from kv_transfer.auth import CurveKeys
from kv_transfer.faults import FaultConfig
from pdserve.common.draft_kv import DraftBlocks, draft_transfer_id
from pdserve.common.transport import transport_kind
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.draft_model import DraftModelProposer
from pdserve.worker.metrics import WorkerMetrics

KVPeer = KVSender | KVReceiver
# Decode steps a decoding sequence waits (without drafts) for its draft KV to land.
DRAFT_WAIT_STEPS = 8


@dataclass
class _Draft:
    key: int  # the draft pool's owner id of the blocks
    request_id: str
    num_blocks: int
    token_ids: list[int] = field(default_factory=list)  # decode: the tokens the KV covers


class _DraftTransfers:
    def __init__(self, proposer: DraftModelProposer, peer: KVPeer, metrics: WorkerMetrics) -> None:
        self.proposer = proposer
        self.peer = peer
        self.metrics = metrics
        layout = proposer.runner.layout
        self.block_bytes = layout.block_bytes_per_layer * layout.num_layers
        self._live: dict[str, _Draft] = {}  # draft transfer id -> its blocks
        self._cancelling: dict[str, _Draft] = {}

    def state(self, transfer_id: str) -> TransferState | None:
        """The draft transfer's state (None: this request ships no draft KV)."""
        tid = draft_transfer_id(transfer_id)
        return self.peer.poll(tid) if tid in self._live else None

    def settled(self, transfer_id: str) -> bool:
        """No draft transfer goes with `transfer_id`, or it is terminal."""
        state = self.state(transfer_id)
        return state is None or state.terminal

    def end(self, transfer_id: str) -> _Draft | None:
        """The request is done with its draft KV: free the blocks now if the transfer is
        terminal, else cancel it and free them once it is (`reap`)."""
        return self._end(draft_transfer_id(transfer_id))

    def _end(self, tid: str) -> _Draft | None:
        draft = self._live.pop(tid, None)
        if draft is None:
            return None
        if self.peer.poll(tid).terminal:
            self.peer.forget(tid)
            self.proposer.drop(draft.key)
        else:
            self.peer.cancel(tid)
            self._cancelling[tid] = draft
        return draft

    def reap(self) -> None:
        for tid, draft in list(self._cancelling.items()):
            if self.peer.poll(tid).terminal:
                del self._cancelling[tid]
                self.peer.forget(tid)
                self.proposer.drop(draft.key)

    def cancelling(self) -> bool:
        return bool(self._cancelling)

    def publish(self) -> None:
        """The draft pool's blocks in use, for `llm_spec_draft_kv_used_blocks`."""
        bm = self.proposer.blocks
        self.metrics.draft_kv_used_blocks.set(bm.num_allocatable - bm.num_free_blocks)

    def _completed(self, draft: _Draft, address: str) -> None:
        self.metrics.add_transfer_bytes(transport_kind(address), draft.num_blocks * self.block_bytes)

    def close(self) -> None:
        self.peer.close()


class Shipped(enum.Enum):
    SENT = "sent"
    NO_ROOM = "no room"  # the draft pool is full: try again once blocks come back
    REFUSED = "refused"  # the destination does not fit the prompt: never ships


class DraftShipper(_DraftTransfers):
    """Prefill worker: runs the draft over each prompt and pushes its KV."""

    def __init__(self, proposer: DraftModelProposer, sender: KVSender, metrics: WorkerMetrics) -> None:
        super().__init__(proposer, sender, metrics)
        self.sender = sender
        self._keys = itertools.count(-1, -1)  # apart from any engine sequence id
        self._addresses: dict[str, str] = {}

    def ship(self, transfer_id: str, request_id: str, token_ids: Sequence[int], target: DraftBlocks,
             lease_s: float, ready: object = None) -> Shipped:
        """Prefill the draft over `token_ids` and push its KV into `target`. REFUSED: the
        decode worker's draft transfer fails at its lease and it prefills the draft itself."""
        need = -(-len(token_ids) // self.proposer.blocks.block_size)
        if len(target.block_ids) != need or len(token_ids) > self.proposer.max_model_len:
            return Shipped.REFUSED
        key = next(self._keys)
        src = self.proposer.prefill(key, token_ids)
        if src is None:
            return Shipped.NO_ROOM
        tid = draft_transfer_id(transfer_id)
        self._live[tid] = _Draft(key, request_id, len(src))
        self._addresses[tid] = target.kv_address
        self.sender.begin(tid, request_id, target.kv_address, src, list(target.block_ids), lease_s)
        self.sender.send_all(tid, ready)
        return Shipped.SENT

    def end(self, transfer_id: str) -> _Draft | None:
        tid = draft_transfer_id(transfer_id)
        complete = tid in self._live and self.peer.poll(tid) == TransferState.COMPLETE
        draft = super().end(transfer_id)
        address = self._addresses.pop(tid, "")
        if draft is not None and complete:
            self._completed(draft, address)
        return draft


class DraftReceipts(_DraftTransfers):
    """Decode worker: draft blocks reserved next to the target's, adopted on arrival."""

    def __init__(self, proposer: DraftModelProposer, receiver: KVReceiver, metrics: WorkerMetrics) -> None:
        super().__init__(proposer, receiver, metrics)
        self.receiver = receiver
        self._keys = itertools.count(-1, -1)  # blocks given up, apart from any engine sequence id
        self._awaited: dict[str, int] = {}  # draft transfer id -> decode steps left to land

    def reserve(self, transfer_id: str, request_id: str, seq_id: int, token_ids: Sequence[int],
                lease_s: float) -> DraftBlocks | None:
        """Draft blocks for `token_ids` under the engine's sequence id; None: no room."""
        blocks = self.proposer.reserve(seq_id, len(token_ids))
        if blocks is None:
            return None
        tid = draft_transfer_id(transfer_id)
        self.receiver.expect(tid, request_id, blocks, lease_s)
        self._live[tid] = _Draft(seq_id, request_id, len(blocks), list(token_ids))
        return DraftBlocks(self.receiver.address, list(blocks))

    def admit(self, transfer_id: str, running: bool) -> None:
        """The request was admitted on its target KV (`running`: it decodes): adopt its
        draft KV if complete, await it if under way, else give it up (module docstring,
        step 3)."""
        tid = draft_transfer_id(transfer_id)
        draft = self._live.get(tid)
        if draft is None:
            return
        state = self.peer.poll(tid)
        if running and state == TransferState.COMPLETE:
            self._adopt(tid, draft)
        elif running and not state.terminal:
            self.proposer.await_kv(draft.key)
            self._awaited[tid] = DRAFT_WAIT_STEPS
        else:
            self._give_up(tid, draft)

    def poll(self) -> None:
        """Once per decode step: adopt the awaited draft KV that landed, give up what
        failed or ran out of steps."""
        for tid, left in list(self._awaited.items()):
            state = self.peer.poll(tid)
            if state == TransferState.COMPLETE:
                self._adopt(tid, self._live[tid])
            elif state.terminal or left <= 1:
                self._give_up(tid, self._live[tid])
            else:
                self._awaited[tid] = left - 1

    def ended(self, request_id: str) -> None:
        """A decoding request ended: give up the draft KV it still awaited."""
        for tid in [t for t in self._awaited if self._live[t].request_id == request_id]:
            self._give_up(tid, self._live[tid])

    def awaiting(self) -> bool:
        return bool(self._awaited)

    def _adopt(self, tid: str, draft: _Draft) -> None:
        self._awaited.pop(tid, None)
        del self._live[tid]
        self.peer.forget(tid)
        self.proposer.adopt(draft.key, draft.token_ids)
        self._completed(draft, self.receiver.address)

    def _give_up(self, tid: str, draft: _Draft) -> None:
        """Move the blocks to an owner id of their own (a late writer may still land in
        them until the cancel is through; the sequence's id then drafts from blocks its
        local draft prefill takes afresh), and end the transfer."""
        self._awaited.pop(tid, None)
        key = next(self._keys)
        self.proposer.give_up(draft.key, key)
        draft.key = key
        self._end(tid)


def draft_proposer(engine: LLMEngine) -> DraftModelProposer | None:
    """The engine's draft-model proposer when its config ships draft KV (draft_kv=prefill)."""
    spec = engine.config.speculative
    proposer = engine.spec.proposer if engine.spec is not None else None
    if spec is None or not spec.ships_draft_kv or not isinstance(proposer, DraftModelProposer):
        return None
    return proposer


def build_shipper(engine: LLMEngine, metrics: WorkerMetrics, faults: FaultConfig,
                  curve: CurveKeys | None) -> DraftShipper | None:
    """Prefill worker: a sender over the draft pool (None unless draft_kv=prefill)."""
    from kv_transfer import make_sender
    from kv_transfer.pool.tensor_adapter import pool_array

    proposer = draft_proposer(engine)
    if proposer is None:
        return None
    sender = make_sender(proposer.runner.layout, pool_array(proposer.runner.pool.kv), faults=faults,
                         curve=curve)
    return DraftShipper(proposer, sender, metrics)


def build_receipts(engine: LLMEngine, metrics: WorkerMetrics, faults: FaultConfig,
                   curve: CurveKeys | None, host: str) -> DraftReceipts | None:
    """Decode worker: a receiver over the draft pool, tcp frames on an ephemeral port of
    `host` (None unless draft_kv=prefill)."""
    from kv_transfer import make_receiver
    from kv_transfer.pool.tensor_adapter import pool_array

    proposer = draft_proposer(engine)
    if proposer is None:
        return None
    receiver = make_receiver(proposer.runner.layout, pool_array(proposer.runner.pool.kv), "tcp",
                             host=host, port=0, faults=faults, curve=curve)
    return DraftReceipts(proposer, receiver, metrics)
