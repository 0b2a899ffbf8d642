"""Prefill -> decode in one process over the fake transport: the prefill node pushes
KV layer by layer from inside the model step when the target is known in time,
and whole-request otherwise; the decoded tokens equal the single-process engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kv_transfer.api import TransferState
from kv_transfer.fake import FakeFabric, FakeReceiver, fake_sender
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.staging import HiddenHostPool
from kv_transfer.pool.tensor_adapter import pool_array
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from pdserve.common.sampling_params import SamplingParams
from tests.engine.test_engine import assert_idle, make_engine, prompts
from tests.nodes.harness import NodePair

PARAMS = SamplingParams(
    max_tokens=12, temperature=0.8, seed=5, presence_penalty=0.5, ignore_eos=True
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Pair(NodePair):
    """A prefill node and a decode node joined by the fake transport (or real tcp sockets
    through staging); `calls` records the prefill node's pushes."""

    def __init__(self, model_dir: Path, budget: int, block_size: int = 16, staged: bool = False) -> None:
        """`staged`: real tcp sockets, both pools wrapped as device pools (staging.py)."""
        pe = make_engine(model_dir, budget=budget, block_size=block_size)
        de = make_engine(model_dir, block_size=block_size)
        layout = pe.runner.layout
        src, dst = pool_array(pe.runner.pool.kv), pool_array(de.runner.pool.kv)
        sender: Sender
        receiver: FakeReceiver | ZmqReceiver
        if staged:
            sender = Sender(layout, HiddenHostPool(src), links=ZmqLinkFactory())
            receiver = ZmqReceiver(layout, HiddenHostPool(dst), transport="tcp")
        else:
            fabric = FakeFabric()
            sender = fake_sender(layout, src, fabric)
            receiver = FakeReceiver(layout, dst, fabric)
        super().__init__(pe, de, sender, receiver)
        self.sender: Sender = sender
        self.receiver: FakeReceiver | ZmqReceiver = receiver
        # (method, transfer id, layer, called inside the model step)
        self.calls: list[tuple[str, str, int, bool]] = []
        self._in_step = False
        self._spy()

    def _spy(self) -> None:
        execute, send_layer, send_all = (
            self.pe.runner.execute,
            self.sender.send_layer,
            self.sender.send_all,
        )

        def spy_execute(*a: Any, **k: Any) -> Any:
            self._in_step = True
            try:
                return execute(*a, **k)
            finally:
                self._in_step = False

        def spy_layer(transfer_id: str, layer: int, ready: Any = None) -> None:
            self.calls.append(("send_layer", transfer_id, layer, self._in_step))
            send_layer(transfer_id, layer, ready)

        def spy_all(transfer_id: str, ready: Any = None) -> None:
            self.calls.append(("send_all", transfer_id, -1, self._in_step))
            send_all(transfer_id, ready)

        self.pe.runner.execute = spy_execute  # type: ignore[method-assign]
        self.sender.send_layer = spy_layer  # type: ignore[method-assign]
        self.sender.send_all = spy_all  # type: ignore[method-assign]

    def run(self, rid: str, prompt: list[int], params: SamplingParams = PARAMS, **start: Any) -> list[int]:
        return super().run(rid, prompt, params, **start)


@pytest.fixture()
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def _reference(model_dir: Path, prompt: list[int]) -> list[int]:
    return list(make_engine(model_dir).generate([prompt], PARAMS)[0].token_ids)


def test_layers_ship_from_inside_the_step_and_arrive_before_it_ends(model_dir: Path) -> None:
    pair = Pair(model_dir, budget=2048)
    try:
        prompt = prompts(45, seed=3)[0]
        layers = pair.pe.runner.layout.num_layers
        states: list[TransferState] = []
        lag: list[float] = []

        def transfer_done_by_first_token() -> None:
            # The step that sampled the first token has returned: every layer was pushed
            # during it; the last layer's copy and the receiver's ack follow at once.
            start = time.monotonic()
            while not (s := pair.sender.poll("x-r1")).terminal and time.monotonic() < start + 5:
                time.sleep(0.0005)
            states.append(s)
            lag.append(time.monotonic() - start)

        got = pair.run("r1", prompt, target_first=True, prefilled=transfer_done_by_first_token)
        assert states == [TransferState.COMPLETE]
        assert lag[0] < 1.0, lag  # measured: complete at the first poll (~10 us)
        assert pair.calls == [("send_layer", "x-r1", i, True) for i in range(layers)]
        assert got == _reference(model_dir, prompt)

        # A prefix-cache hit computes only the tail; the cached blocks' layers ship too.
        pair.calls.clear()
        assert pair.run("r2", prompt, target_first=True) == got
        assert pair.calls == [("send_layer", "x-r2", i, True) for i in range(layers)]
        assert pair.pe.stats().num_cached_tokens_hit > 0
        assert_idle(pair.pe)
        assert_idle(pair.de)
    finally:
        pair.close()


def test_a_target_later_than_the_prefill_gets_the_whole_request(model_dir: Path) -> None:
    pair = Pair(model_dir, budget=2048)
    try:
        prompt = prompts(30, seed=4)[0]
        assert pair.run("r1", prompt, target_first=False) == _reference(model_dir, prompt)
        assert pair.calls == [("send_all", "x-r1", -1, False)]
        assert_idle(pair.pe)
        assert_idle(pair.de)
    finally:
        pair.close()


def test_a_chunked_prompt_ships_every_chunks_layers_in_its_last_step(model_dir: Path) -> None:
    pair = Pair(model_dir, budget=32)  # 90 tokens: three steps, the last one pushes
    try:
        prompt = prompts(90, seed=5)[0]
        layers = pair.pe.runner.layout.num_layers
        assert pair.run("r1", prompt, target_first=True) == _reference(model_dir, prompt)
        assert pair.calls == [("send_layer", "x-r1", i, True) for i in range(layers)]
        assert_idle(pair.pe)
        assert_idle(pair.de)
    finally:
        pair.close()
