"""Which worker computes a prompt: KV-aware, least-loaded or round-robin routing, and
the per-request choice to prefill on the decode worker itself.

`kv-aware` (the default) picks the prefill worker (or, with only colocated workers,
the worker) of least cost, where

    cost(w) = uncached prompt tokens on w + queued prefill tokens on w
              (+ RUNNING_SEQ_TOKENS per running sequence, colocated workers only)

`uncached` is the prompt's length minus the tokens w's prefix cache would serve: the
prompt's leading blocks the KV index (gateway/kv_index.py) says w holds, never the
last token (pdserve/common/block_hash.py: `cacheable_blocks`). Ties go to fewer requests in
flight, then the worker id. `least-loaded` is the cache-blind rule of
gateway/router.py; `round-robin` takes the pool in turn.

The decode worker of a disaggregated request (kv-aware, several decode workers): of
those with room for the blocks they would reserve (the prompt's, less the leading
ones they hold and pin), the one of least

    decode_cost(w) = prompt blocks w lacks (the blocks the prefill worker ships)
                     + DECODE_RUNNING_SEQ_BLOCKS per sequence running on w

ties to more free blocks, then the worker id. With no room anywhere, or another
router, the decode worker with the most free KV (gateway/router.py: `pick_decode`).

A request under a LoRA adapter: its block keys start from the adapter's root (only a
prefix cached under that adapter is a hit), and a worker that does not hold the adapter
(`Heartbeat.loras`) costs LORA_LOAD_TOKENS more (LORA_LOAD_BLOCKS on the decode side):
an adapter's requests gather on the workers that have it until their load outweighs
the read, then spread.

Local prefill (`local_prefill_threshold` > 0, any router): when the decode worker
chosen for a disaggregated request would have to compute at most that many of the
prompt's tokens itself (its own prefix cache counted), it runs the whole request
(`RunRequest`): no prefill worker, no KV transfer. A prompt of up to
BUSY_LOCAL_FACTOR x the threshold uncached tokens also runs there when it would wait
behind a long prefill: every prefill worker has at least BUSY_LOCAL_FACTOR x as many
tokens queued as the prompt would compute (reason `local_prefill_busy`). The wait
would then dwarf the prompt's own compute, and the cap bounds the stall it adds to
the decode worker's streams.

Each decision is counted by reason: `prefix_hit` (kv-aware, the chosen worker holds
the longest prefix of the prompt any worker holds), `shorter_prefix` (kv-aware, it holds
part of the prompt but another worker holds more: the load outweighed the longer hit),
`load` (kv-aware, it holds none), `least_loaded`, `round_robin`,
`local_prefill`, `local_prefill_busy`, and for reservations on decode workers `decode_prefix_hit` (kv-aware
chose one that holds part of the prompt; other decode choices count nothing). The tokens each worker's cache actually served (`cached_tokens`
reported back) are counted per worker and correct the index.

Queued load is work, not prompt length: a request routed to a worker weighs there (until
the next heartbeat) as the prompt tokens its cache will not serve (`Route.uncached_tokens`),
and a prefill worker's heartbeat counts its queued prompts' uncached tokens the same way.
Counting whole prompts made a conversation's prefix holder look busy with the cached parts
of its queued turns, so the next turn went to a worker that had to recompute it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gateway.backend import FleetSample
from gateway.kv_index import KvIndex
from gateway.registry import WorkerInfo
from gateway.router import blocks_needed, pick_colocated, pick_decode, pick_prefill
from pdserve.common.block_hash import cacheable_blocks, prefix_block_keys, prefix_root
from pdserve.common.protocol import RequestPayload
from pdserve.common.roles import Role

ROUTERS = ("kv-aware", "least-loaded", "round-robin")
# What one running sequence weighs against queued prompt tokens on a colocated worker.
RUNNING_SEQ_TOKENS = 16
# What one running sequence weighs against a block shipped to a decode worker: each
# slows every decode step there, a shipped block costs one copy once.
DECODE_RUNNING_SEQ_BLOCKS = 4
# What reading a LoRA adapter a worker lacks weighs against prompt tokens / blocks.
LORA_LOAD_TOKENS = 64
LORA_LOAD_BLOCKS = 4
# A prompt of up to this many times the local-prefill threshold runs on the decode worker
# when every prefill worker has this many times its uncached tokens queued.
BUSY_LOCAL_FACTOR = 4


@dataclass(frozen=True)
class RouterConfig:
    kind: str = "kv-aware"
    local_prefill_threshold: int = 0  # tokens; 0: every disaggregated request ships its KV

    def __post_init__(self) -> None:
        if self.kind not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {self.kind!r}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")


@dataclass
class Route:
    """Where one attempt's prompt went and what the index predicted there."""

    worker_id: str
    keys: list[int]  # the prompt's full-block keys
    predicted_blocks: int  # leading blocks the index said the worker holds (cacheable only)
    block_size: int
    reason: str
    prompt_tokens: int = 0  # a worker reports at most this many cached (resumed output is not prompt)
    observed: bool = False  # the worker's cached_tokens came back
    num_tokens: int = 0  # everything the worker computes or finds cached: prompt and resumed output

    @property
    def uncached_tokens(self) -> int:
        """The tokens the worker is predicted to compute: its queued load until it has."""
        return max(0, self.num_tokens - self.predicted_blocks * self.block_size)


