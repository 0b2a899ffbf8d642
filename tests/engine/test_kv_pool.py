"""KV pool sizing and external buffers (the decode worker's shared-memory pool)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.kv_pool import KVPool
from pdserve.engine.runner.model_runner import ModelRunner

LAYOUT = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype="float32")


def test_pool_shape_and_null_block() -> None:
    pool = KVPool(LAYOUT, num_blocks=5)
    assert pool.kv.shape == LAYOUT.pool_shape(5)
    assert pool.num_blocks == 5 and pool.num_usable_blocks == 4
    assert pool.nbytes == 5 * LAYOUT.block_bytes_per_layer * LAYOUT.num_layers
    k, v = pool.layer_views(1)
    assert k.shape == (5, 8, 2, 4) and k.is_contiguous() and v.is_contiguous()
    k[3, 2] = 7.0
    assert float(pool.kv[1, 0, 3, 2].sum()) == 7.0 * 8
    assert not bool(pool.kv.isnan().any())  # masked reads of unwritten slots stay finite


def test_pool_over_numpy_buffer_shares_memory() -> None:
    buf = np.full(LAYOUT.pool_shape(6), 3.0, dtype=np.float32)
    pool = KVPool(LAYOUT, buffer=buf)
    assert pool.num_blocks == 6
    assert float(np.abs(buf[:, :, 0]).sum()) == 0.0  # null block zeroed
    assert float(buf[0, 0, 1].sum()) == 3.0 * buf[0, 0, 1].size  # other blocks untouched
    pool.layer_views(0)[1][2, 0, 1, 3] = 42.0
    assert buf[0, 1, 2, 0, 1, 3] == 42.0


def test_pool_over_raw_byte_buffer() -> None:
    block_bytes = LAYOUT.block_bytes_per_layer * LAYOUT.num_layers
    raw = np.zeros(4 * block_bytes, dtype=np.uint8)
    pool = KVPool(LAYOUT, buffer=raw)
    assert pool.num_blocks == 4 and pool.kv.dtype == torch.float32
    pool.kv[1, 1, 3] = 1.0
    assert raw.view(np.float32).reshape(LAYOUT.pool_shape(4))[1, 1, 3].min() == 1.0
    with pytest.raises(ValueError, match="whole number"):
        KVPool(LAYOUT, buffer=np.zeros(block_bytes + 1, dtype=np.uint8))


def test_pool_rejects_wrong_shape_and_tiny() -> None:
    bad = torch.zeros(2, 2, 4, 8, 2, 5)
    with pytest.raises(ValueError, match="pool shape"):
        KVPool(LAYOUT, buffer=bad)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        KVPool(LAYOUT, num_blocks=1)


def _config(model_dir: Path, **cache: object) -> EngineConfig:
    return EngineConfig(model_dir=str(model_dir), dtype="float32", num_threads=1,  # float32 byte counts
                        cache=CacheConfig(**cache))  # type: ignore[arg-type]


def test_runner_sizes_pool_from_memory_budget(tiny_model_dir: Callable[..., Path]) -> None:
    d = tiny_model_dir("llama")
    layout = ModelRunner.layout_for(_config(d))
    per_block = layout.block_bytes_per_layer * layout.num_layers
    runner = ModelRunner(_config(d, kv_cache_memory=10 * per_block + per_block // 2))
    assert runner.num_blocks == 10
    assert runner.layout == layout
    assert torch.get_num_threads() == 1
    assert ModelRunner(_config(d, num_blocks=7, kv_cache_memory=1 << 30)).num_blocks == 7
    assert runner.max_model_len == runner.model_config.max_position_embeddings


def test_layout_identity(tiny_model_dir: Callable[..., Path]) -> None:
    a = ModelRunner.layout_for(_config(tiny_model_dir("llama")))
    b = ModelRunner.layout_for(_config(tiny_model_dir("llama")))
    q = ModelRunner.layout_for(_config(tiny_model_dir("qwen3")))
    assert a == b and a.compat_hash == b.compat_hash
    assert (q.num_layers, q.num_kv_heads, q.head_dim, q.block_size) == (2, 2, 32, 16)
    assert a.model_id != q.model_id and a.compat_hash != q.compat_hash
    assert a.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_runner_over_external_buffer_matches_own_pool(tiny_model_dir: Callable[..., Path]) -> None:
    d = tiny_model_dir("llama")
    layout = ModelRunner.layout_for(_config(d))
    buf = np.zeros(layout.pool_shape(12), dtype=np.float32)
    shared = ModelRunner(_config(d), kv_buffer=buf)
    own = ModelRunner(_config(d, num_blocks=12))
    assert shared.num_blocks == 12
    prompt = list(range(3, 24))  # 21 tokens: blocks 4 and 9 (second one partly)
    a = shared.execute([SeqChunk(prompt, 0, [4, 9], True)])
    b = own.execute([SeqChunk(prompt, 0, [4, 9], True)])
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # K/V landed in the caller's buffer, in the documented layout.
    np.testing.assert_array_equal(buf[:, :, [4, 9]], own.pool.kv[:, :, [4, 9]].numpy())
    assert np.abs(buf[:, :, 9, 5:]).sum() == 0  # positions 21.. not written
    assert np.abs(buf[:, :, 9, :5]).sum() > 0


def test_runner_rejects_bad_chunks(tiny_model_dir: Callable[..., Path]) -> None:
    runner = ModelRunner(_config(tiny_model_dir("llama"), num_blocks=8))
    with pytest.raises(ValueError, match="blocks"):
        runner.execute([SeqChunk(list(range(20)), 0, [1], True)])
    with pytest.raises(ValueError, match="out of range"):
        runner.execute([SeqChunk([1, 2], 0, [8], True)])
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute([SeqChunk([1], runner.max_model_len, [1] * 40, True)])
    assert runner.execute([]).shape == (0, runner.model_config.vocab_size)


def test_block_table_entries_past_the_context_are_ignored(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """A table may run ahead of the context (blocks reserved for later); only covered ones are read."""
    runner = ModelRunner(_config(tiny_model_dir("llama"), num_blocks=8))
    runner.execute([SeqChunk(list(range(3, 8)), 0, [1], False)])
    runner.execute([SeqChunk(list(range(3, 23)), 0, [2, 3], False)])
    exact = runner.execute([SeqChunk([9], 5, [1], True), SeqChunk([9], 20, [2, 3], True)])
    ahead = runner.execute(
        [SeqChunk([9], 5, [1, 10**6], True), SeqChunk([9], 20, [2, 3, 10**6], True)]
    )
    torch.testing.assert_close(ahead, exact, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tier_loads_land_in_their_blocks_from_strided_rows_whatever_runs_the_ids_form(dtype: str) -> None:
    from kv_transfer.tiers.record import HEADER_BYTES as H
    from pdserve.engine.pool_blocks import read_blocks, write_loads
    from pdserve.engine.tier_api import BlockLoad

    layout = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=4, block_size=8, dtype=dtype)
    pool = KVPool(layout, num_blocks=12)
    size = layout.block_bytes_per_layer * layout.num_layers
    rng = np.random.default_rng(0)
    # Rows of a tiers' read buffer: each record's payload after its header (strided, and
    # only as aligned as the real header leaves it).
    records = rng.integers(0, 255, (5, H + size), dtype=np.uint8)
    if dtype == "bfloat16":  # keep the bytes finite bfloat16 values: exponent bits never all ones
        records[:, H + 1::2] &= 0x3F
    ids = (7, 8, 2, 3, 4)  # two runs, out of order
    before = read_blocks(pool, [1, 5, 6, 9, 10, 11])
    write_loads(pool, [BlockLoad(ids, records[:, H:], ()), BlockLoad((), records[:0, H:], ())])
    got = read_blocks(pool, ids)
    assert all((got[i] == records[i, H:]).all() for i in range(5))
    assert all((a == b).all() for a, b in zip(before, read_blocks(pool, [1, 5, 6, 9, 10, 11]), strict=True))
