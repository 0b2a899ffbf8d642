"""Quantized KV cache (pdserve/engine/runner/kv_quant.py): the row layout with its scales, the
scale policy (a block starts afresh at slot 0; its scale only grows and its codes
are re-quantized when it does), and the dequantizing read."""

from __future__ import annotations

import pytest
import torch

from pdserve.common.kv_layout import KVLayout, kv_dtype_for, normalize_kv_cache_dtype
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.runner.kv_pool import KVPool
from pdserve.engine.runner.kv_quant import FP8_MAX, INT8_MAX, QuantizedCache, read_blocks, write_kv

KINDS = ("fp8_e4m3", "int8")
BS, KVH, D = 4, 2, 8


def _layout(dtype: str) -> KVLayout:
    return KVLayout("m", num_layers=2, num_kv_heads=KVH, head_dim=D, block_size=BS, dtype=dtype,
                    compute_dtype="float32")


def _cache(kind: str, num_blocks: int = 6) -> tuple[KVPool, QuantizedCache]:
    pool = KVPool(_layout(kind), num_blocks=num_blocks)
    k, _ = pool.layer_views(1)
    assert isinstance(k, QuantizedCache)
    return pool, k


def _slots(block: int, first: int, n: int) -> torch.Tensor:
    return torch.arange(first, first + n) + block * BS


def _tol(kind: str, amax: float) -> float:
    """Largest error of one value under the block's scale (e4m3: 3 mantissa bits)."""
    return amax / 16 if kind == "fp8_e4m3" else amax / INT8_MAX / 2 + 1e-6


def test_names_and_row_bytes() -> None:
    assert normalize_kv_cache_dtype("FP8") == "fp8_e4m3" and normalize_kv_cache_dtype("int8") == "int8"
    assert kv_dtype_for("auto", "bfloat16") == "bfloat16" and kv_dtype_for("fp8", "bfloat16") == "fp8_e4m3"
    with pytest.raises(ValueError, match="fp8_e4m3"):
        normalize_kv_cache_dtype("fp4")
    with pytest.raises(ValueError, match="KV-cache dtype"):
        EngineConfig(model_dir="m", kv_cache_dtype="e5m2")
    plain, q = _layout("bfloat16"), _layout("fp8_e4m3")
    # Values at one byte, then one float32 scale per KV head, padded to 8-byte words.
    assert q.row_bytes == BS * KVH * D + KVH * 4 == 72
    assert plain.block_bytes_per_layer == 2 * BS * KVH * D * 2 == 2 * 128
    assert q.block_bytes_per_layer == 144 and q.pool_shape(3) == (2, 2, 3, 1, 1, 72)
    assert KVLayout("m", 1, 3, 8, 4, "int8").row_bytes == 96 + 16  # 12 scale bytes padded to 16
    hashes = {_layout(d).compat_hash for d in ("float32", "fp8_e4m3", "int8")}
    assert len(hashes) == 3  # the KV dtype is part of the compatibility hash
    pool = KVPool(q, num_blocks=3)
    assert pool.kv.dtype == torch.uint8 and pool.nbytes == 3 * 2 * 144


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_within_the_codes_precision(kind: str) -> None:
    _, cache = _cache(kind)
    x = torch.randn(2 * BS, KVH, D) * torch.tensor([0.5, 20.0])[None, :, None]  # heads differ
    write_kv(cache, torch.cat([_slots(2, 0, BS), _slots(4, 0, BS)]), x)
    got = read_blocks(cache, torch.tensor([2, 4]), torch.float32).reshape(2 * BS, KVH, D)
    for h in range(KVH):
        for b in range(2):
            part = x[b * BS:(b + 1) * BS, h]
            amax = float(part.abs().max())
            assert (got[b * BS:(b + 1) * BS, h] - part).abs().max() <= _tol(kind, amax)
    scale = cache.scales[2]
    amax = x[:BS].abs().amax(dim=(0, 2))
    if kind == "int8":
        torch.testing.assert_close(scale, amax / INT8_MAX)
    else:  # a power of two putting the largest value in (224, 448]
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
        assert bool(((amax / scale > FP8_MAX / 2) & (amax / scale <= FP8_MAX)).all())


