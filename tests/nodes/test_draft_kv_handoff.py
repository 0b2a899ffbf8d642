"""Draft KV made on the prefill worker (draft_kv=prefill), prefill node -> decode node
over the fake transport, the test acting as the gateway: the decode worker gets the
draft's KV with the target's, its first speculative step prefills no draft, the tokens
equal the engine without speculation, and every block of both pools on both sides comes
back -- after a finished request, an abort mid-handoff and a draft transfer that fails.
The layout hash covers the draft (not K) only with draft_kv=prefill."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from common import protocol as p
from common.sampling_params import SamplingParams
from common.transport import host_id
from decode_node.node import DecodeNode
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.spec.config import SpeculativeConfig
from engine.spec.draft_model import DraftModelProposer
from kv_transfer.api import TransferState
from kv_transfer.fake import FakeFabric, FakeReceiver, fake_sender
from kv_transfer.tensor_adapter import pool_array
from prefill_node.node import PrefillNode
from tests.engine.test_engine import assert_idle
from tests.engine.test_spec_decode import GREEDY, SEEDED, make_engine, prompts
from worker.draft_kv import DraftReceipts, DraftShipper
from worker.metrics import WorkerMetrics

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


class DraftPair:
    """Prefill and decode nodes, both with the target as its own draft (every greedy draft
    is then accepted exactly when the draft KV is right); `ship`: draft_kv=prefill."""

    def __init__(self, model_dir: Path, ship: bool) -> None:
        cfg = spec(model_dir, "prefill" if ship else "decode")
        self.fabric = FakeFabric()
        self.pe = make_engine(model_dir, cfg if ship else None, block_size=BS)
        self.de = make_engine(model_dir, cfg, block_size=BS)
        layout = self.pe.runner.layout
        self.sender = fake_sender(layout, pool_array(self.pe.runner.pool.kv), self.fabric)
        self.receiver = FakeReceiver(layout, pool_array(self.de.runner.pool.kv), self.fabric)
        self.shipper = self.receipts = None
        if ship:
            pd, dd = proposer(self.pe), proposer(self.de)
            dl = pd.runner.layout
            self.shipper = DraftShipper(pd, fake_sender(dl, pool_array(pd.runner.pool.kv), self.fabric),
                                        WorkerMetrics("prefill", "p"))
            self.receipts = DraftReceipts(dd, FakeReceiver(dl, pool_array(dd.runner.pool.kv), self.fabric),
                                          WorkerMetrics("decode", "d"))
        self.to_gateway: list[p.Message] = []
        self.prefill = PrefillNode("p", self.pe, self.pe.runner, self.sender, self.to_gateway.append,
                                   WorkerMetrics("prefill", "p"), drafts=self.shipper)
        self.decode = DecodeNode("d", self.de, self.de.runner, self.receiver, self.to_gateway.append,
                                 WorkerMetrics("decode", "d"), drafts=self.receipts)

    def take(self, kind: type[p.Message]) -> p.Message:
        found = [m for m in self.to_gateway if isinstance(m, kind)]
        assert len(found) == 1, self.to_gateway
        self.to_gateway.remove(found[0])
        return found[0]

    def start(self, rid: str, prompt: list[int], params: SamplingParams,
              reserved_hook: Callable[[], None] = lambda: None) -> p.FirstToken:
        """Reserve, prefill and push: returns the first token, the handoff under way."""
        tid = f"x-{rid}"
        self.decode.handle(p.DecodeReserve(rid, tid, p.RequestPayload(prompt, params)))
        reserved = self.take(p.ReserveResult)
        assert isinstance(reserved, p.ReserveResult) and reserved.ok
        assert (reserved.draft is not None) == (self.receipts is not None)
        reserved_hook()
        self.prefill.handle(p.PrefillRequest(rid, p.RequestPayload(prompt, params)))
        self.prefill.handle(p.TransferTarget(rid, tid, "d", host_id(), self.receiver.address, "",
                                             reserved.block_ids, reserved.cached_blocks, reserved.draft))
        while not any(isinstance(m, p.FirstToken) for m in self.to_gateway):
            self.prefill.step()
        first = self.take(p.FirstToken)
        assert isinstance(first, p.FirstToken)
        return first

    def run(self, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
        return self.decode_all(rid, self.start(rid, prompt, params))

    def decode_all(self, rid: str, first: p.FirstToken) -> list[int]:
        """Hand the first token to decode; step both nodes until the request ends."""
        self.decode.handle(p.StartDecode(rid, f"x-{rid}", first.token_ids, first.logprobs))
        out = list(first.token_ids)
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline
            self.prefill.step()
            self.decode.step()
            deltas = [d for m in self.to_gateway if isinstance(m, p.TokenBatch) for d in m.deltas]
            self.to_gateway[:] = [m for m in self.to_gateway if not isinstance(m, p.TokenBatch)]
            out += [t for d in deltas for t in d.token_ids]
            if any(d.finish_reason for d in deltas):
                break
        self.settle()
        return out

    def settle(self) -> None:
        deadline = time.monotonic() + 30
        while self.prefill.busy() or self.decode.busy():
            assert time.monotonic() < deadline
            self.prefill.step()
            self.decode.step()

    def assert_idle(self) -> None:
        for engine in (self.pe, self.de):
            assert_idle(engine)
            bm = proposer(engine).blocks if engine.spec is not None else None
            if bm is not None:
                assert bm.num_free_blocks == bm.num_allocatable and bm.check_integrity(), bm.integrity_errors()

    def close(self) -> None:
        for peer in (self.sender, self.receiver, self.shipper, self.receipts):
            if peer is not None:
                peer.close()


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


def test_abort_a_failed_draft_transfer_and_a_full_draft_pool_leak_no_block(model_dir: Path) -> None:
    pair = DraftPair(model_dir, ship=True)
    assert pair.shipper is not None and pair.receipts is not None
    try:
        prompt = prompts(30, seed=8)[0]
        pair.start("a", prompt, GREEDY)  # both transfers begun, the decode side not started
        for node in (pair.prefill, pair.decode):
            node.handle(p.Abort(["a"]))
        pair.settle()
        pair.assert_idle()
        # A draft transfer that fails (the receiver gave up on it before the push) leaves
        # the request to decode with a locally prefilled draft: same tokens, blocks back.
        receipts = pair.receipts
        first = pair.start("b", prompt, GREEDY, lambda: receipts.receiver.cancel("x-b.draft"))
        want = reference(model_dir, prompt, GREEDY)
        assert pair.decode_all("b", first) == want
        assert proposer(pair.de).prefill_tokens == len(prompt) + 1
        pair.assert_idle()
    finally:
        pair.close()


def test_a_draft_transfer_that_never_arrives_does_not_hold_the_stream(model_dir: Path) -> None:
    pair = DraftPair(model_dir, ship=True)
    assert pair.shipper is not None and pair.receipts is not None
    try:
        prompt = prompts(30, seed=8)[0]
        want = reference(model_dir, prompt, GREEDY)
        # The prefill worker's draft pool is full: its draft KV is never made, so its
        # transfer stays RESERVED on the decode worker (its lease is 30 s away).
        pool = proposer(pair.pe).blocks
        assert pool.allocate_slots(10**6, pool.num_free_blocks * BS, 0) is not None
        first = pair.start("c", prompt, GREEDY)
        deadline = time.monotonic() + 30
        while pair.receiver.poll("x-c") != TransferState.COMPLETE:  # the target's KV is in
            assert time.monotonic() < deadline
            pair.prefill.step()
        assert pair.receipts.state("x-c") == TransferState.RESERVED
        # The target's KV and first token are in: the very next decode step admits the
        # stream and decodes it, prefilling its draft locally, and the draft transfer is dropped.
        pair.decode.handle(p.StartDecode("c", "x-c", first.token_ids, first.logprobs))
        pair.decode.step()
        assert any(isinstance(m, p.TokenBatch) for m in pair.to_gateway)
        assert proposer(pair.de).prefill_tokens == len(prompt) + 1
        assert pair.receipts.state("x-c") is None and pair.receipts.cancelling()
        assert pair.decode_all("c", first) == want
        # One local draft prefill: the blocks given up, freed once their transfer was
        # terminal, were never the sequence's own (its draft KV lived on).
        assert proposer(pair.de).prefill_tokens == len(prompt) + 1
        pool.free(10**6)
        pair.settle()
        assert pair.shipper.state("x-c") is None  # never shipped, not even once there is room
        # Greedy drafts of the target by itself over the local draft KV: every one holds
        # (the draft blocks given up never mixed with the sequence's own).
        stats = pair.de.stats().spec
        assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0
        pair.assert_idle()
    finally:
        pair.close()


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

