"""A worker's KV tiers (kv_transfer/tiers): built for the node's pool, attached to its
engine, exported in its Prometheus metrics, flushed and closed with the node.

Every role reads and writes the tiers, never on its step loop: prefill and colocated
workers on admission (a prompt is parked while the loader thread reads its blocks:
pdserve/engine/core/tier_reads.py), a decode worker when it reserves a prompt's blocks
(its reused prefix may come from the tiers: `LLMEngine.reserve_remote`), and each writes
down the blocks it registers (the writer thread). Tensor- and pipeline-parallel workers do not use them
(each rank holds only part of a block).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from kv_transfer.tiers import (
    CacheSnapshot,
    KVOffloadConfig,
    TieredKVCache,
    TierEventLog,
    build_tier_cache,
)
from kv_transfer.tiers.record import HEADER_BYTES
from pdserve.common.protocol import KvTierInfo
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


def attach_tiers(config: KVOffloadConfig | None, engine: LLMEngine, metrics: WorkerMetrics,
                 events: TierEventLog | None = None,
                 wake: Callable[[], None] | None = None) -> list[Callable[[], Any]]:
    """Give `engine` the configured tiers; the cleanup that flushes and closes them.
    With `events` (KV events on) the tiers' writer reports what it stores and evicts.
    `wake` (the main loop's, `NodeParts.wake`) is called on the loader thread as each
    read ends, so an idle loop takes the blocks at once rather than at its next tick."""
    if config is None or not config.enabled:
        return []
    if engine.config.tensor_parallel_size > 1 or engine.config.pipeline_parallel_size > 1:
        log.warning("KV tiers are off: not supported with tensor or pipeline parallelism yet")
        return []
    cache = build_tier_cache(config, engine.runner.layout, events)
    assert cache is not None
    engine.attach_tiers(cache, on_read_done=wake)
    metrics.registry.register(TierCollector(cache.snapshot, metrics.labels))
    log.info("KV tiers below the pool: %s", ", ".join(t.name for t in cache.tiers))
    return [cache.close]


class TierCollector(Collector):
    """`llm_kv_tier_*{tier=host|disk|remote}`, read from the cache's snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], CacheSnapshot], labels: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = labels

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())

        def family(kind: Any, name: str, doc: str, extra: tuple[str, ...] = ("tier",)) -> Any:
            return kind(name, doc, labels=[*names, *extra])

        hits = family(CounterMetricFamily, "llm_kv_tier_hits", "Blocks a KV tier served")
        misses = family(CounterMetricFamily, "llm_kv_tier_misses", "Blocks a KV tier did not serve, by "
                        "reason: absent, corrupt, truncated, foreign, unavailable", ("tier", "reason"))
        read = family(CounterMetricFamily, "llm_kv_tier_read_bytes", "Bytes read from a KV tier")
        written = family(CounterMetricFamily, "llm_kv_tier_written_bytes", "Bytes written to a KV tier")
        failures = family(CounterMetricFamily, "llm_kv_tier_write_failures", "Blocks a KV tier could not store")
        evictions = family(CounterMetricFamily, "llm_kv_tier_evictions", "Blocks a KV tier evicted")
        stored = family(GaugeMetricFamily, "llm_kv_tier_stored_bytes", "Bytes a KV tier holds (last scan)")
        for t in snap.tiers:
            hits.add_metric([*values, t.name], t.hits)
            for reason, n in sorted(t.misses.items()):
                misses.add_metric([*values, t.name, reason], n)
            read.add_metric([*values, t.name], t.bytes_read)
            written.add_metric([*values, t.name], t.bytes_written)
            failures.add_metric([*values, t.name], t.write_failures)
            evictions.add_metric([*values, t.name], t.evictions)
            stored.add_metric([*values, t.name], t.stored_bytes)
        yield from (hits, misses, read, written, failures, evictions, stored)
        load = SummaryMetricFamily("llm_kv_tier_load_seconds", "Time to load a prompt's blocks from the "
                                   "KV tiers (lookups that found at least one)", labels=names)
        load.add_metric(values, snap.loads, snap.load_seconds)
        yield load
        for kind, name, doc, value in (
            (CounterMetricFamily, "llm_kv_tier_loaded_blocks", "Blocks loaded from the KV tiers", snap.loaded_blocks),
            (CounterMetricFamily, "llm_kv_tier_dropped_writes", "Blocks not written down because the write "
             "queue was full (the step loop never waits)", snap.dropped_writes),
            (GaugeMetricFamily, "llm_kv_tier_queued_writes", "Blocks queued for (or being) written down",
             snap.queued_writes),
            (CounterMetricFamily, "llm_kv_tier_load_timeouts", "Loads from the KV tiers not landed in time: "
             "given up, their blocks recomputed", snap.load_timeouts),
        ):
            one = family(kind, name, doc, ())
            one.add_metric(values, value)
            yield one


def tier_infos(engine: LLMEngine) -> tuple[KvTierInfo, ...]:
    """The engine's tiers as its registration names them (gateway/kv_tiers.py)."""
    cache = tier_cache_of(engine)
    if cache is None:
        return ()
    record = HEADER_BYTES + cache.payload_bytes
    return tuple(KvTierInfo(t.name, t.location, t.capacity // record) for t in cache.tiers)


def tier_cache_of(engine: LLMEngine) -> TieredKVCache | None:
    """The engine's tier cache, if it has one (tests and benchmarks flush it)."""
    link = engine.tier_link
    return link.tiers if link is not None and isinstance(link.tiers, TieredKVCache) else None