class Pick(NamedTuple):
    worker: WorkerInfo
    route: Route


def prompt_keys(payload: RequestPayload, block_size: int) -> list[int]:
    """The block keys of everything the worker prefills: the prompt and any resumed output,
    in the chain of the request's LoRA adapter (so no adapter's blocks count for another)."""
    root = prefix_root(payload.lora.fingerprint if payload.lora is not None else "")
    return prefix_block_keys([*payload.prompt_token_ids, *payload.output_token_ids], block_size, root)


def lacks_lora(w: WorkerInfo, payload: RequestPayload) -> bool:
    """The request runs under an adapter the worker does not hold."""
    lora = payload.lora
    held = w.load.loras if w.load is not None else None
    return lora is not None and lora.fingerprint not in (held or ())


class KvRouter:
    def __init__(self, config: RouterConfig, index: KvIndex) -> None:
        self.config = config
        self.index = index
        self.decisions: Counter[str] = Counter()  # reason -> count
        self.cached_tokens: Counter[str] = Counter()  # worker -> prompt tokens its cache served
        self._turn = itertools.count()

    def pick(self, pool: Sequence[WorkerInfo], payload: RequestPayload) -> Pick | None:
        """The worker of `pool` (prefill or colocated) that computes the prompt."""
        if not pool:
            return None
        block_size = pool[0].reg.block_size
        keys = prompt_keys(payload, block_size)
        hits = self._hit_blocks(keys, pool, payload.num_tokens)
        kind = self.config.kind
        if kind == "round-robin":
            w, reason = sorted(pool, key=lambda w: w.worker_id)[next(self._turn) % len(pool)], "round_robin"
        elif kind == "least-loaded":
            colocated = pool[0].role == Role.COLOCATED
            best = pick_colocated(pool) if colocated else pick_prefill(pool)
            assert best is not None
            w, reason = best, "least_loaded"
        else:
            w = min(pool, key=lambda w: (self.cost(w, payload.num_tokens, hits[w.worker_id] * block_size)
                                         + lacks_lora(w, payload) * LORA_LOAD_TOKENS,
                                         len(w.inflight), w.worker_id))
            reason = self._kv_reason(hits[w.worker_id], max(hits.values()))
        self.decisions[reason] += 1
        return Pick(w, Route(w.worker_id, keys, hits[w.worker_id], block_size, reason,
                             len(payload.prompt_token_ids), num_tokens=payload.num_tokens))

    @staticmethod
    def _kv_reason(chosen_blocks: int, best_blocks: int) -> str:
        if not chosen_blocks:
            return "load"
        return "prefix_hit" if chosen_blocks >= best_blocks else "shorter_prefix"

    @staticmethod
    def cost(w: WorkerInfo, num_tokens: int, cached_tokens: int) -> int:
        """Uncached prompt tokens + queued load (the module docstring's formula)."""
        load = w.queued_tokens + (RUNNING_SEQ_TOKENS * w.running if w.role == Role.COLOCATED else 0)
        return num_tokens - cached_tokens + load

    def pick_decode(self, pool: Sequence[WorkerInfo], payload: RequestPayload,
                    count: bool = True) -> WorkerInfo | None:
        """The decode worker that reserves the prompt's blocks (the module docstring's
        rule); `count`: a reservation follows, count the decision."""
        if self.config.kind != "kv-aware" or len(pool) < 2:
            return pick_decode(pool)
        block_size = pool[0].reg.block_size
        need = blocks_needed(payload.num_tokens, block_size)
        hits = self._hit_blocks(prompt_keys(payload, block_size), pool, payload.num_tokens)
        roomy = [w for w in pool if w.free_blocks >= need - hits[w.worker_id]]
        if not roomy:
            return pick_decode(pool)
        best = min(roomy, key=lambda w: (self.decode_cost(w, need, hits[w.worker_id])
                                         + lacks_lora(w, payload) * LORA_LOAD_BLOCKS, -w.free_blocks, w.worker_id))
        if count and hits[best.worker_id]:
            self.decisions["decode_prefix_hit"] += 1
        return best

    @staticmethod
    def decode_cost(w: WorkerInfo, prompt_blocks: int, held_blocks: int) -> int:
        """Blocks to ship + running load (the module docstring's formula)."""
        return prompt_blocks - held_blocks + DECODE_RUNNING_SEQ_BLOCKS * w.running

    def local_prefill(self, decode: WorkerInfo, payload: RequestPayload,
                      prefill_pool: Sequence[WorkerInfo] = ()) -> Route | None:
        """A route onto decode worker `decode` when its uncached part of the prompt is
        within the threshold, or would wait behind a long prefill on every worker of
        `prefill_pool` (the module docstring's rule); None: prefill elsewhere and ship
        the KV."""
        threshold = self.config.local_prefill_threshold
        cap = threshold * (BUSY_LOCAL_FACTOR if prefill_pool else 1)
        if threshold <= 0 or payload.num_tokens > cap + self._max_cacheable(decode, payload):
            return None  # cannot be within the cap even with every block cached
        keys = prompt_keys(payload, decode.reg.block_size)
        hit = self._hit_blocks(keys, [decode], payload.num_tokens)[decode.worker_id]
        uncached = payload.num_tokens - hit * decode.reg.block_size
        if uncached <= threshold:
            reason = "local_prefill"
        elif uncached <= cap and min(w.queued_tokens for w in prefill_pool) >= BUSY_LOCAL_FACTOR * uncached:
            reason = "local_prefill_busy"
        else:
            return None
        self.decisions[reason] += 1
        return Route(decode.worker_id, keys, hit, decode.reg.block_size, reason,
                     len(payload.prompt_token_ids), num_tokens=payload.num_tokens)

    def observe(self, route: Route | None, cached_tokens: int) -> None:
        """The worker's own count of cached prompt tokens (first report of an attempt):
        counted, and the index corrected where it predicted otherwise."""
        if route is None or route.observed:
            return
        route.observed = True
        self.cached_tokens[route.worker_id] += cached_tokens
        got = cached_tokens // route.block_size
        if got < route.predicted_blocks and cached_tokens < route.prompt_tokens:  # evicted meanwhile
            self.index.remove(route.worker_id, route.keys[got:route.predicted_blocks])
        elif got > route.predicted_blocks:
            self.index.add(route.worker_id, route.keys[:got])

    def samples(self) -> list[FleetSample]:
        """Decisions by reason and prompt tokens served from each worker's cache
        (cumulative counts), for the gateway's /metrics."""
        kind = self.config.kind
        out = [FleetSample("llm_routing_decisions", "Routing decisions by router and reason (cumulative)",
                           {"router": kind, "reason": r}, float(n)) for r, n in sorted(self.decisions.items())]
        out += [FleetSample("llm_routed_cached_tokens", "Prompt tokens served from the worker's prefix cache "
                            "(cumulative)", {"worker": w}, float(n)) for w, n in sorted(self.cached_tokens.items())]
        return out

    def _hit_blocks(self, keys: list[int], pool: Sequence[WorkerInfo], num_tokens: int) -> dict[str, int]:
        usable = keys[: cacheable_blocks(num_tokens, pool[0].reg.block_size)]
        return self.index.overlaps(usable, [w.worker_id for w in pool])

    @staticmethod
    def _max_cacheable(w: WorkerInfo, payload: RequestPayload) -> int:
        return cacheable_blocks(payload.num_tokens, w.reg.block_size) * w.reg.block_size
