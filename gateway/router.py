"""Routing: which worker of a pool gets the next request.

Decode: most free KV blocks, then fewest running sequences (blocks decide
whether a request fits at all; the batch decides its speed). Prefill: fewest
queued prompt tokens. Colocated: fewest running sequences, then most free
blocks. Load between heartbeats is tracked optimistically on `WorkerInfo`.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.registry import WorkerInfo


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // max(block_size, 1))


def pick_decode(pool: Iterable[WorkerInfo], exclude: frozenset[str] = frozenset()) -> WorkerInfo | None:
    candidates = [w for w in pool if w.worker_id not in exclude]
    if not candidates:
        return None
    return max(candidates, key=lambda w: (w.free_blocks, -w.running, w.worker_id))


def pick_prefill(pool: Iterable[WorkerInfo], exclude: frozenset[str] = frozenset()) -> WorkerInfo | None:
    candidates = [w for w in pool if w.worker_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.queued_tokens, len(w.inflight), w.worker_id))


def pick_colocated(pool: Iterable[WorkerInfo], exclude: frozenset[str] = frozenset()) -> WorkerInfo | None:
    candidates = [w for w in pool if w.worker_id not in exclude]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (w.running, -w.free_blocks, w.worker_id))
