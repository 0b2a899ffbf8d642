"""A decode node's suffix-only handoff with its reused prefix from the KV tiers, prefill
node -> decode node over the fake transport: the decode node holds the blocks a shared
tier has (read while the prefill node computes the rest), the prefill node ships only
the others, and the tokens equal the single-process engine's; a tier block that turns
bad before it is read fails the request retryably (the gateway re-prefills) and leaks
nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from pdserve.common import protocol as p
from tests.engine.test_engine import assert_idle, make_engine, prompts
from tests.nodes.test_layerwise_push import PARAMS, Pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4
PROMPT = prompts(22, seed=21)[0]  # 5 full blocks + 2 tokens: 5 reusable


@pytest.fixture()
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture()
def pair(model_dir: Path, tmp_path: Path) -> Iterator[tuple[Pair, TieredKVCache, TieredKVCache]]:
    pr = Pair(model_dir, budget=2048, block_size=BS)
    caches = []
    for engine in (pr.pe, pr.de):  # one host tier, both workers
        cache = TieredKVCache(engine.runner.layout, [FileTier("host", tmp_path / "host", 1 << 26)])
        engine.attach_tiers(cache)
        caches.append(cache)
    yield pr, caches[0], caches[1]
    pr.close()
    for cache in caches:
        cache.close()


def test_the_decode_node_holds_what_the_tier_has_and_only_the_rest_travels(
        model_dir: Path, pair: tuple[Pair, TieredKVCache, TieredKVCache]) -> None:
    pr, pcache, dcache = pair
    want = list(make_engine(model_dir, block_size=BS).generate([PROMPT], PARAMS)[0].token_ids)
    assert pr.run("a", PROMPT, PARAMS) == want
    assert pcache.flush() and dcache.flush()
    pr.de.block_manager.reset_prefix_cache()  # the decode pool forgot it; the tier did not
    first = pr.start("b", PROMPT, PARAMS)
    assert pr.decode_all("b", first) == want
    assert dcache.snapshot().tiers[0].hits == 5
    assert pr.de.stats().num_waiting_for_kv == 0
    assert_idle(pr.pe)
    assert_idle(pr.de)


def test_a_tier_block_gone_bad_before_it_is_read_fails_the_request_retryably(
        model_dir: Path, pair: tuple[Pair, TieredKVCache, TieredKVCache]) -> None:
    pr, pcache, dcache = pair
    want = list(make_engine(model_dir, block_size=BS).generate([PROMPT], PARAMS)[0].token_ids)
    pr.run("a", PROMPT, PARAMS)
    assert pcache.flush() and dcache.flush()
    pr.de.block_manager.reset_prefix_cache()
    tier, real_present = dcache.tiers[0], dcache.present

    def present_then_damage(digests: list[bytes]) -> int:
        n = real_present(digests)
        path = tier.path(dcache.key(digests[1]))  # type: ignore[attr-defined]
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
        return n

    dcache.present = present_then_damage  # type: ignore[method-assign]
    first = pr.start("b", PROMPT, PARAMS)
    dcache.present = real_present  # type: ignore[method-assign]
    pr.decode.handle(p.StartDecode("b", "x-b", first.token_ids, first.logprobs))
    pr.settle()
    failed = pr.take(p.RequestFailed)
    assert failed.request_id == "b" and failed.retryable and "tier" in failed.reason
    assert dcache.snapshot().tiers[0].misses.get("corrupt") == 1
    assert_idle(pr.pe)
    assert_idle(pr.de)
    assert pr.run("c", PROMPT, PARAMS) == want  # the retry: block 1 on is shipped
    assert_idle(pr.de)
