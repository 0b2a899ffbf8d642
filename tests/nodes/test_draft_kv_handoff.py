"""Draft KV made on the prefill worker (draft_kv=prefill), prefill node -> decode node
over the fake transport, the test acting as the gateway: the decode worker gets the
draft's KV with the target's, its first speculative step prefills no draft, the tokens
equal the engine without speculation, and every block of both pools on both sides comes
back -- after a finished request, an abort mid-handoff and a draft transfer that fails.
The layout hash covers the draft (not K) only with draft_kv=prefill."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_transfer.api import TransferState
from kv_transfer.fake import FakeFabric, FakeReceiver, fake_sender
from kv_transfer.pool.tensor_adapter import pool_array
from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.decoder import SpecStats
from pdserve.engine.spec.draft_model import DraftModelProposer
from pdserve.worker.draft_kv import DRAFT_WAIT_STEPS, DraftReceipts, DraftShipper
from pdserve.worker.metrics import WorkerMetrics
from tests.engine.test_engine import assert_idle
from tests.engine.test_spec_decode import GREEDY, SEEDED, make_engine, prompts
from tests.nodes.harness import NodePair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BS = 4


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def spec(draft: Path, draft_kv: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig("draft_model", k, model=str(draft), draft_kv=draft_kv, disable_by_batch_size=64)


def proposer(engine: LLMEngine) -> DraftModelProposer:
    assert engine.spec is not None and isinstance(engine.spec.proposer, DraftModelProposer)
    return engine.spec.proposer


def _wait(done: Callable[[], bool], step: Callable[[], object] = lambda: None) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline
        step()


class DraftPair(NodePair):
    """Prefill and decode nodes, both with the target as its own draft (every greedy draft
    is then accepted exactly when the draft KV is right); `ship`: draft_kv=prefill."""

    def __init__(self, model_dir: Path, ship: bool) -> None:
        cfg = spec(model_dir, "prefill" if ship else "decode")
        fabric = FakeFabric()
        pe = make_engine(model_dir, cfg if ship else None, block_size=BS)
        de = make_engine(model_dir, cfg, block_size=BS)
        layout = pe.runner.layout
        shipper = receipts = None
        if ship:
            pd, dd = proposer(pe), proposer(de)
            dl = pd.runner.layout
            shipper = DraftShipper(pd, fake_sender(dl, pool_array(pd.runner.pool.kv), fabric),
                                   WorkerMetrics("prefill", "p"))
            receipts = DraftReceipts(dd, FakeReceiver(dl, pool_array(dd.runner.pool.kv), fabric),
                                     WorkerMetrics("decode", "d"))
        super().__init__(pe, de, fake_sender(layout, pool_array(pe.runner.pool.kv), fabric),
                         FakeReceiver(layout, pool_array(de.runner.pool.kv), fabric),
                         shipper=shipper, receipts=receipts)

    def run(self, rid: str, prompt: list[int], params: SamplingParams, **start: Any) -> list[int]:
        """With draft_kv=prefill, the draft's KV lands before decode gets the first token:
        adopted at admission, every step drafts as decode-local would."""
        first = self.start(rid, prompt, params, **start)
        receipts = self.receipts
        if receipts is not None:
            _wait(lambda: receipts.state(f"x-{rid}") == TransferState.COMPLETE)
        return self.decode_all(rid, first)

    def assert_idle(self) -> None:
        for engine in (self.pe, self.de):
            assert_idle(engine)
            bm = proposer(engine).blocks if engine.spec is not None else None
            if bm is not None:
                assert bm.num_free_blocks == bm.num_allocatable and bm.check_integrity(), bm.integrity_errors()


def reference(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(make_engine(model_dir, block_size=BS).generate([prompt], params)[0].token_ids)


def test_shipped_draft_kv_is_adopted_and_the_decode_worker_prefills_no_draft(model_dir: Path) -> None:
    prompt = prompts(23, seed=7)[0]
    local, shipped = DraftPair(model_dir, ship=False), DraftPair(model_dir, ship=True)
    try:
        for params in (GREEDY, SEEDED):
            want = reference(model_dir, prompt, params)
            assert local.run(f"l{params.seed}", prompt, params) == want
            assert shipped.run(f"s{params.seed}", prompt, params) == want
        # Decode-local prefills the draft over each prompt (and its first token); shipped, never.
        assert proposer(local.de).prefill_tokens == 2 * (len(prompt) + 1)
        assert proposer(shipped.de).prefill_tokens == 0
        stats = shipped.de.stats().spec
        assert stats is not None and stats.draft_prefill_tokens == 0 and stats.num_drafts > 0
        # The target drafting for itself over the shipped KV: its greedy drafts hold as
        # well as over KV it prefilled itself (wrong KV would be rejected).
        was = local.de.stats().spec
        assert was is not None and stats.num_accepted_tokens == was.num_accepted_tokens > 0
        local.assert_idle()
        shipped.assert_idle()
    finally:
        local.close()
        shipped.close()


@pytest.fixture(scope="module")
def shipping(model_dir: Path) -> Iterator[DraftPair]:
    """One draft_kv=prefill pair for the tests below, each of which leaves it idle."""
    pair = DraftPair(model_dir, ship=True)
    try:
        yield pair
    finally:
        pair.close()


def test_an_abort_and_a_failed_draft_transfer_leak_no_block(model_dir: Path, shipping: DraftPair) -> None:
    pair, receipts = shipping, shipping.receipts
    assert receipts is not None
    prompt = prompts(30, seed=8)[0]
    pair.start("a", prompt, GREEDY)  # both transfers begun, the decode side not started
    for node in (pair.prefill, pair.decode):
        node.handle(p.Abort(["a"]))
    pair.settle()
    pair.assert_idle()
    # A draft transfer that fails (the receiver gave up on it before the push) leaves
    # the request to decode with a locally prefilled draft: same tokens, blocks back.
    before = proposer(pair.de).prefill_tokens
    first = pair.start("b", prompt, GREEDY, reserved=lambda: receipts.receiver.cancel("x-b.draft"))
    assert pair.decode_all("b", first) == reference(model_dir, prompt, GREEDY)
    assert proposer(pair.de).prefill_tokens - before == len(prompt) + 1
    pair.assert_idle()


def _admitted(pair: DraftPair, rid: str, prompt: list[int]) -> p.FirstToken:
    """Start `rid`, let its target KV land, hand decode the first token, run one decode step."""
    first = pair.start(rid, prompt, GREEDY)
    _wait(lambda: pair.receiver.poll(f"x-{rid}") == TransferState.COMPLETE, pair.prefill.step)
    pair.decode.handle(p.StartDecode(rid, f"x-{rid}", first.token_ids, first.logprobs))
    pair.decode.step()
    return first


def _all_drafts_held(pair: DraftPair, before: SpecStats) -> bool:
    """Greedy drafts of the target by itself: every one holds over the right draft KV."""
    now = pair.de.stats().spec
    assert now is not None
    drafted = now.num_draft_tokens - before.num_draft_tokens
    return drafted > 0 and now.num_accepted_tokens - before.num_accepted_tokens == drafted


def test_a_draft_transfer_that_never_arrives_does_not_hold_the_stream(model_dir: Path,
                                                                      shipping: DraftPair) -> None:
    pair, receipts, local = shipping, shipping.receipts, proposer(shipping.de)
    assert receipts is not None and pair.shipper is not None
    prompt = prompts(30, seed=9)[0]
    before, spec_before = local.prefill_tokens, pair.de.stats().spec
    assert spec_before is not None
    # The prefill worker's draft pool is full: its draft KV is never made, so its
    # transfer stays RESERVED on the decode worker (its lease is 30 s away).
    pool = proposer(pair.pe).blocks
    assert pool.allocate_slots(10**6, pool.num_free_blocks * BS, 0) is not None
    try:
        first = _admitted(pair, "c", prompt)
        # The decode step right after the target's KV and first token admitted the stream
        # and decoded it, without drafts: the draft's KV is awaited, not waited for.
        assert any(isinstance(m, p.TokenBatch) for m in pair.to_gateway)
        assert receipts.state("x-c") == TransferState.RESERVED and receipts.awaiting()
        assert local.prefill_tokens == before
        assert pair.decode_all("c", first) == reference(model_dir, prompt, GREEDY)
        # Given up after DRAFT_WAIT_STEPS steps: one local draft prefill over the prompt
        # and the tokens decoded by then. (Blocks given up that stayed the sequence's own
        # would be freed under it when their transfer ended: a second prefill.)
        assert local.prefill_tokens - before == len(prompt) + 1 + DRAFT_WAIT_STEPS
    finally:
        pool.free(10**6)
    pair.settle()
    assert pair.shipper.state("x-c") is None  # never shipped, not even once there is room
    assert _all_drafts_held(pair, spec_before)
    pair.assert_idle()


def test_a_draft_transfer_landing_after_admission_is_adopted(model_dir: Path, shipping: DraftPair) -> None:
    pair, receipts, local = shipping, shipping.receipts, proposer(shipping.de)
    assert receipts is not None and pair.shipper is not None
    prompt = prompts(30, seed=10)[0]
    before, spec_before = local.prefill_tokens, pair.de.stats().spec
    assert spec_before is not None
    sender = pair.shipper.sender
    held: list[tuple[str, Any]] = []
    sender.send_all = lambda tid, ready=None: held.append((tid, ready))  # type: ignore[method-assign]
    try:
        first = _admitted(pair, "e", prompt)  # the draft's KV is computed, its push held
    finally:
        del sender.send_all  # the class's own again
    assert any(isinstance(m, p.TokenBatch) for m in pair.to_gateway) and receipts.awaiting()
    sender.send_all(*held[0])
    _wait(lambda: receipts.state("x-e") == TransferState.COMPLETE)
    assert pair.decode_all("e", first) == reference(model_dir, prompt, GREEDY)
    # Adopted: never prefilled here, the tokens decoded meanwhile caught up, drafts hold.
    assert local.prefill_tokens == before
    assert _all_drafts_held(pair, spec_before)
    pair.assert_idle()


def test_a_stream_aborted_while_its_draft_kv_is_awaited_leaks_no_block(shipping: DraftPair) -> None:
    pair, receipts = shipping, shipping.receipts
    assert receipts is not None
    pool = proposer(pair.pe).blocks
    assert pool.allocate_slots(10**6, pool.num_free_blocks * BS, 0) is not None  # never ships
    try:
        _admitted(pair, "f", prompts(30, seed=11)[0])
        assert receipts.awaiting()
        for node in (pair.prefill, pair.decode):
            node.handle(p.Abort(["f"]))
        assert not receipts.awaiting()
        pair.settle()
    finally:
        pool.free(10**6)
    pair.to_gateway.clear()
    pair.assert_idle()


def test_the_layout_hash_covers_the_draft_only_when_its_kv_ships(model_dir: Path,
                                                                  tiny_model_dir: Callable[..., Path]) -> None:
    other = tiny_model_dir("llama", seed=1, num_hidden_layers=1)

    def hash_of(cfg: SpeculativeConfig | None) -> str:
        base = EngineConfig(model_dir=str(model_dir), dtype="float32", cache=CacheConfig(block_size=BS))
        return ModelRunner.layout_for(dataclasses.replace(base, speculative=cfg)).compat_hash

    plain = hash_of(None)
    assert hash_of(spec(model_dir, "decode")) == plain  # decode-local: nothing of the draft crosses
    ships = hash_of(spec(model_dir, "prefill"))
    assert ships != plain
    assert hash_of(spec(model_dir, "prefill", k=5)) == ships  # K changes nothing in the KV
    assert hash_of(spec(other, "prefill")) not in (plain, ships)

