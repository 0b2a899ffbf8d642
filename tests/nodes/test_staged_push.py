"""Prefill node -> tcp -> decode node with both KV pools behind the device-pool test
double (`HiddenHostPool`): the pod-to-pod path of GPU workers (device -> pinned host
staging -> tcp -> staging -> device), run on CPU. Tokens equal the single-process
engine's, and every transferred byte went through staging on both sides."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kv_transfer.pool.blocks import frame_nbytes
from tests.engine.test_engine import assert_idle, prompts
from tests.nodes.test_layerwise_push import Pair, _reference

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def test_device_pools_push_over_tcp_through_staging(model_dir: Path) -> None:
    pair = Pair(model_dir, budget=2048, staged=True)
    try:
        layout = pair.pe.runner.layout
        assert pair.receiver.address.startswith("tcp://")
        layerwise, whole = prompts(45, seed=3)[0], prompts(30, seed=4)[0]
        assert pair.run("r1", layerwise, target_first=True) == _reference(model_dir, layerwise)
        assert pair.run("r2", whole, target_first=False) == _reference(model_dir, whole)
        assert [c[0] for c in pair.calls] == ["send_layer"] * layout.num_layers + ["send_all"]
        blocks = sum(-(-len(prompt) // layout.block_size) for prompt in (layerwise, whole))
        moved = frame_nbytes(layout, layout.num_layers, blocks)
        assert pair.sender.staged_bytes == moved
        assert pair.receiver.stats().staged_bytes == moved
        assert_idle(pair.pe)
        assert_idle(pair.de)
    finally:
        pair.close()
