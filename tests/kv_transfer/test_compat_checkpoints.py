"""The KV handshake refuses a sender and a receiver whose checkpoints differ in one
weight value (same config.json): their layouts come from the engine, fingerprint and all."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kv_transfer.api import TransferState
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.runner.model_runner import ModelRunner
from tests.helpers.tiny_models import copy_with_one_weight_changed
from tests.kv_transfer.harness import CPU_TRANSPORTS, make_pair, same_bytes, wait_terminal

pytestmark = pytest.mark.timeout(120)


def _layout(model_dir: Path) -> KVLayout:
    # float16: the harness fills pools with 2-byte random bit patterns.
    cfg = EngineConfig(model_dir=str(model_dir), dtype="float16", cache=CacheConfig(block_size=4))
    return ModelRunner.layout_for(cfg)


@pytest.fixture(scope="module")
def layouts(tiny_model_dir: Callable[..., Path],
            tmp_path_factory: pytest.TempPathFactory) -> tuple[KVLayout, KVLayout, KVLayout]:
    """(base, an identical copy elsewhere, base with one weight value changed)."""
    base = tiny_model_dir("llama")
    tmp = tmp_path_factory.mktemp("checkpoints")
    same = Path(shutil.copytree(base, tmp / "same"))
    tuned = copy_with_one_weight_changed(base, tmp / "tuned")
    return _layout(base), _layout(same), _layout(tuned)


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_one_weight_apart_checkpoints_refuse_each_other(
    transport: str, layouts: tuple[KVLayout, KVLayout, KVLayout]
) -> None:
    base, _, tuned = layouts
    assert tuned.model_id == base.model_id  # same config.json: only the weights tell them apart
    pair = make_pair(transport, layout=tuned, receiver_layout=base)
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "compatibility hash mismatch" in pair.sender.reason("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert "compatibility hash mismatch" in pair.receiver.reason("t")
        assert not pair.dst.any()  # nothing was written
    finally:
        pair.close()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_identical_copy_of_a_checkpoint_is_compatible(
    transport: str, layouts: tuple[KVLayout, KVLayout, KVLayout]
) -> None:
    base, same, _ = layouts
    pair = make_pair(transport, layout=same, receiver_layout=base)
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, [3, 4]], pair.src[:, :, [1, 2]])
    finally:
        pair.close()
