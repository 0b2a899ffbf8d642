"""Quantized KV cache (`--kv-cache-dtype fp8|int8`): per-block-per-head scales,
quantized writes and the dequantizing read every attention backend calls.

Each (layer, K/V, block) row of a quantized pool holds one float32 scale per KV
head, then the block's one-byte codes (`pdserve.common.kv_layout`); value = code x scale.

Scale policy (one scale per block and head, grown as tokens are appended):

1. A write that covers slot 0 of a block starts the block afresh: its old scales
   (another owner's, or stale) are ignored.
2. Otherwise a block's scale only grows: it becomes max(old, what the new tokens
   need). When it grows, the block's existing codes are re-quantized to the new
   scale before the new tokens are written.
3. fp8 scales are powers of two (the largest value lands in (224, 448]): re-scaling
   an e4m3 code by a power of two is exact (codes pushed below 2**-6, e4m3's
   subnormals, lose bits they would have lost anyway beside the new maximum), so
   growth costs fp8 next to nothing. int8 scales
   are exactly amax / 127 (a uniform code needs a tight scale); its re-quantization
   rounds once per growth, which happens a few times per block at most (a running
   maximum over 16 tokens sets a new record ~3.4 times).

Why not per-slot scales: they make a block independent of write order, but cost
4 bytes per (token, head) instead of per (block, head): 6% more bytes than the
values at head_dim 64, against 0.4% here, and bytes moved per token is what KV
quantization is for. A block's codes depend on the order its tokens were written
in; prefill and decode write a request's tokens in the same order wherever they
run, so disaggregated output still equals colocated output token for token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

from pdserve.common.kv_layout import QUANTIZED_KV_DTYPES, SCALE_BYTES, KVLayout

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
_TINY = 1e-30  # floor of a scale we divide by (an all-zero block has scale 0)


@dataclass(frozen=True)
class QuantizedCache:
    """One layer's K (or V) of a quantized pool: views into its rows, no copies."""

    codes: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim] uint8 (strided)
    scales: torch.Tensor  # [num_blocks, kv_heads] float32 (strided)
    kind: str  # "fp8_e4m3" | "int8"

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


# What a backend gets for one layer's K or V: a plain pool view, or a quantized one.
KVCacheView: TypeAlias = torch.Tensor | QuantizedCache


def quantized_views(rows: torch.Tensor, layout: KVLayout) -> QuantizedCache:
    """`rows` [num_blocks, 1, 1, row_bytes] uint8 (one layer's K or V) as codes and scales."""
    if layout.dtype not in QUANTIZED_KV_DTYPES:
        raise ValueError(f"{layout.dtype} is not a quantized KV dtype")
    head = layout.num_kv_heads * SCALE_BYTES  # scales first: always 4-byte aligned
    flat = rows.view(rows.shape[0], -1)
    scales = flat[:, :head].view(torch.float32)
    codes = flat[:, head : head + layout.block_elems_per_layer_kv].view(
        rows.shape[0], layout.block_size, layout.num_kv_heads, layout.head_dim)
    return QuantizedCache(codes, scales, layout.dtype)


