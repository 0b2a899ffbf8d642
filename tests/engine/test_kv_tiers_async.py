"""A prefill or colocated engine reads a prompt's prefix from the KV tiers off its step
loop (tiny Llama, float32): while the read is held at a gate in front of the real host
tier, another request keeps decoding; once it lands the prompt is computed on top of the
read blocks and equals a cold recompute token for token, `cached_tokens` counting the
pool and tier tokens. A read that finds a block gone bad or gone, or does not land in
time, is a counted miss and a recompute from that block on; an abort while the read is
held leaks no block and the late bytes never reach the pool."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kv_transfer.tiers.base import KVTier
from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from pdserve.common.block_hash import ROOT_DIGEST, block_hash
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.sequence import SequenceStatus
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tier_fill import READ_TIMEOUT_S
from pdserve.worker.kv_tiers import TierCollector
from tests.engine.test_kv_tiers_engine import (
    BS,
    GREEDY,
    assert_idle,
    make_engine,
    prompts,
    with_tiers,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GATE_S = 60.0  # a test that never opens its gate fails this long after, never hangs
HELD_STEPS = 6
LONG = SamplingParams(max_tokens=HELD_STEPS + 8, temperature=0.0, ignore_eos=True)


class GatedTier:
    """A real tier whose reads wait at `gate` (the loader thread stops inside `get`);
    `reading` is set once a read waits there. Existence checks and writes pass."""

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier
        self.name, self.location, self.capacity, self.stats = (
            tier.name,
            tier.location,
            tier.capacity,
            tier.stats,
        )
        self.gate = threading.Event()
        self.reading = threading.Event()

    def get(self, key: bytes, into: memoryview | None = None) -> bytes | memoryview | None:
        self.reading.set()
        if not self.gate.wait(GATE_S):
            raise TimeoutError("the test never opened the gate")
        return self.tier.get(key, into)

    def put(self, key: bytes, record: bytes) -> bool:
        return self.tier.put(key, record)

    def contains(self, key: bytes) -> bool:
        return self.tier.contains(key)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return self.tier.lookup(keys)

    def discard(self, key: bytes) -> None:
        self.tier.discard(key)

    def close(self) -> None:
        self.tier.close()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


BASE = prompts(1, 5 * BS + 3, seed=31)[0]  # 5 full blocks the tier will hold
OTHER = prompts(1, 2 * BS + 1, seed=32)[0]  # never written: no tier read


@pytest.fixture(scope="module")
def host_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A host tier a colocated engine wrote BASE's blocks to (copied per test)."""
    root = tmp_path_factory.mktemp("tier") / "host"
    writer = make_engine(model_dir)
    cache = with_tiers(writer, FileTier("host", root, 1 << 26))
    writer.generate([BASE], GREEDY)
    cache.close()
    return root


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Callable[[list[int], SamplingParams], tuple[int, ...]]:
    engine = make_engine(model_dir)
    engine.block_manager.enable_prefix_caching = False
    return lambda prompt, params: engine.generate([prompt], params)[0].token_ids


@pytest.fixture
def gated(
    model_dir: Path, host_dir: Path, tmp_path: Path
) -> Iterator[tuple[LLMEngine, GatedTier, TieredKVCache]]:
    shutil.copytree(host_dir, tmp_path / "host")
    engine = make_engine(model_dir)
    tier = GatedTier(FileTier("host", tmp_path / "host", 1 << 26))
    cache = TieredKVCache(engine.runner.layout, [tier])  # attached by the test
    yield engine, tier, cache
    tier.gate.set()  # let a held read end before the loader shuts down
    cache.close()


