"""Worker registry: who is alive, in which pool, with what load.

Fed by `RegisterWorker` / `Heartbeat` / `Deregister` messages. A worker joins
its pool on registration and leaves it on deregistration or after being
silent for longer than the heartbeat timeout; `expire()` returns the removed
workers so the cluster can recover their in-flight requests.

Between heartbeats the gateway counts what it routed to a worker as *pending* load,
per request. A heartbeat drops only the requests it lists as received (its load
counts them); one still on the wire or in the worker's inbox stays counted until a
later heartbeat lists it or it leaves (`release`). A heartbeat that cannot vouch for
its list (it overflowed, the heartbeat before it was lost, or the worker predates the
list) replaces all pending load, as the only estimate left.

A worker that heartbeats but makes no progress is *stalled*: its heartbeats show
runnable work (running sequences or queued prefill tokens) while its step counter
stands still for longer than the stall timeout. `find_stalled()` marks it: it stays
listed (unhealthy) but leaves its pool, until its counter moves again. Plain
Python, no I/O: the cluster owns the sockets and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.common.protocol import Heartbeat, RegisterWorker
from pdserve.common.roles import Role
from pdserve.common.transport import transport_kind


@dataclass
class WorkerInfo:
    reg: RegisterWorker
    registered_at: float
    last_seen: float
    load: Heartbeat | None = None
    # Requests routed here and not yet finished, by request id.
    inflight: set[str] = field(default_factory=set)
    # Work handed out since the last heartbeat (optimistic load between heartbeats).
    pending_tokens: int = 0
    pending_blocks: int = 0
    pending_seqs: int = 0
    # Each request's part of `pending_tokens`: settled once its prompt is computed.
    pending_prompts: dict[str, int] = field(default_factory=dict)
    # Each request's part of `pending_blocks` and `pending_seqs`: released once it leaves.
    pending_holds: dict[str, tuple[int, int]] = field(default_factory=dict)
    draining: bool = False  # deregistered but still finishing its in-flight requests
    # Last time its step counter moved or it held no runnable work (stall detection).
    progress_at: float = 0.0
    stalled: bool = False  # no progress while holding work: not routed, requests recovered
    last_seq: int = 0  # `seq` of its last heartbeat (0: none yet)

    def add_pending(self, request_id: str, tokens: int, blocks: int = 0, seqs: int = 0) -> None:
        self.pending_tokens += tokens
        self.pending_prompts[request_id] = self.pending_prompts.get(request_id, 0) + tokens
        if blocks or seqs:
            held_blocks, held_seqs = self.pending_holds.get(request_id, (0, 0))
            self.pending_holds[request_id] = (held_blocks + blocks, held_seqs + seqs)
            self.pending_blocks += blocks
            self.pending_seqs += seqs

    def settle(self, request_id: str) -> None:
        """`request_id`'s prompt is computed (or abandoned): no longer queued load here,
        even before the next heartbeat says so (a turn-by-turn client comes back at once)."""
        self.pending_tokens = max(0, self.pending_tokens - self.pending_prompts.pop(request_id, 0))

    def release(self, request_id: str) -> None:
        """`request_id` left this worker: nothing of it counts here any more, even before
        the next heartbeat says so (else a turn-by-turn client's next turn would see its
        prefix holder as still running the last one)."""
        self.settle(request_id)
        blocks, seqs = self.pending_holds.pop(request_id, (0, 0))
        self.pending_blocks = max(0, self.pending_blocks - blocks)
        self.pending_seqs = max(0, self.pending_seqs - seqs)

    def clear_pending(self) -> None:
        """A heartbeat that counts everything routed here: no estimate is left."""
        self.pending_tokens = self.pending_blocks = self.pending_seqs = 0
        self.pending_prompts.clear()
        self.pending_holds.clear()

    @property
    def worker_id(self) -> str:
        return self.reg.worker_id

    @property
    def role(self) -> Role:
        return self.reg.role

    @property
    def free_blocks(self) -> int:
        free = self.load.free_blocks if self.load else self.reg.total_blocks
        return free - self.pending_blocks

    @property
    def running(self) -> int:
        base = (self.load.running_seqs + self.load.waiting_seqs) if self.load else 0
        return base + self.pending_seqs

    @property
    def queued_tokens(self) -> int:
        return (self.load.queued_prefill_tokens if self.load else 0) + self.pending_tokens

    def describe(self, now: float) -> dict[str, Any]:
        load = self.load
        return {
            "id": self.worker_id,
            "role": self.role,
            "host_id": self.reg.host_id,
            "pid": self.reg.pid,
            "metrics_port": self.reg.metrics_port,
            "kv_address": self.reg.kv_address,
            "kv_transport": transport_kind(self.reg.kv_address),
            "kv_shm": self.reg.kv_shm,
            "compat_hash": self.reg.compat_hash,
            "quantization": self.reg.quantization,
            "lm_head_quantization": self.reg.lm_head_quantization,
            "kv_cache_dtype": self.reg.kv_cache_dtype,
            "total_blocks": self.reg.total_blocks,
            "block_size": self.reg.block_size,
            "free_blocks": load.free_blocks if load else self.reg.total_blocks,
            "running_seqs": load.running_seqs if load else 0,
            "waiting_seqs": load.waiting_seqs if load else 0,
            "queued_prefill_tokens": load.queued_prefill_tokens if load else 0,
            "inflight_requests": len(self.inflight),
            "draining": self.draining,
            "stalled": self.stalled,
            "steps": load.steps if load else 0,
            "last_heartbeat_age_s": round(now - self.last_seen, 3),
            "gauges": dict(load.gauges) if load else {},
            "lora_fingerprints": list(load.loras or []) if load else [],
        }


def _runnable(hb: Heartbeat) -> bool:
    """Work the worker can step by itself (KV still in transfer from elsewhere is not)."""
    return hb.running_seqs > 0 or hb.queued_prefill_tokens > 0


def _vouched(hb: Heartbeat, last_seq: int) -> list[str] | None:
    """The request ids `hb`'s load is known to count, or None when it cannot say which:
    no list, or a heartbeat lost since `last_seq` (the ids it listed are unknown)."""
    if hb.received is None or hb.seq < 1 or (last_seq and hb.seq != last_seq + 1):
        return None
    return hb.received


@dataclass(frozen=True)
class RegisterOutcome:
    accepted: bool
    reason: str = ""


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._workers: dict[str, WorkerInfo] = {}

    def register(self, reg: RegisterWorker, now: float) -> RegisterOutcome:
        """Add (or refresh) a worker. All workers must share one KV compatibility hash."""
        others = [w for w in self._workers.values() if w.worker_id != reg.worker_id]
        if others and any(w.reg.compat_hash != reg.compat_hash for w in others):
            return RegisterOutcome(False, (
                f"compat_hash {reg.compat_hash} differs from the registered workers' (model config, "
                "weights, dtype, quantization, KV-cache dtype, block size, head layout and, with "
                "draft_kv=prefill, the draft model must match)"))
        old = self._workers.get(reg.worker_id)
        info = WorkerInfo(reg=reg, registered_at=now, last_seen=now, progress_at=now)
        if old is not None:
            info.inflight = old.inflight
        self._workers[reg.worker_id] = info
        return RegisterOutcome(True)

    def heartbeat(self, hb: Heartbeat, now: float) -> bool:
        """Record load; False when the worker is unknown (it should re-register)."""
        info = self._workers.get(hb.worker_id)
        if info is None:
            return False
        info.last_seen = now
        if not _runnable(hb) or info.load is None or hb.steps != info.load.steps:
            info.progress_at = now
            info.stalled = False
        info.load = hb
        received = _vouched(hb, info.last_seq)
        info.last_seq = hb.seq
        if received is None:
            info.clear_pending()
        else:
            for request_id in received:  # another gateway's ids: nothing held, nothing to do
                info.release(request_id)
        return True

    def touch(self, worker_id: str, now: float) -> None:
        info = self._workers.get(worker_id)
        if info is not None:
            info.last_seen = now

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def expire(self, now: float) -> list[WorkerInfo]:
        """Remove and return every worker silent for longer than the timeout."""
        dead = [w for w in self._workers.values() if now - w.last_seen > self.heartbeat_timeout_s]
        for w in dead:
            del self._workers[w.worker_id]
        return dead

    def find_stalled(self, now: float, stall_timeout_s: float) -> list[WorkerInfo]:
        """Mark and return the workers that just became stalled: runnable work in their
        heartbeats and no step for longer than `stall_timeout_s`."""
        found = [w for w in self._workers.values()
                 if not w.stalled and w.load is not None and _runnable(w.load)
                 and now - w.progress_at > stall_timeout_s]
        for w in found:
            w.stalled = True
        return found

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def pool(self, role: Role) -> list[WorkerInfo]:
        """Routable workers of one role (draining and stalled workers excluded)."""
        return [w for w in self._workers.values() if w.role == role and not w.draining and not w.stalled]

    def all(self) -> list[WorkerInfo]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)
