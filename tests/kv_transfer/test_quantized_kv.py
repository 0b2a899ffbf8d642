"""Quantized KV pools (`fp8_e4m3`, `int8`) over every CPU transport: the rows shipped
are the engine's codes with their per-block-per-head scales, byte for byte, and a
pool of another KV dtype refuses the handshake."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from kv_transfer.api import TransferState
from kv_transfer.pool.blocks import frame_nbytes
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.runner.kv_pool import KVPool
from pdserve.engine.runner.kv_quant import QuantizedCache, read_blocks, write_kv
from tests.kv_transfer.harness import CPU_TRANSPORTS, make_pair, wait_terminal

pytestmark = pytest.mark.timeout(60)

BASE = KVLayout("tiny-model", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                dtype="bfloat16", compute_dtype="bfloat16")


def _fill(layout: KVLayout, pool: np.ndarray, ids: list[int], seed: int) -> KVPool:
    """Write random K/V into blocks `ids` of every layer through the engine's write path."""
    engine_pool = KVPool(layout, buffer=pool)
    g = torch.Generator().manual_seed(seed)
    slots = torch.tensor([b * layout.block_size + s for b in ids for s in range(layout.block_size)])
    for k, v in engine_pool.all_layer_views():
        for cache in (k, v):
            x = torch.randn(len(slots), layout.num_kv_heads, layout.head_dim, generator=g) * 4
            write_kv(cache, slots, x.to(torch.bfloat16))
    return engine_pool


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_quantized_rows_and_scales_arrive_intact(transport: str, kind: str) -> None:
    layout = replace(BASE, dtype=kind)
    # Half the bytes of bf16 per block, plus 4 bytes of scale per (layer, K/V, head).
    assert frame_nbytes(layout, 3, 5) == 3 * 5 * 2 * (4 * 2 * 8 + 2 * 4)
    assert layout.block_bytes_per_layer == BASE.block_bytes_per_layer // 2 + 2 * 2 * 4
    pair = make_pair(transport, layout=layout, src_blocks=16, dst_blocks=16, chunk_bytes=512)
    try:
        pair.src[...] = 0
        src_ids, dst_ids = [3, 7, 4, 12, 9], [2, 11, 5, 6, 14]
        src = _fill(layout, pair.src, src_ids, seed=1)
        pair.receiver.expect("t", "req", dst_ids, lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, src_ids, dst_ids, lease_s=20)
        for layer in range(layout.num_layers):
            pair.sender.send_layer("t", layer)
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert pair.receiver.poll("t") is TransferState.COMPLETE
        dst = KVPool(layout, buffer=pair.dst)
        for (sk, sv), (dk, dv) in zip(src.all_layer_views(), dst.all_layer_views(), strict=True):
            for a, b in ((sk, dk), (sv, dv)):
                assert isinstance(a, QuantizedCache) and isinstance(b, QuantizedCache)
                assert bool(a.scales[src_ids].gt(0).all())
                assert torch.equal(a.scales[src_ids], b.scales[dst_ids])
                assert torch.equal(read_blocks(a, torch.tensor(src_ids), torch.bfloat16),
                                   read_blocks(b, torch.tensor(dst_ids), torch.bfloat16))
    finally:
        pair.close()


@pytest.mark.parametrize("transport", ["fake", "tcp", "shm"])
@pytest.mark.parametrize("sender_kv,receiver_kv", [("fp8_e4m3", "bfloat16"), ("int8", "fp8_e4m3")])
def test_another_kv_dtype_is_refused_at_the_handshake(
    transport: str, sender_kv: str, receiver_kv: str
) -> None:
    sender_layout, receiver_layout = replace(BASE, dtype=sender_kv), replace(BASE, dtype=receiver_kv)
    pair = make_pair(transport, layout=sender_layout, receiver_layout=receiver_layout)
    try:
        pair.receiver.expect("t", "req", [3], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1], [3], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "compatibility hash mismatch" in pair.sender.reason("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert not pair.dst.any()
    finally:
        pair.close()