@pytest.mark.parametrize("kind", KINDS)
def test_scale_grows_and_the_block_is_requantized(kind: str) -> None:
    _, cache = _cache(kind)
    g = torch.Generator().manual_seed(3)
    small = torch.randn(2, KVH, D, generator=g)
    write_kv(cache, _slots(3, 0, 2), small)  # slots 0, 1 of block 3
    before = cache.scales[3].clone()
    big = torch.randn(1, KVH, D, generator=g) * 50
    write_kv(cache, _slots(3, 2, 1), big)  # slot 2: the scale must grow
    assert bool((cache.scales[3] > before).all())
    got = read_blocks(cache, torch.tensor([3]), torch.float32)[0]
    amax = float(big.abs().max())
    # The earlier tokens are still right under the new scale (not their old codes
    # read with it, which would make them ~50x too large): their codes were rounded
    # under the old scale, then re-rounded under the new one.
    assert (got[:2] - small).abs().max() <= _tol(kind, amax) + _tol(kind, float(small.abs().max()))
    assert (got[2:3] - big).abs().max() <= _tol(kind, amax)
    # A smaller token afterwards leaves the scale alone.
    grown = cache.scales[3].clone()
    write_kv(cache, _slots(3, 3, 1), small[:1] / 10)
    assert torch.equal(cache.scales[3], grown)


def test_fp8_growth_by_powers_of_two_keeps_codes_exact() -> None:
    """Exact while the re-scaled codes stay in e4m3's normal range (>= 2**-6)."""
    _, cache = _cache("fp8_e4m3")
    g = torch.Generator().manual_seed(0)
    first = (torch.rand(2, KVH, D, generator=g) + 1) * torch.randn(2, KVH, D, generator=g).sign()
    write_kv(cache, _slots(1, 0, 2), first)
    was = read_blocks(cache, torch.tensor([1]), torch.float32)[0, :2].clone()
    write_kv(cache, _slots(1, 2, 1), torch.full((1, KVH, D), 12.0))  # the scale grows 8x
    assert torch.equal(read_blocks(cache, torch.tensor([1]), torch.float32)[0, :2], was)


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_at_slot_zero_starts_the_block_afresh(kind: str) -> None:
    """A freed block keeps its last owner's scales; its next owner writes from slot 0."""
    _, cache = _cache(kind)
    write_kv(cache, _slots(2, 0, BS), torch.randn(BS, KVH, D) * 1000)  # the old owner
    tiny = torch.randn(2, KVH, D) * 0.01
    write_kv(cache, _slots(2, 0, 2), tiny)
    got = read_blocks(cache, torch.tensor([2]), torch.float32)[0, :2]
    assert (got - tiny).abs().max() <= _tol(kind, float(tiny.abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_block_copies_carry_their_scales(kind: str) -> None:
    """CoW copies and transfers move whole rows: codes and scales together."""
    pool, cache = _cache(kind)
    x = torch.randn(BS, KVH, D) * 3
    write_kv(cache, _slots(1, 0, BS), x)
    pool.kv[:, :, torch.tensor([5])] = pool.kv[:, :, torch.tensor([1])]  # as pdserve.engine.pool_blocks.copy_blocks
    a, b = read_blocks(cache, torch.tensor([1, 5]), torch.float32)
    assert torch.equal(a, b) and bool(cache.scales[5].gt(0).all())


def test_plain_pools_are_untouched_by_the_helpers() -> None:
    pool = KVPool(_layout("float32"), num_blocks=4)
    k, _ = pool.layer_views(0)
    assert isinstance(k, torch.Tensor)
    x = torch.randn(3, KVH, D)
    write_kv(k, _slots(2, 1, 3), x)
    assert torch.equal(read_blocks(k, torch.tensor([2]), torch.float32)[0, 1:], x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale", [0.37, 2.0**-20, 300.0])  # the last takes torch's conversion
def test_fp8_reads_equal_torchs_conversion_for_every_code(dtype: torch.dtype, scale: float) -> None:
    """The CPU read decodes e4m3 through its bits; every finite code, subnormals included."""
    _, cache = _cache("fp8_e4m3", num_blocks=9)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are never written
    cache.codes.view(9, -1)[1:5, :] = torch.cat([codes, codes[:2]]).view(4, -1)
    cache.scales[1:5] = scale
    got = read_blocks(cache, torch.tensor([1, 2, 3, 4]), dtype).reshape(-1)[:254]
    want = codes.view(torch.float8_e4m3fn).to(dtype) * torch.tensor(scale).to(dtype)
    assert torch.equal(got, want)