class Streams:
    """Tokens and cached-token counts of each request, as `step` reports them."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.cached: dict[str, int] = {}

    def step(self) -> int:
        """One engine step; how many outputs it reported."""
        outs = self.engine.step()
        for out in outs:
            self.tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            self.cached[out.request_id] = out.num_cached_tokens
        return len(outs)

    def drain(self) -> None:
        """Step to the end, waiting on the tier reads when nothing else can run."""
        while self.engine.has_unfinished():
            if not self.step() and self.engine.tier_reads is not None:
                self.engine.tier_reads.wait_any(GATE_S)


def block_digests(tokens: list[int], n: int) -> list[bytes]:
    out, parent = [], ROOT_DIGEST
    for i in range(n):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
        out.append(parent)
    return out


def start_held(engine: LLMEngine, tier: GatedTier, streams: Streams, rid: str = "tiered") -> None:
    """Admit BASE: the engine parks it and its read waits at the gate."""
    engine.add_request(rid, BASE, GREEDY)
    streams.step()
    assert tier.reading.wait(GATE_S)  # the loader thread is inside the read
    assert (
        engine.scheduler.waiting_for_kv[engine.seq_id(rid)].status is SequenceStatus.WAITING_FOR_KV
    )


def test_other_requests_step_while_a_tier_read_is_held_then_the_hit_equals_a_recompute(
    gated: tuple[LLMEngine, GatedTier, TieredKVCache],
    reference: Callable[[list[int], SamplingParams], tuple[int, ...]],
) -> None:
    engine, tier, cache = gated
    # Its pool already holds BASE's first two blocks (a shorter, earlier prompt) ...
    assert engine.generate([BASE[: 2 * BS + 1]], GREEDY)[0].num_cached_tokens == 0
    engine.attach_tiers(cache)
    streams = Streams(engine)
    engine.add_request("running", OTHER, LONG)
    streams.step()
    assert len(streams.tokens["running"]) == 1
    # ... the tier the next three: BASE is parked while they are read.
    start_held(engine, tier, streams)
    assert len(streams.tokens["running"]) == 2  # the step that parked it decoded too
    for _ in range(HELD_STEPS):
        streams.step()
    assert len(streams.tokens["running"]) == 2 + HELD_STEPS  # the held read stalled no step
    assert "tiered" not in streams.tokens
    assert engine.stats().num_waiting_for_kv == 1 and cache.snapshot().loads == 0
    tier.gate.set()
    streams.drain()
    assert tuple(streams.tokens["tiered"]) == reference(BASE, GREEDY)
    assert tuple(streams.tokens["running"]) == reference(OTHER, LONG)
    assert streams.cached["tiered"] == 5 * BS  # 2 blocks from the pool, 3 from the tier
    assert engine.scheduler.num_tier_tokens_hit == 3 * BS
    snap = cache.snapshot()
    assert snap.tiers[0].hits == 3 and snap.loaded_blocks == 3 and snap.tiers[0].misses == {}
    assert engine.scheduler.tier_reads.num_landed == 0
    assert_idle(engine)


def test_the_loop_is_woken_as_a_read_ends_and_takes_its_blocks_at_the_next_step(
    gated: tuple[LLMEngine, GatedTier, TieredKVCache],
    reference: Callable[[list[int], SamplingParams], tuple[int, ...]],
) -> None:
    engine, tier, cache = gated
    woken = threading.Event()
    engine.attach_tiers(cache, on_read_done=woken.set)  # a worker's: its idle wait ends
    streams = Streams(engine)
    start_held(engine, tier, streams)
    assert not woken.is_set()  # the read is held inside the tier
    tier.gate.set()
    assert woken.wait(GATE_S)  # called on the loader thread once the read ended
    streams.step()  # the very next step admits it, computing only the rest
    assert streams.cached["tiered"] == 5 * BS and engine.stats().num_waiting_for_kv == 0
    streams.drain()
    assert tuple(streams.tokens["tiered"]) == reference(BASE, GREEDY)
    assert_idle(engine)


@pytest.mark.parametrize("how", ["corrupt", "gone"])
def test_a_block_gone_bad_while_the_read_waits_is_a_counted_miss_and_recomputed(
    gated: tuple[LLMEngine, GatedTier, TieredKVCache],
    how: str,
    reference: Callable[[list[int], SamplingParams], tuple[int, ...]],
) -> None:
    engine, tier, cache = gated
    engine.attach_tiers(cache)
    streams = Streams(engine)
    start_held(engine, tier, streams)
    path = tier.tier.path(cache.key(block_digests(BASE, 3)[2]))  # type: ignore[attr-defined]
    if how == "corrupt":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()  # evicted by another worker of the host meanwhile
    tier.gate.set()
    streams.drain()
    assert tuple(streams.tokens["tiered"]) == reference(BASE, GREEDY)
    assert streams.cached["tiered"] == 2 * BS  # blocks 0 and 1 arrived; block 2 on is recomputed
    assert engine.scheduler.num_tier_tokens_hit == 2 * BS
    assert cache.snapshot().tiers[0].misses == {"corrupt" if how == "corrupt" else "absent": 1}
    assert_idle(engine)
    assert cache.flush()  # the recomputed blocks were written down in the bad one's place
    assert all(tier.contains(cache.key(d)) for d in block_digests(BASE, 5))


def test_an_abort_while_the_read_is_held_leaks_no_block_and_the_late_bytes_land_nowhere(
    gated: tuple[LLMEngine, GatedTier, TieredKVCache],
    reference: Callable[[list[int], SamplingParams], tuple[int, ...]],
) -> None:
    engine, tier, cache = gated
    engine.attach_tiers(cache)
    bm = engine.block_manager
    free = bm.num_free_blocks
    streams = Streams(engine)
    start_held(engine, tier, streams)
    assert bm.num_free_blocks == free - 5  # the parked prompt holds the blocks being read into
    assert engine.abort("tiered")
    assert bm.num_free_blocks == free and bm.check_integrity()
    assert not engine.has_unfinished() and len(engine.scheduler.tier_reads) == 0
    assert engine.tier_reads is not None and len(engine.tier_reads) == 0
    # Another prompt takes the freed blocks while the aborted read is still held ...
    engine.add_request("other", OTHER, LONG)
    streams.step()
    tier.gate.set()
    cache.load_async([]).result(GATE_S)  # one loader thread: the held read has ended now
    streams.drain()
    # ... and the aborted read's bytes never reached them.
    assert tuple(streams.tokens["other"]) == reference(OTHER, LONG)
    assert_idle(engine)
    assert engine.generate([BASE], GREEDY)[0].token_ids == reference(BASE, GREEDY)
    assert_idle(engine)


def test_a_read_that_does_not_land_in_time_is_given_up_and_recomputed(
    gated: tuple[LLMEngine, GatedTier, TieredKVCache],
    reference: Callable[[list[int], SamplingParams], tuple[int, ...]],
) -> None:
    engine, tier, cache = gated
    engine.attach_tiers(cache)
    assert engine.tier_reads is not None
    now = [0.0]
    engine.tier_reads.clock = lambda: now[0]
    streams = Streams(engine)
    start_held(engine, tier, streams)
    streams.step()
    assert "tiered" not in streams.tokens  # within the deadline: still parked
    now[0] += READ_TIMEOUT_S
    streams.drain()  # the gate stays shut: the recompute does not need the stuck read
    assert tuple(streams.tokens["tiered"]) == reference(BASE, GREEDY)
    assert streams.cached["tiered"] == 0 and engine.scheduler.num_tier_tokens_hit == 0
    assert engine.tier_reads.num_timeouts == 1 and cache.snapshot().load_timeouts == 1
    exported = {
        f.name: f.samples[0].value for f in TierCollector(cache.snapshot, {}).collect() if f.samples
    }
    assert exported["llm_kv_tier_load_timeouts"] == 1  # the worker's metric
    assert_idle(engine)
