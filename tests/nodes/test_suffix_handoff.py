"""Suffix-only handoff, prefill node -> decode node over the fake transport: a decode
worker that holds the first blocks of a prompt pins them, reserves only the rest, and
the prefill node ships only those; for every split point between the held prefix and
the new suffix (block-aligned and not) and every order of evicting the held blocks
first, the reused blocks are exactly the leading ones still cached, only the others
travel, and the tokens equal the single-process engine's (so no wrong block is read)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.common import protocol as p
from pdserve.engine.core.block_manager import BlockManager
from tests.engine.test_engine import assert_idle, make_engine, prompts
from tests.nodes.test_layerwise_push import PARAMS, Pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4
PROMPT = prompts(22, seed=11)[0]  # 5 full blocks + 2 tokens: at most 5 blocks reusable
FILLER = prompts(7, seed=12)[0]


@pytest.fixture()
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def evict(bm: BlockManager, block_id: int) -> None:
    """Evict one free cached block as LRU pressure would: put it at the LRU's head,
    then take every fresh block and one more for a scratch owner, and free them."""
    bm._free_cached.move_to_end(block_id, last=False)  # the test picks the victim
    scratch = -1
    assert bm.allocate_slots(scratch, (len(bm._free_fresh) + 1) * bm.block_size, 0) is not None
    bm.free(scratch)
    assert bm.match_prefix(PROMPT).block_ids.count(block_id) == 0


def test_every_split_and_eviction_order_reuses_exactly_the_leading_cached_blocks(model_dir: Path) -> None:
    want = list(make_engine(model_dir, block_size=BS).generate([PROMPT], PARAMS)[0].token_ids)
    pair = Pair(model_dir, budget=2048, block_size=BS)
    rng = random.Random(0)
    try:
        for split in range(len(PROMPT) + 1):
            for engine in (pair.pe, pair.de):
                engine.block_manager.reset_prefix_cache()
            # An earlier request shared the first `split` tokens: decode holds their full blocks.
            pair.run(f"a{split}", PROMPT[:split] + FILLER, target_first=True)
            held = list(pair.de.block_manager.match_prefix(PROMPT).block_ids)
            assert len(held) == min(split // BS, (len(PROMPT) - 1) // BS)
            victims = rng.sample(held, rng.randrange(len(held) + 1)) if held else []
            for b in victims:  # in a random order
                evict(pair.de.block_manager, b)
            kept = next((i for i, b in enumerate(held) if b in victims), len(held))
            before = shipped(pair)
            got = run_recording(pair, f"b{split}", kept, held[:kept])
            assert got == want, (split, victims)
            blocks = -(-len(PROMPT) // BS)
            assert shipped(pair) - before == (blocks - kept) * pair.decode.transfers.block_bytes
        assert_idle(pair.pe)
        assert_idle(pair.de)
    finally:
        pair.close()


def shipped(pair: Pair) -> float:
    """KV bytes the decode node received, over any transport."""
    return sum(s.value for m in pair.decode.metrics.registry.collect() for s in m.samples
               if s.name == "llm_kv_transfer_bytes_total")


def run_recording(pair: Pair, rid: str, kept: int, held: list[int]) -> list[int]:
    """Run `rid` through the pair, checking its reservation pins exactly `held`."""
    seen: list[p.ReserveResult] = []
    take = pair.take

    def spy(kind: type) -> object:
        msg = take(kind)
        if isinstance(msg, p.ReserveResult):
            seen.append(msg)
        return msg

    pair.take = spy  # type: ignore[method-assign]
    try:
        out = pair.run(rid, PROMPT, target_first=True)
    finally:
        pair.take = take  # type: ignore[method-assign]
    (reserved,) = seen
    assert reserved.cached_blocks == kept
    assert len(reserved.block_ids) == -(-len(PROMPT) // BS) - kept
    assert not set(reserved.block_ids) & set(held)
    return out


def test_a_queued_prompt_weighs_as_the_tokens_its_cache_does_not_hold(model_dir: Path) -> None:
    """The prefill worker's queued load (its heartbeat, which the KV-aware router weighs
    against a prefix hit) counts the prompt tokens it will compute, not the cached ones."""
    pair = Pair(model_dir, budget=2048, block_size=BS)
    try:
        pair.run("warm", PROMPT, target_first=True)  # the prefill worker caches 5 blocks
        again = [*PROMPT, *FILLER]  # 29 tokens: 20 cached, 9 to compute
        pair.prefill.handle(p.PrefillRequest("turn2", p.RequestPayload(again, PARAMS)))
        pair.prefill.handle(p.PrefillRequest("fresh", p.RequestPayload(FILLER, PARAMS)))
        assert pair.prefill.load().queued_prefill_tokens == (len(again) - 5 * BS) + len(FILLER)
        pair.prefill.handle(p.Abort(["turn2", "fresh"], "test"))
        assert pair.prefill.load().queued_prefill_tokens == 0
        assert_idle(pair.pe)
    finally:
        pair.close()
