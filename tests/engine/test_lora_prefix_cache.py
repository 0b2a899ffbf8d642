"""The prefix cache keys a block by its adapter: the chain of a sequence under LoRA
adapter A starts at A's own root (`pdserve.common.block_hash.prefix_root` of its weights
fingerprint), so a prompt cached under A is no hit under B or under the base model,
and the gateway's KV index computes the very keys the block manager registers."""

from __future__ import annotations

from pdserve.common.block_hash import ROOT_DIGEST, prefix_block_keys, prefix_root
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.cache_events import CacheEvents

BS = 4
TOKENS = list(range(100, 118))  # 4 cacheable full blocks


def _cache(bm: BlockManager, owner: int, root: bytes) -> None:
    assert bm.allocate_slots(owner, len(TOKENS), 0) is not None
    bm.cache_full_blocks(owner, TOKENS, len(TOKENS), root)


def test_a_hit_under_one_adapter_is_never_served_to_another() -> None:
    a, b = prefix_root("aa" * 32), prefix_root("bb" * 32)
    assert len({a, b, ROOT_DIGEST, prefix_root("")}) == 3 and prefix_root("") == ROOT_DIGEST
    bm = BlockManager(64, BS)
    _cache(bm, 1, a)
    bm.free(1)  # the blocks stay cached (free, in the LRU)
    assert bm.match_prefix(TOKENS, a).num_tokens == 16
    assert bm.match_prefix(TOKENS, b).num_tokens == 0
    assert bm.match_prefix(TOKENS).num_tokens == 0  # the base model
    _cache(bm, 2, ROOT_DIGEST)
    hit_base = bm.match_prefix(TOKENS)
    hit_a = bm.match_prefix(TOKENS, a)
    assert hit_base.num_tokens == hit_a.num_tokens == 16
    assert not set(hit_base.block_ids) & set(hit_a.block_ids)  # same tokens, other blocks
    assert bm.integrity_errors() == []


def test_the_gateway_keys_are_the_block_managers_under_an_adapter() -> None:
    root = prefix_root("cd" * 32)
    bm = BlockManager(64, BS)
    events = bm.record_events()
    _cache(bm, 1, root)
    stored = CacheEvents.netted(events.drain()).stored
    assert stored == prefix_block_keys(TOKENS, BS, root)
    assert not set(stored) & set(prefix_block_keys(TOKENS, BS))
