"""The block manager's prefix-cache feed (its ordered event log netted per key,
pdserve/engine/core/cache_events.py) and the hash it shares with the gateway
(pdserve/common/block_hash.py): the gateway's KV index replays the feed, so at every drain
the replayed set must equal the cache, and the gateway's own chain of a prompt must name
exactly the blocks the engine cached for it."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

import pdserve.common.block_hash as shared_hash
from pdserve.common.block_hash import ROOT_DIGEST, block_key, cacheable_blocks, prefix_block_keys
from pdserve.engine.core import block_manager as bm_module
from pdserve.engine.core.block_events import AllCleared, BlockEventLog, BlocksStored
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.cache_events import CacheEvents

BS = 4


def _drain(log: BlockEventLog) -> CacheEvents:
    return CacheEvents.netted(log.drain())


def _run(bm: BlockManager, owner: int, tokens: list[int]) -> None:
    """A prompt admitted with its prefix hit, computed and cached (as the scheduler does)."""
    hit = bm.match_prefix(tokens)
    assert bm.allocate_slots(owner, len(tokens), hit.num_tokens, hit) is not None
    bm.cache_full_blocks(owner, tokens, len(tokens))


def test_the_engine_and_the_gateway_hash_a_prompt_identically() -> None:
    bm = BlockManager(64, BS)
    tokens = list(range(100, 123))  # 5 full blocks and a partial one
    _run(bm, 1, tokens)
    # The block manager's hash is the shared one, not a copy.
    assert bm_module.block_hash is shared_hash.block_hash
    assert bm_module.ROOT_DIGEST is shared_hash.ROOT_DIGEST
    keys = prefix_block_keys(tokens, BS)
    assert len(keys) == len(tokens) // BS == 5
    assert sorted(bm.cached_keys()) == sorted(keys)
    # Pinned by an independent computation: SHA-256 over the parent digest and little-endian int64 ids.
    first = hashlib.sha256(ROOT_DIGEST + struct.pack("<4q", 100, 101, 102, 103)).digest()
    assert keys[0] == int.from_bytes(first[:8], "big") >> 1 == block_key(first)
    assert all(0 <= k < 1 << 63 for k in keys)
    # A prompt that differs in block 0 shares no key; one that differs in block 3 shares 3.
    assert not set(prefix_block_keys([99, *tokens[1:]], BS)) & set(keys)
    assert prefix_block_keys([*tokens[:13], 7, *tokens[14:]], BS)[:3] == keys[:3]
    assert prefix_block_keys([*tokens[:13], 7, *tokens[14:]], BS)[3] != keys[3]


def test_cacheable_blocks_never_cover_the_last_token() -> None:
    bm = BlockManager(64, BS)
    tokens = list(range(16))
    _run(bm, 1, tokens)
    bm.free(1)
    for n in range(1, 17):
        assert bm.match_prefix(tokens[:n]).num_tokens == cacheable_blocks(n, BS) * BS


def test_stored_then_evicted_blocks_are_reported_once_with_their_final_state() -> None:
    bm = BlockManager(5, BS)  # 4 allocatable blocks
    log = bm.record_events()
    a = list(range(8))
    _run(bm, 1, a)
    ev = _drain(log)
    assert (sorted(ev.stored), ev.evicted, ev.reset) == (sorted(prefix_block_keys(a, BS)), [], False)
    assert _drain(log).empty
    bm.free(1)
    assert _drain(log).empty  # freed blocks stay cached
    b = list(range(50, 66))  # needs all 4 blocks: both of a's are evicted
    _run(bm, 2, b)
    ev = _drain(log)
    assert sorted(ev.evicted) == sorted(prefix_block_keys(a, BS))
    assert sorted(ev.stored) == sorted(prefix_block_keys(b, BS))
    bm.free(2)
    # Within one batch only the final state counts: stored and evicted again is just evicted.
    _run(bm, 3, a)
    bm.free(3)
    _run(bm, 4, list(range(70, 86)))
    ev = _drain(log)
    assert not set(ev.stored) & set(prefix_block_keys(a, BS))
    assert set(prefix_block_keys(a, BS)) <= set(ev.evicted)


def test_a_cleared_cache_or_an_overfull_log_asks_for_a_snapshot() -> None:
    bm = BlockManager(64, BS)
    log = bm.record_events()
    _run(bm, 1, list(range(12)))
    bm.reset_prefix_cache()
    assert _drain(log) == ([], [], True)
    three = [BlocksStored([bytes([i]) * 32], None, [i], ROOT_DIGEST) for i in range(3)]
    assert not CacheEvents.netted(three[:2], max_pending=2).reset
    assert CacheEvents.netted(three, max_pending=2) == ([], [], True)
    assert _drain(log).empty


@pytest.mark.parametrize("seed", range(6))
def test_replaying_the_feed_gives_the_cache_after_every_drain(seed: int) -> None:
    """Random prompts sharing prefixes, frees in random order, evictions under pressure:
    a reader that applies each netted batch (evicted, then stored), and one that applies
    the same drain's ordered events one by one (the vLLM-format feed), always hold exactly
    the block manager's cached keys."""
    rng = random.Random(seed)
    bm = BlockManager(12, BS)
    log = bm.record_events()
    stems = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    replica: set[int] = set()
    ordered: set[int] = set()
    live: list[int] = []
    for owner in range(60):
        if live and (rng.random() < 0.5 or bm.num_free_blocks < 5):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            prompt = rng.choice(stems)[: rng.randrange(1, 13)] + [rng.randrange(1000) for _ in range(rng.randrange(6))]
            hit = bm.match_prefix(prompt)
            if bm.allocate_slots(owner, len(prompt), hit.num_tokens, hit) is not None:
                bm.cache_full_blocks(owner, prompt, len(prompt))
                live.append(owner)
        if rng.random() < 0.4:
            events = log.drain()
            ev = CacheEvents.netted(events)
            assert not ev.reset
            replica -= set(ev.evicted)
            replica |= set(ev.stored)
            for e in events:
                keys = {block_key(d) for d in e.digests} if not isinstance(e, AllCleared) else set()
                ordered = ordered | keys if isinstance(e, BlocksStored) else ordered - keys
            assert replica == ordered == set(bm.cached_keys())
            assert bm.check_integrity()
