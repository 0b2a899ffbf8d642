"""Claims that arrived before their reservation (a prefill worker can be faster than the
decode worker's `expect`), held for a while, within bounds no peer can exhaust.

Every peer (connection) holds at most `per_peer` claims; the whole table at most
`capacity`. When the table is full, a claim from a peer holding fewer than the
largest holder evicts that holder's oldest claim, so a flood -- even from many
connections -- never locks other senders out. A transfer the worker forgot before any
claim for it came (cancelled, or its lease over) is remembered, the newest
`MAX_CANCELLED` of them: a late claim for it is refused at once, so its sender fails
now, not at its own lease. Not thread-safe: `ReceiverCore` calls it under its lock.
"""

from __future__ import annotations

from typing import NamedTuple

from kv_transfer import wire

PENDING_CLAIM_TTL_S = 30.0
MAX_PENDING_CLAIMS = 4096
MAX_PENDING_CLAIMS_PER_PEER = 256
MAX_CANCELLED = 4096


class Held(NamedTuple):
    peer: bytes
    claim: wire.Claim
    until: float


class HoldResult(NamedTuple):
    held: bool  # False: refuse this claim
    evicted: Held | None  # a claim dropped to make room (refuse it to its peer)


class PendingClaims:
    def __init__(self, capacity: int = MAX_PENDING_CLAIMS, per_peer: int = MAX_PENDING_CLAIMS_PER_PEER,
                 ttl_s: float = PENDING_CLAIM_TTL_S) -> None:
        self.capacity = capacity
        self.per_peer = per_peer
        self.ttl_s = ttl_s
        self._held: dict[str, Held] = {}  # insertion order: oldest first
        self._per_peer: dict[bytes, int] = {}
        self._cancelled: dict[str, None] = {}  # insertion order: oldest first

    def cancelled(self, tid: str) -> None:
        """`tid` was cancelled unclaimed and forgotten: refuse a claim for it from now on."""
        self._cancelled.pop(tid, None)
        self._cancelled[tid] = None
        if len(self._cancelled) > MAX_CANCELLED:
            del self._cancelled[next(iter(self._cancelled))]

    def was_cancelled(self, tid: str) -> bool:
        return tid in self._cancelled

    def expected(self, tid: str) -> None:
        """`tid` is expected (again): a claim for it is no longer refused."""
        self._cancelled.pop(tid, None)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, peer: bytes, claim: wire.Claim, now: float) -> HoldResult:
        tid = claim.transfer_id
        mine = self._per_peer.get(peer, 0)
        if tid in self._held or mine >= self.per_peer:
            return HoldResult(False, None)
        evicted = None
        if len(self._held) >= self.capacity:
            hog = max(self._per_peer, key=self._per_peer.__getitem__)
            if self._per_peer[hog] <= mine + 1:
                return HoldResult(False, None)  # nobody holds more than this peer would
            oldest = next(t for t, h in self._held.items() if h.peer == hog)
            evicted = self.pop(oldest)
        self._held[tid] = Held(peer, claim, now + self.ttl_s)
        self._per_peer[peer] = mine + 1
        return HoldResult(True, evicted)

    def pop(self, tid: str, peer: bytes | None = None) -> Held | None:
        """Remove and return the claim for `tid` (only if `peer` holds it, when given)."""
        held = self._held.get(tid)
        if held is None or (peer is not None and held.peer != peer):
            return None
        del self._held[tid]
        left = self._per_peer[held.peer] - 1
        if left:
            self._per_peer[held.peer] = left
        else:
            del self._per_peer[held.peer]
        return held

    def expire(self, now: float) -> list[Held]:
        """Remove and return every claim held past its time."""
        gone = [tid for tid, h in self._held.items() if now >= h.until]
        return [h for h in map(self.pop, gone) if h is not None]
