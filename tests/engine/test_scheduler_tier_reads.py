"""Scheduler: a prompt whose next blocks the KV tiers hold is parked, never read on the
loop. Exact block ids: admission allocates the blocks the tiers have and asks for one
`TierRead`, taking no budget while the rest runs; a landed read (whole or partial) puts
it back at the front of WAITING, and the step that admits it carries the landed bytes
as a `BlockLoad` and computes from the first block that did not arrive; ending it while
parked frees every block. The tiers are a real `TieredKVCache` on a real file tier; no
model (as tests/engine/test_scheduler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from kv_transfer.tiers.record import block_payload_bytes
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.block_manager import NO_HIT
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import SequenceStatus
from pdserve.engine.tier_api import BlockLoad, TierRead
from tests.engine.test_scheduler import BS, make, run_step, seq, shape

LAYOUT = KVLayout("cfg", 2, 2, 8, BS, "float32", weights="w")
NO_LOAD = BlockLoad((), np.empty((0, 0), np.uint8), ())  # nothing arrived (the scheduler test stays torch-free)
PROMPT = list(range(13))  # 3 full blocks a hit may cover (never the last token)


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[tuple[Scheduler, TieredKVCache, list[bytes]]]:
    """A scheduler over a 9-block pool whose tiers hold PROMPT's 3 blocks."""
    s = make(num_blocks=9, budget=10)
    cache = TieredKVCache(LAYOUT, [FileTier("host", tmp_path / "host", 1 << 26)])
    digests = s.tier_digests(seq(PROMPT), NO_HIT)
    for d in digests:
        cache.offer(d, np.zeros(block_payload_bytes(LAYOUT), np.uint8))
    assert cache.flush() and len(digests) == 3
    s.tiers = cache
    yield s, cache, digests
    cache.close()


def payloads(n: int) -> np.ndarray:
    return np.stack([np.full(block_payload_bytes(LAYOUT), i, np.uint8) for i in range(n)])


def test_admission_parks_the_prompt_and_asks_for_one_read_without_taking_budget(
    tiered: tuple[Scheduler, TieredKVCache, list[bytes]],
) -> None:
    s, cache, digests = tiered
    a, b = seq(PROMPT, "a"), seq(list(range(100, 105)), "b")
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert out.tier_reads == (TierRead(a.seq_id, (1, 2, 3), tuple(digests)),)
    assert shape(out) == [(0, 5, [4, 5], True)]  # b runs in the whole budget meanwhile
    assert a.status is SequenceStatus.WAITING_FOR_KV and s.waiting_for_kv == {a.seq_id: a}
    assert not s.waiting and out.block_loads == ()
    assert s.tier_reads.uncomputed_tokens == 1  # the last token: the rest comes from the tiers
    assert cache.snapshot().loads == 0  # nothing was read: an existence check only
    out = run_step(s)  # still parked: nothing lands until the engine says so
    assert shape(out) == [(5, 1, [4, 5], True)] and out.tier_reads == ()


def test_a_partial_read_lands_at_the_front_and_computes_from_the_first_missing_block(
    tiered: tuple[Scheduler, TieredKVCache, list[bytes]],
) -> None:
    s, _, digests = tiered
    a, b, c = seq(PROMPT, "a"), seq(list(range(100, 105)), "b"), seq(list(range(200, 203)), "c")
    s.add(a)
    s.add(b)
    run_step(s)
    s.add(c)  # queued while a is parked: a goes back in front of it
    load = BlockLoad((1, 2), payloads(2), tuple(digests[:2]))  # block 3's record was bad
    s.land_tier_reads([(a.seq_id, load)])
    assert a.status is SequenceStatus.WAITING and list(s.waiting) == [a, c] and not s.waiting_for_kv
    out = run_step(s)
    # b decodes; a computes from token 8 (block 3 again, then a new block 6); c gets the rest.
    assert shape(out) == [(5, 1, [4, 5], True), (8, 5, [1, 2, 3, 6], True), (0, 3, [7], True)]
    assert out.block_loads == (load,)
    assert a.num_cached_tokens == 2 * BS
    assert s.num_cached_tokens_hit == 2 * BS and s.num_tier_tokens_hit == 2 * BS
    assert s.tier_reads.num_landed == 0


def test_a_read_that_brought_nothing_recomputes_the_whole_prompt_in_its_blocks(
    tiered: tuple[Scheduler, TieredKVCache, list[bytes]],
) -> None:
    s, _, _ = tiered
    a = seq(PROMPT, "a")
    s.add(a)
    run_step(s)
    s.land_tier_reads([(a.seq_id, NO_LOAD)])
    out = run_step(s)
    assert shape(out) == [(0, 10, [1, 2, 3], False)] and out.block_loads == ()
    assert a.num_cached_tokens == 0 and s.num_tier_tokens_hit == 0


def test_ending_a_parked_or_landed_prompt_frees_every_block(
    tiered: tuple[Scheduler, TieredKVCache, list[bytes]],
) -> None:
    s, _, digests = tiered
    bm = s.block_manager
    free = bm.num_free_blocks
    a, b = seq(PROMPT, "a"), seq(PROMPT, "b")
    s.add(a)
    s.add(b)
    run_step(s)  # both parked (the pool does not hold a's blocks until they are computed)
    assert bm.num_free_blocks == free - 6 and len(s.tier_reads) == 2
    s.finish(a, SequenceStatus.FINISHED_ABORTED)  # aborted while its read runs
    s.land_tier_reads(
        [(b.seq_id, BlockLoad((4, 5, 6), payloads(3), tuple(digests))), (a.seq_id, NO_LOAD)]
    )  # a's late result is ignored
    assert list(s.waiting) == [b] and s.tier_reads.num_landed == 1
    s.finish(b, SequenceStatus.FINISHED_ABORTED)  # aborted after it landed, before it ran
    assert bm.num_free_blocks == free and bm.check_integrity()
    assert s.num_unfinished == 0 and len(s.tier_reads) == 0 and s.tier_reads.num_landed == 0


def test_parked_prompts_count_toward_max_num_seqs(tmp_path: Path) -> None:
    s = make(num_blocks=9, budget=10, max_seqs=1)
    cache = TieredKVCache(LAYOUT, [FileTier("host", tmp_path / "host", 1 << 26)])
    for d in s.tier_digests(seq(PROMPT), NO_HIT):
        cache.offer(d, np.zeros(block_payload_bytes(LAYOUT), np.uint8))
    assert cache.flush()
    s.tiers = cache
    a, b = seq(PROMPT, "a"), seq(list(range(100, 105)), "b")
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert len(out.tier_reads) == 1 and out.chunks == [] and list(s.waiting) == [b]
    cache.close()
