"""A prefill node and a decode node in one process, the test acting as the gateway:
reserve on decode, prefill and push, hand the first token over, step both nodes until
the stream ends, then until neither holds anything in flight."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from decode_node.node import DecodeNode
from kv_transfer.api import KVReceiver, KVSender
from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.transport import host_id
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.draft_kv import DraftReceipts, DraftShipper
from pdserve.worker.metrics import WorkerMetrics
from prefill_node.node import PrefillNode

STEP_DEADLINE_S = 30.0  # a hung handoff fails the test instead of hanging it


def _nothing() -> None:
    return None


class NodePair:
    """`pe`/`de`: the prefill and decode engines; `sender`/`receiver`: the KV transport
    between their pools; `shipper`/`receipts`: draft_kv=prefill's draft transfers."""

    def __init__(self, pe: LLMEngine, de: LLMEngine, sender: KVSender, receiver: KVReceiver, *,
                 shipper: DraftShipper | None = None, receipts: DraftReceipts | None = None) -> None:
        self.pe, self.de = pe, de
        self.sender, self.receiver = sender, receiver
        self.shipper, self.receipts = shipper, receipts
        self.to_gateway: list[p.Message] = []
        self.prefill = PrefillNode("p", pe, pe.runner, sender, self.to_gateway.append,
                                   WorkerMetrics("prefill", "p"), drafts=shipper)
        self.decode = DecodeNode("d", de, de.runner, receiver, self.to_gateway.append,
                                 WorkerMetrics("decode", "d"), drafts=receipts)

    def take(self, kind: type[Any]) -> Any:
        """The one message of `kind` sent to the gateway, removed from the list."""
        found = [m for m in self.to_gateway if isinstance(m, kind)]
        assert len(found) == 1, self.to_gateway
        self.to_gateway.remove(found[0])
        return found[0]

    def start(self, rid: str, prompt: list[int], params: SamplingParams, *, target_first: bool = True,
              reserved: Callable[[], None] = _nothing,
              prefilled: Callable[[], None] = _nothing) -> p.FirstToken:
        """Reserve, prefill and push (the target before the prefill, or after it when not
        `target_first`); `reserved` and `prefilled` run after those stages. Returns the
        first token, the handoff under way."""
        tid = f"x-{rid}"
        self.decode.handle(p.DecodeReserve(rid, tid, p.RequestPayload(prompt, params)))
        result = self.take(p.ReserveResult)
        assert isinstance(result, p.ReserveResult) and result.ok, result
        assert (result.draft is not None) == (self.receipts is not None)
        reserved()
        target = p.TransferTarget(rid, tid, "d", host_id(), self.receiver.address, "", result.block_ids,
                                  result.cached_blocks, result.draft)
        self.prefill.handle(p.PrefillRequest(rid, p.RequestPayload(prompt, params)))
        if target_first:
            self.prefill.handle(target)
        deadline = time.monotonic() + STEP_DEADLINE_S
        while not any(isinstance(m, p.FirstToken) for m in self.to_gateway):
            assert time.monotonic() < deadline
            self.prefill.step()
        prefilled()
        if not target_first:
            self.prefill.handle(target)
        first = self.take(p.FirstToken)
        assert isinstance(first, p.FirstToken)
        return first

    def decode_all(self, rid: str, first: p.FirstToken) -> list[int]:
        """Hand the first token to decode; step both nodes until the stream ends and
        nothing is in flight. Returns every token of the stream."""
        self.decode.handle(p.StartDecode(rid, f"x-{rid}", first.token_ids, first.logprobs))
        out = list(first.token_ids)
        deadline = time.monotonic() + STEP_DEADLINE_S
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

    def run(self, rid: str, prompt: list[int], params: SamplingParams, **start: Any) -> list[int]:
        return self.decode_all(rid, self.start(rid, prompt, params, **start))

    def settle(self) -> None:
        """Step both nodes until neither holds a transfer or request in flight."""
        deadline = time.monotonic() + STEP_DEADLINE_S
        while self.prefill.busy() or self.decode.busy():
            assert time.monotonic() < deadline
            self.prefill.step()
            self.decode.step()

    def close(self) -> None:
        for peer in (self.sender, self.receiver, self.shipper, self.receipts):
            if peer is not None:
                peer.close()
