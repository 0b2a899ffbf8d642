"""Every node keeps a request whose grammar still compiles off its step loop and out of
its KV pool (pdserve/worker/node_base.py, decode_node/node.py): the decode node holds the
reservation until the grammar is ready, with no block; a compile past the timeout is a
non-retryable `RequestFailed` ("invalid request", a 400 at the gateway) from every node,
and nothing is held afterwards. The compiles are real (a pathological regex), held at a
gate."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.builtin.default_model import write_default_model
from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import StructuredOutput
from tests.engine.grammar_gate import PATHOLOGICAL, Gate, gate_engine
from tests.engine.test_engine import assert_idle
from tests.nodes.test_intake_and_transfers import Colocated, _until
from tests.nodes.test_layerwise_push import Pair

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, structured=StructuredOutput(
    "regex", PATHOLOGICAL, "structured_outputs.regex"))
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("grammar-wait"))


@pytest.fixture()
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open.set()


@pytest.fixture()
def pair(model_dir: Path) -> Iterator[Pair]:
    pair = Pair(model_dir, budget=2048)
    yield pair
    pair.close()


def _failed(out: list[p.Message]) -> list[p.RequestFailed]:
    return [m for m in out if isinstance(m, p.RequestFailed)]


def test_a_compile_past_the_timeout_is_refused_by_every_node(pair: Pair, model_dir: Path, gate: Gate) -> None:
    colo = Colocated(model_dir)
    payload = p.RequestPayload(PROMPT, PARAMS)
    cases: list[tuple[Any, Any, list[p.Message], p.Message]] = [
        (pair.prefill, pair.pe, pair.to_gateway, p.PrefillRequest("r", payload)),
        (pair.decode, pair.de, pair.to_gateway, p.DecodeReserve("r", "t", payload)),
        (colo.node, colo.engine, colo.out, p.RunRequest("r", payload)),
    ]
    for node, engine, out, msg in cases:
        gate_engine(engine, gate, timeout_s=0.3)
        total = engine.block_manager.num_allocatable
        node.handle(msg)
        assert out == [] and node.busy(), node.role  # waiting for its grammar, not refused

        def idle_step(node: Any = node, engine: Any = engine, total: int = total) -> None:
            assert engine.block_manager.num_free_blocks == total, node.role  # holds no block meanwhile
            assert not node.step(), node.role  # nothing to run: the worker loop idles, it does not spin
            engine.grammar.wait(0.05)

        _until(lambda out=out: bool(_failed(out)), idle_step, f"{node.role} never timed the compile out")
        [failed] = _failed(out)
        out.clear()
        assert failed.request_id == "r" and not failed.retryable, node.role
        assert failed.reason.startswith("invalid request: ") and "could not be compiled within 0.3 s" in failed.reason
        assert not node.busy(), node.role
        assert_idle(engine)


def test_a_reservation_is_held_without_blocks_until_its_grammar_compiles(pair: Pair, gate: Gate) -> None:
    gate_engine(pair.de, gate)
    total = pair.de.block_manager.num_allocatable
    pair.decode.handle(p.DecodeReserve("r", "t", p.RequestPayload(PROMPT, PARAMS)))
    assert gate.started.wait(30)
    for _ in range(3):
        pair.decode.step()
    assert pair.to_gateway == [] and pair.decode.busy()
    assert pair.de.block_manager.num_free_blocks == total
    gate.open.set()
    _until(lambda: any(isinstance(m, p.ReserveResult) for m in pair.to_gateway), pair.decode.step,
           "the held reservation was never made")
    result = pair.take(p.ReserveResult)
    assert result.ok and len(result.block_ids) == 2 and pair.de.block_manager.num_free_blocks == total - 2
    pair.decode.handle(p.Abort(["r"], "test"))
    pair.settle()
    assert_idle(pair.de)


def test_an_aborted_held_reservation_is_forgotten(pair: Pair, gate: Gate) -> None:
    gate_engine(pair.de, gate)
    pair.decode.handle(p.DecodeReserve("r", "t", p.RequestPayload(PROMPT, PARAMS)))
    assert pair.decode.busy()
    pair.decode.handle(p.Abort(["r"], "client gone"))
    assert not pair.decode.busy()
    gate.open.set()
    assert gate.built.wait(30)
    for _ in range(3):
        pair.decode.step()
    assert pair.to_gateway == []
    assert_idle(pair.de)


def test_a_colocated_node_runs_others_while_a_grammar_compiles(model_dir: Path, gate: Gate) -> None:
    colo = Colocated(model_dir)
    gate_engine(colo.engine, gate)
    colo.node.handle(p.RunRequest("g", p.RequestPayload(PROMPT, PARAMS)))
    colo.node.handle(p.RunRequest("plain", p.RequestPayload(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))))

    def finished(rid: str) -> bool:
        return any(d.request_id == rid and d.finish_reason for m in colo.out if isinstance(m, p.TokenBatch)
                   for d in m.deltas)

    _until(lambda: finished("plain"), colo.node.step, "the plain request never finished")
    assert not finished("g") and not gate.open.is_set() and colo.engine.num_compiling == 1
    gate.open.set()
    _until(lambda: finished("g"), lambda: (colo.node.step(), colo.engine.grammar.wait(0.05)),
           "the grammar request never ran")
    assert not _failed(colo.out) and not colo.node.busy()
    assert_idle(colo.engine)


def test_a_request_waiting_for_its_grammar_counts_in_every_nodes_load(pair: Pair, model_dir: Path,
                                                                      gate: Gate) -> None:
    """The load a node heartbeats (the gateway's router reads `running_seqs + waiting_seqs`)
    counts a request whose grammar still compiles: a node holding only such requests does
    not look idle. Held in the engine (prefill, colocated) or as a decode reservation."""
    colo = Colocated(model_dir)
    payload = p.RequestPayload(PROMPT, PARAMS)
    cases: list[tuple[Any, Any, p.Message]] = [
        (pair.prefill, pair.pe, p.PrefillRequest("r", payload)),
        (pair.decode, pair.de, p.DecodeReserve("r", "t", payload)),
        (colo.node, colo.engine, p.RunRequest("r", payload)),
    ]
    for node, engine, msg in cases:
        gate_engine(engine, gate)
        assert node.load().waiting_seqs == 0, node.role
        node.handle(msg)
        node.step()
        load = node.load()
        assert (load.running_seqs, load.waiting_seqs) == (0, 1), (node.role, load)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_allocatable  # no block yet
        node.handle(p.Abort(["r"], "test"))
        pair.settle()
        assert node.load().waiting_seqs == 0 and not node.busy(), node.role
        assert_idle(engine)
