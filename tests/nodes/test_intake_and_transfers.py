"""What the prefill, decode and colocated nodes share (pdserve/worker/node_base.py,
pdserve/worker/transfers.py), driven through the nodes themselves over the fake transport:
bad input is refused with a clear error and holds nothing, accepted requests are
counted per role, an aborted transfer's blocks come back only once the transfer is
terminal, and a finished transfer is measured on both sides."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.transport import host_id
from pdserve.engine.llm_engine import LLMEngine
from pdserve.worker.colocated import ColocatedNode
from pdserve.worker.metrics import WorkerMetrics
from tests.engine.test_engine import assert_idle, make_engine, prompts
from tests.nodes.test_layerwise_push import PARAMS, Pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (params, resume point, prompt length, what the error names)
BAD_REQUESTS = [
    (replace(PARAMS, temperature=-1.0), None, 20, "temperature"),
    (PARAMS, p.Resume([7] * PARAMS.max_tokens), 20, "max_tokens"),  # nothing left to generate
    (PARAMS, p.Resume([], choice_index=-1), 20, "choice_index"),
    (PARAMS, None, 5000, "max_model_len"),  # longer than the model's context: can never fit
]


def _payload(prompt: list[int], params: SamplingParams = PARAMS, resume: p.Resume | None = None) -> p.RequestPayload:
    return p.RequestPayload(prompt, params, resume)


@pytest.fixture()
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def _count(node: Any, name: str, **labels: str) -> float:
    value = node.metrics.registry.get_sample_value(name, {"role": node.role, "worker": node.worker_id, **labels})
    return 0.0 if value is None else float(value)


def _until(cond: Callable[[], bool], step: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        step()


class Colocated:
    def __init__(self, model_dir: Path) -> None:
        self.engine: LLMEngine = make_engine(model_dir)
        self.out: list[p.Message] = []
        self.node = ColocatedNode("c", self.engine, self.engine.runner, self.out.append,
                                  WorkerMetrics("colocated", "c"))


@pytest.fixture()
def pair(model_dir: Path) -> Iterator[Pair]:
    pair = Pair(model_dir, budget=2048)
    yield pair
    pair.close()


@pytest.mark.parametrize(("params", "resume", "length", "names"), BAD_REQUESTS)
def test_a_bad_request_is_refused_by_every_node_and_holds_nothing(
        pair: Pair, model_dir: Path, params: SamplingParams, resume: p.Resume | None, length: int,
        names: str) -> None:
    payload = _payload(prompts(length, seed=1)[0], params, resume)
    colo = Colocated(model_dir)
    cases = [
        (pair.prefill, pair.pe, pair.to_gateway, p.PrefillRequest("r", payload)),
        (pair.decode, pair.de, pair.to_gateway, p.DecodeReserve("r", "t", payload)),
        (colo.node, colo.engine, colo.out, p.RunRequest("r", payload)),
    ]
    for node, engine, out, msg in cases:
        node.handle(msg)
        assert len(out) == 1 and isinstance(out[0], p.RequestFailed), (node.role, out)
        failed = out.pop()
        assert failed.request_id == "r" and not failed.retryable, node.role
        assert failed.reason.startswith("invalid request: ") and names in failed.reason, failed.reason
        assert not node.busy() and not node.step(), node.role
        assert_idle(engine)
        assert _count(node, "llm_worker_requests_total") == 0, node.role


def test_accepted_requests_are_counted_per_role(pair: Pair, model_dir: Path) -> None:
    colo = Colocated(model_dir)
    prompt = prompts(20, seed=2)[0]
    pair.decode.handle(p.DecodeReserve("r", "t", _payload(prompt)))
    assert pair.take(p.ReserveResult).refused == ""
    pair.prefill.handle(p.PrefillRequest("r", _payload(prompt)))
    colo.node.handle(p.RunRequest("r", _payload(prompt)))
    assert colo.out == [] and pair.to_gateway == []
    for node, prefills in ((pair.prefill, 1), (pair.decode, 0), (colo.node, 1)):
        assert _count(node, "llm_worker_requests_total") == 1, node.role
        assert _count(node, "llm_prefill_requests_total") == prefills, node.role


def test_a_refused_reservation_holds_nothing_and_is_not_counted(pair: Pair) -> None:
    prompt = prompts(400, seed=3)[0]  # 25 blocks of 16
    held: list[str] = []
    while True:  # reserve until the pool is too full for one more
        assert len(held) < 20
        rid = f"r{len(held)}"
        pair.decode.handle(p.DecodeReserve(rid, f"t{rid}", _payload(prompt)))
        result = pair.take(p.ReserveResult)
        if result.refused:
            break
        held.append(rid)
    assert (result.request_id, result.block_ids) == (rid, []) and held
    assert result.refused.startswith("not enough free KV blocks"), result.refused
    assert _count(pair.decode, "llm_worker_requests_total") == len(held)
    assert _count(pair.decode, "llm_decode_reservations_refused_total") == 1
    pair.decode.handle(p.Abort(held))
    _until(lambda: not pair.decode.busy(), pair.decode.step, "decode still busy")
    assert_idle(pair.de)


def test_an_aborted_transfer_frees_its_blocks_once_terminal_on_both_sides(pair: Pair) -> None:
    prompt = prompts(40, seed=4)[0]
    pair.decode.handle(p.DecodeReserve("r", "t", _payload(prompt)))
    blocks = pair.take(p.ReserveResult).block_ids
    pair.prefill.handle(p.PrefillRequest("r", _payload(prompt)))
    pair.prefill.handle(p.TransferTarget("r", "t", "d", host_id(), pair.receiver.address, "", blocks))
    _until(lambda: any(isinstance(m, p.FirstToken) for m in pair.to_gateway), pair.prefill.step,
           "no first token")
    pair.take(p.FirstToken)
    for node, engine, side in ((pair.prefill, pair.pe, pair.sender), (pair.decode, pair.de, pair.receiver)):
        node.handle(p.Abort(["r"]))
        # Cancelled, not yet reaped: the blocks stay with the request until a step
        # sees the transfer terminal, then the engine gets them back.
        assert node.busy() and engine.stats().num_free_blocks < engine.stats().num_total_blocks
        _until(lambda node=node: not node.busy(), node.step, f"{node.role} still busy")
        assert_idle(engine)
        with pytest.raises(KeyError):
            side.poll("t")  # forgotten once reaped
        assert _count(node, "llm_worker_aborts_total") == 1
    assert not [m for m in pair.to_gateway if isinstance(m, p.RequestFailed)]


def test_a_finished_transfer_is_measured_on_both_sides(pair: Pair) -> None:
    prompt = prompts(40, seed=5)[0]
    pair.run("r", prompt, target_first=False)
    layout = pair.pe.runner.layout
    moved = -(-len(prompt) // layout.block_size) * layout.block_bytes_per_layer * layout.num_layers
    for node in (pair.prefill, pair.decode):
        assert _count(node, "llm_kv_transfer_bytes_total", transport="fake") == moved, node.role
        assert _count(node, "llm_kv_transfer_seconds_count") == 1, node.role
        assert _count(node, "llm_kv_transfer_failures_total") == 0, node.role
    assert_idle(pair.pe)
    assert_idle(pair.de)