def _encode(x: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 values already divided by their scale -> uint8 codes."""
    if kind == "int8":
        return x.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).view(torch.uint8)
    return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _decode(codes: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    typed = codes.view(torch.int8) if kind == "int8" else codes.view(torch.float8_e4m3fn)
    return typed.to(dtype)


# e4m3 sign and exponent-mantissa bits moved into a wider float's (shift, mask as a
# signed int): that float is the fp8 value x 2**-120, normals and subnormals alike
# (e4m3's exponent bias is 7, theirs 127). On CPU torch converts fp8 element by element,
# ~7x slower than these two integer passes.
_FP8_BITS = {torch.bfloat16: (torch.int16, 4, 0x87FF - (1 << 16)),
             torch.float32: (torch.int32, 20, 0x87F00000 - (1 << 32))}
_FP8_BITS_SCALE = 2.0**120
_FP8_BITS_MAX_SCALE = 2.0**7  # so that scale x 2**120 stays finite in bf16 and float32


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """codes [n, block_size, kv_heads, head_dim] uint8 x scales [n, kv_heads] -> `dtype`."""
    n, bs, kvh, hd = codes.shape
    bits = _FP8_BITS.get(dtype) if kind != "int8" and codes.device.type == "cpu" else None
    if bits is not None and bool(scales.max() < _FP8_BITS_MAX_SCALE):
        wide, shift, mask = bits
        values = codes.view(torch.int8).to(wide).bitwise_left_shift_(shift).bitwise_and_(mask).view(dtype)
        scales = scales * _FP8_BITS_SCALE
    else:
        values = _decode(codes, kind, dtype)
    # One scale per (block, head) spread over its head_dim: a row broadcast is ~2x
    # faster on CPU than a 4-D one with a stride-0 innermost dim.
    row = scales.to(dtype).repeat_interleave(hd, dim=1)[:, None, :]
    return values.view(n, bs, kvh * hd).mul_(row).view(n, bs, kvh, hd)


def _scale_for(amax: torch.Tensor, kind: str) -> torch.Tensor:
    """The smallest scale that holds `amax` (float32): amax / 127, or a power of two."""
    if kind == "int8":
        return amax / INT8_MAX
    # Round amax / 448 up to a power of two on its float32 bits: a non-zero mantissa
    # carries into the exponent, then the mantissa is cleared (0 stays 0).
    bits = (amax / FP8_MAX).view(torch.int32)
    return bits.add_(0x7FFFFF).bitwise_and_(0x7F800000).view(torch.float32)


def write_kv(cache: KVCacheView, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Store `x` [T, kv_heads, head_dim] at pool `slots` [T] (block * block_size + slot)."""
    if isinstance(cache, torch.Tensor):
        kvh, d = cache.shape[2], cache.shape[3]
        cache.view(-1, kvh, d).index_copy_(0, slots, x)
        return
    if slots.numel():
        _write_quantized(cache, slots, x)


def _write_quantized(cache: QuantizedCache, slots: torch.Tensor, x: torch.Tensor) -> None:
    bs, kvh = cache.codes.shape[1], cache.codes.shape[2]
    blocks, offs = slots // bs, slots % bs
    uniq, inv = torch.unique(blocks, return_inverse=True)
    xf = x.float()
    need = torch.zeros(len(uniq), kvh, dtype=torch.float32, device=x.device)
    need.scatter_reduce_(0, inv[:, None].expand(-1, kvh), xf.abs().amax(dim=-1), "amax")
    fresh = torch.zeros(len(uniq), dtype=torch.bool, device=x.device)
    fresh[inv[offs == 0]] = True  # rule 1: the block starts here
    old = cache.scales.index_select(0, uniq).masked_fill(fresh[:, None], 0.0)
    new = torch.maximum(old, _scale_for(need, cache.kind))
    grown = ((new > old) & (old > 0)).any(dim=1).nonzero().view(-1)
    if grown.numel():  # rule 2: re-quantize what the block already holds
        ids = uniq[grown]
        ratio = (old[grown] / new[grown].clamp(min=_TINY))[:, None, :, None]  # 0 where all 0
        held = _decode(cache.codes.index_select(0, ids), cache.kind, torch.float32)
        cache.codes[ids] = _encode(held * ratio, cache.kind)
    cache.scales[uniq] = new
    scale = new.index_select(0, inv).clamp(min=_TINY)[:, :, None]
    cache.codes[blocks, offs] = _encode(xf / scale, cache.kind)


def read_blocks(cache: KVCacheView, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `ids` [n] of one layer's K or V as [n, block_size, kv_heads, head_dim] in
    `dtype`: an index_select of a plain pool, dequantized (code x scale) when quantized."""
    if isinstance(cache, torch.Tensor):
        return cache.index_select(0, ids)
    return _dequantize(cache.codes.index_select(0, ids), cache.scales.index_select(0, ids),
                       cache.kind, dtype)


def write_plain_kv(backend: str, k_cache: KVCacheView, v_cache: KVCacheView, slot_mapping: torch.Tensor,
                   k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`write_kv` for K and V, by a GPU backend (`backend` names it) that reads only an
    unquantized pool: a quantized one is refused before anything is written. Returns the
    two pool views as the plain tensors they are."""
    if isinstance(k_cache, QuantizedCache) or isinstance(v_cache, QuantizedCache):
        raise TypeError(f"{backend} reads only unquantized KV pools; serve "
                        "--kv-cache-dtype fp8/int8 with --attention-backend torch")
    write_kv(k_cache, slot_mapping, k)
    write_kv(v_cache, slot_mapping, v)
    return k_cache, v_cache
