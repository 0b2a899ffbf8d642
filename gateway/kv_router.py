"""Which worker computes a prompt: KV-aware, least-loaded or round-robin routing, and
the per-request choice to prefill on the decode worker itself.

`kv-aware` (the default) picks the prefill worker (or, with only colocated workers,
the worker) of least cost, where

    cost(w) = uncached prompt tokens on w + what loading w's tier blocks costs
              + queued prefill tokens on w
              (+ RUNNING_SEQ_TOKENS per running sequence, colocated workers only)

`uncached` is the prompt's length minus the tokens w finds: the prompt's leading blocks
the KV index (gateway/kv_index.py) says w's pool holds, then those the KV tiers w is
attached to hold (gateway/kv_tiers.py: a host tier is every same-host worker's, so a
prefix another worker of the host wrote down counts for w too), never the last token
(pdserve/common/block_hash.py: `cacheable_blocks`). A tier block costs a fraction of
computing it (`TIER_TOKEN_COST`: host < disk < remote), so the cost of getting a
prefix orders the workers: own pool < host tier < disk < remote < recompute. Ties go
to fewer requests in flight, then the worker id. `least-loaded` is the cache-blind rule of
gateway/router.py; `round-robin` takes the pool in turn.

The decode worker of a disaggregated request (kv-aware, several decode workers): of
those with room for the blocks they would reserve (the prompt's, less the leading
ones they hold and pin), the one of least

    decode_cost(w) = prompt blocks w lacks (the blocks the prefill worker ships)
                     + what loading the blocks its tiers hold costs
                     + DECODE_RUNNING_SEQ_BLOCKS per sequence running on w

(a decode worker's reused prefix may come from its tiers: pdserve/engine/llm_engine.py,
`reserve_remote`; those blocks need free blocks to land in, pool hits do not)

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
the longest prefix of the prompt any worker holds, in its pool), `tier_hit` (the same,
part of it from its tiers), `shorter_prefix` (kv-aware, it holds part of the prompt but
another worker holds more: the load outweighed the longer hit), `load` (kv-aware, it
holds none), `least_loaded`, `round_robin`, `local_prefill`, `local_prefill_busy`, and
for reservations on decode workers `decode_prefix_hit` / `decode_tier_hit` (kv-aware
chose one that holds part of the prompt, in its pool only / partly in its tiers; other
decode choices count nothing). The tokens each worker's cache actually served (`cached_tokens`
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
from gateway.kv_tiers import PrefixReach
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
    predicted_blocks: int  # leading blocks the index said the worker finds, pool then tiers (cacheable only)
    block_size: int
    reason: str
    prompt_tokens: int = 0  # a worker reports at most this many cached (resumed output is not prompt)
    observed: bool = False  # the worker's cached_tokens came back
    num_tokens: int = 0  # everything the worker computes or finds cached: prompt and resumed output
    pool_blocks: int = -1  # of `predicted_blocks`, in its pool (-1: all of them)

    @property
    def in_pool(self) -> int:
        return self.predicted_blocks if self.pool_blocks < 0 else self.pool_blocks

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
        reach = self._reach(keys, pool, payload.num_tokens)
        kind = self.config.kind
        if kind == "round-robin":
            w, reason = sorted(pool, key=lambda w: w.worker_id)[next(self._turn) % len(pool)], "round_robin"
        elif kind == "least-loaded":
            colocated = pool[0].role == Role.COLOCATED
            best = pick_colocated(pool) if colocated else pick_prefill(pool)
            assert best is not None
            w, reason = best, "least_loaded"
        else:
            def cost(w: WorkerInfo) -> float:
                r = reach[w.worker_id]
                return (self.cost(w, payload.num_tokens, r.total * block_size, r.fetch_blocks() * block_size)
                        + lacks_lora(w, payload) * LORA_LOAD_TOKENS)

            w = min(pool, key=lambda w: (cost(w), len(w.inflight), w.worker_id))
            reason = self._kv_reason(reach[w.worker_id], max(r.total for r in reach.values()))
        self.decisions[reason] += 1
        r = reach[w.worker_id]
        return Pick(w, Route(w.worker_id, keys, r.total, block_size, reason, len(payload.prompt_token_ids),
                             num_tokens=payload.num_tokens, pool_blocks=r.pool))

    @staticmethod
    def _kv_reason(chosen: PrefixReach, best_blocks: int) -> str:
        if not chosen.total:
            return "load"
        if chosen.total < best_blocks:
            return "shorter_prefix"
        return "tier_hit" if chosen.tiered else "prefix_hit"

    @staticmethod
    def cost(w: WorkerInfo, num_tokens: int, cached_tokens: int, fetch_tokens: float = 0.0) -> float:
        """Uncached prompt tokens + the tier loads + queued load (the module docstring's formula)."""
        load = w.queued_tokens + (RUNNING_SEQ_TOKENS * w.running if w.role == Role.COLOCATED else 0)
        return num_tokens - cached_tokens + fetch_tokens + load

    def pick_decode(self, pool: Sequence[WorkerInfo], payload: RequestPayload,
                    count: bool = True) -> WorkerInfo | None:
        """The decode worker that reserves the prompt's blocks (the module docstring's
        rule); `count`: a reservation follows, count the decision."""
        if self.config.kind != "kv-aware" or len(pool) < 2:
            return pick_decode(pool)
        block_size = pool[0].reg.block_size
        need = blocks_needed(payload.num_tokens, block_size)
        reach = self._reach(prompt_keys(payload, block_size), pool, payload.num_tokens)
        roomy = [w for w in pool if w.free_blocks >= need - reach[w.worker_id].pool]  # tier blocks land in free ones
        if not roomy:
            return pick_decode(pool)

        def cost(w: WorkerInfo) -> float:
            r = reach[w.worker_id]
            return (self.decode_cost(w, need, r.total, r.fetch_blocks())
                    + lacks_lora(w, payload) * LORA_LOAD_BLOCKS)

        best = min(roomy, key=lambda w: (cost(w), -w.free_blocks, w.worker_id))
        r = reach[best.worker_id]
        if count and r.total:
            self.decisions["decode_tier_hit" if r.tiered else "decode_prefix_hit"] += 1
        return best

    @staticmethod
    def decode_cost(w: WorkerInfo, prompt_blocks: int, held_blocks: int, fetch_blocks: float = 0.0) -> float:
        """Blocks to ship + the tier loads + running load (the module docstring's formula)."""
        return prompt_blocks - held_blocks + fetch_blocks + DECODE_RUNNING_SEQ_BLOCKS * w.running

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
        reach = self._reach(keys, [decode], payload.num_tokens)[decode.worker_id]
        hit = reach.total  # tier blocks are loaded, not computed
        uncached = payload.num_tokens - hit * decode.reg.block_size
        if uncached <= threshold:
            reason = "local_prefill"
        elif uncached <= cap and min(w.queued_tokens for w in prefill_pool) >= BUSY_LOCAL_FACTOR * uncached:
            reason = "local_prefill_busy"
        else:
            return None
        self.decisions[reason] += 1
        return Route(decode.worker_id, keys, hit, decode.reg.block_size, reason,
                     len(payload.prompt_token_ids), num_tokens=payload.num_tokens, pool_blocks=reach.pool)

    def observe(self, route: Route | None, cached_tokens: int) -> None:
        """The worker's own count of cached prompt tokens (first report of an attempt):
        counted, and the index corrected where it predicted otherwise."""
        if route is None or route.observed:
            return
        route.observed = True
        self.cached_tokens[route.worker_id] += cached_tokens
        got = cached_tokens // route.block_size
        if got < route.predicted_blocks and cached_tokens < route.prompt_tokens:  # evicted meanwhile
            if got < route.in_pool:  # the pool fell short: where the tiers start is not known
                self.index.remove(route.worker_id, route.keys[got:route.in_pool])
            else:  # the pool held its part, the tiers not all of theirs
                self.index.tiers.discard(route.worker_id, route.keys[got:route.predicted_blocks])
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

    def _reach(self, keys: list[int], pool: Sequence[WorkerInfo], num_tokens: int) -> dict[str, PrefixReach]:
        """Per worker, the prompt's leading blocks in its pool, then in its tiers."""
        usable = keys[: cacheable_blocks(num_tokens, pool[0].reg.block_size)]
        hits = self.index.overlaps(usable, [w.worker_id for w in pool])
        return {wid: self.index.tiers.reach(wid, usable, n) for wid, n in hits.items()}

    @staticmethod
    def _max_cacheable(w: WorkerInfo, payload: RequestPayload) -> int:
        return cacheable_blocks(payload.num_tokens, w.reg.block_size) * w.reg.block_size
