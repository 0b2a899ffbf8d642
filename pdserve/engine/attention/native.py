"""Decode attention read in place from the paged pool (pdserve/engine/kernels/_cpu_kernels.c, via ctypes).

`TorchPagedAttention` gathers each decoding sequence's whole context out of the
pool per layer per step (read, write, read again) and pads it to its group's
longest; on a CPU decode step at a batch of 16 that gather moves more bytes than
the layer's weights. `InPlacePagedAttention` walks each sequence's block table
in C instead, reading each K/V row once. Prefill rows take the same kernel, each as
the decode of its position, so attention is row-invariant (`InPlacePagedAttention`).

The library is optional (pdserve/engine/kernels/native.py): `NATIVE` is None without it,
and `default_backend` then gives the torch backend.
It serves bfloat16 by default: float32 keeps SDPA, so float32 greedy output stays
bit-identical to what the exactness suites were computed with.
"""

from __future__ import annotations

import ctypes
import math
from typing import ClassVar

import torch

from pdserve.engine.attention.paged import (
    AttentionBackend,
    DecodeBatch,
    PrefillSeq,
    TorchPagedAttention,
)
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels.native import DTYPE_CODES as _DTYPE_CODES
from pdserve.engine.runner.kv_quant import KVCacheView, QuantizedCache

_KIND_CODES = {"fp8_e4m3": 0, "int8": 1}  # pdserve/engine/kernels/_attn_q8.c
_ERRORS = {1: "out of memory", 2: "block id outside the pool", 3: "bad context length or shape"}


class NativeAttention:
    """The loaded kernel library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        # A library built before pdserve/engine/kernels/_attn_q8.c leaves a quantized pool to the torch path.
        self.reads_quantized = hasattr(lib, "pd_paged_decode_q8")
        self.prefills = hasattr(lib, "pd_paged_prefill")

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        num_threads: int,
    ) -> torch.Tensor:
        """q [B, H, D]; pool views [num_blocks, block_size, KVH, D]; tables [B, max_blocks]
        and ctx_lens [B] int64 -> attention output [B, H * D] in q's dtype.

        Raises ValueError on a block id outside the pool, a context longer than its
        table, or tensors of the wrong dtype, device or layout (nothing is read then).
        """
        b, h, d = q.shape
        nblocks, bs, kvh, kd = k_cache.shape
        _check(q, k_cache, v_cache, block_tables, ctx_lens, b, d, kd)
        out = torch.empty(b, h * d, dtype=q.dtype)
        rc = self._lib.pd_paged_decode(
            _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], ctx_lens.data_ptr(), b, h, kvh, d, bs,
            nblocks, 1.0 / math.sqrt(d), out.data_ptr(), num_threads,
        )
        if rc:
            raise ValueError(f"paged decode attention refused its input: {_ERRORS.get(rc, rc)}")
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        start: int,
        num_threads: int,
    ) -> torch.Tensor:
        """One sequence's prefill rows q [n, H, D] at positions start .. start + n - 1 of
        `block_table` [max_blocks] int64, row i attending keys [0, start + i] of the pool:
        each row's output has the bits `decode` gives it at its position (the kernel shares
        only the loads between a few consecutive rows, pdserve/engine/kernels/_attn_bf16.c).
        ValueError as `decode`."""
        n, h, d = q.shape
        nblocks, bs, kvh, kd = k_cache.shape
        table = block_table.view(1, -1)
        last = torch.tensor([start + n], dtype=torch.long)
        _check(q[-1:], k_cache, v_cache, table, last, 1, d, kd)  # the longest row: every other fits too
        out = torch.empty(n, h * d, dtype=q.dtype)
        rc = self._lib.pd_paged_prefill(
            _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            table.data_ptr(), table.shape[1], start, n, h, kvh, d, bs, nblocks, 1.0 / math.sqrt(d),
            out.data_ptr(), num_threads,
        )
        if rc:
            raise ValueError(f"paged prefill attention refused its input: {_ERRORS.get(rc, rc)}")
        return out

    def decode_quantized(
        self,
        q: torch.Tensor,
        k_cache: QuantizedCache,
        v_cache: QuantizedCache,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        num_threads: int,
    ) -> torch.Tensor:
        """`decode` over an fp8/int8 pool (pdserve/engine/kernels/_attn_q8.c): the codes and their
        per-block-per-head scales are read in place and dequantized in registers."""
        b, h, d = q.shape
        nblocks, bs, kvh, _ = k_cache.codes.shape
        _check_quantized(q, k_cache, v_cache, block_tables, ctx_lens, b, d)
        out = torch.empty(b, h * d, dtype=q.dtype)
        kc, vc = k_cache.codes, v_cache.codes
        rc = self._lib.pd_paged_decode_q8(
            _DTYPE_CODES[q.dtype], _KIND_CODES[k_cache.kind], q.data_ptr(), q.stride(0),
            kc.data_ptr(), k_cache.scales.data_ptr(), vc.data_ptr(), v_cache.scales.data_ptr(),
            kc.stride(0), kc.stride(1), k_cache.scales.stride(0), block_tables.data_ptr(),
            block_tables.shape[1], ctx_lens.data_ptr(), b, h, kvh, d, bs, nblocks,
            1.0 / math.sqrt(d), out.data_ptr(), num_threads,
        )
        if rc:
            raise ValueError(f"paged decode attention refused its input: {_ERRORS.get(rc, rc)}")
        return out


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
    lens: torch.Tensor, b: int, d: int, kd: int,
) -> None:
    if q.dtype not in _DTYPE_CODES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"paged decode attention serves float32/bfloat16, got {q.dtype}/{k.dtype}")
    if k.shape != v.shape or kd != d:
        raise ValueError(f"pool views {tuple(k.shape)}/{tuple(v.shape)} do not fit q's head_dim {d}")
    if not all(t.is_contiguous() for t in (k, v)):
        raise ValueError("paged decode attention needs contiguous pool views and tables")
    _check_query(q, k.shape[2], tables, lens, b, (k, v))


def _check_quantized(q: torch.Tensor, k: QuantizedCache, v: QuantizedCache, tables: torch.Tensor,
                     lens: torch.Tensor, b: int, d: int) -> None:
    if q.dtype not in _DTYPE_CODES:
        raise ValueError(f"paged decode attention serves float32/bfloat16 queries, got {q.dtype}")
    if k.kind not in _KIND_CODES or v.kind != k.kind:
        raise ValueError(f"quantized KV kinds {k.kind}/{v.kind} are not fp8_e4m3 or int8 alike")
    if k.codes.dtype != torch.uint8 or k.scales.dtype != torch.float32 or v.codes.dtype != torch.uint8 \
            or v.scales.dtype != torch.float32:
        raise ValueError("a quantized KV pool holds uint8 codes and float32 scales")
    nb, _, kvh, kd = k.codes.shape
    if v.codes.shape != k.codes.shape or kd != d or tuple(k.scales.shape) != (nb, kvh) \
            or v.scales.shape != k.scales.shape:
        raise ValueError(f"quantized pool views {tuple(k.codes.shape)}/{tuple(v.codes.shape)} "
                         f"do not fit q's head_dim {d}")
    # Blocks and slots may be apart (rows with scales, a tensor-parallel head slice); one
    # slot's heads and one block's scales must not be, and K and V must agree.
    cs, ss = k.codes.stride(), k.scales.stride()
    if cs[2:] != (d, 1) or ss[1] != 1 or v.codes.stride() != cs or v.scales.stride() != ss:
        raise ValueError(f"quantized pool views of strides {cs}/{ss} are not laid out as the pool's")
    _check_query(q, kvh, tables, lens, b, (k.codes, k.scales, v.codes, v.scales))


def _check_query(q: torch.Tensor, kvh: int, tables: torch.Tensor, lens: torch.Tensor, b: int,
                 pool: tuple[torch.Tensor, ...]) -> None:
    if q.shape[1] % kvh:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {kvh} KV heads")
    for t in (q, tables, lens, *pool):
        if t.device.type != "cpu":
            raise ValueError("paged decode attention needs CPU tensors")
    # q's rows may be apart (a view of the qkv projection); each row's heads must not be.
    if q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.stride(0) < q.shape[1] * q.shape[2]:
        raise ValueError("paged decode attention needs q's heads of each row contiguous")
    if not all(t.is_contiguous() for t in (tables, lens)):
        raise ValueError("paged decode attention needs contiguous pool views and tables")
    if tables.dtype != torch.long or lens.dtype != torch.long:
        raise ValueError("block tables and context lengths must be int64")
    if tables.dim() != 2 or tables.shape[0] != b or tuple(lens.shape) != (b,):
        raise ValueError(f"{b} queries need [{b}, n] block tables and [{b}] lengths")


NATIVE: NativeAttention | None = (
    NativeAttention(native_kernels.LIB) if native_kernels.LIB is not None else None
)


class InPlacePagedAttention(TorchPagedAttention):
    """Decodes and prefill rows through the native kernel over the pool in place.

    A prefill chunk's row i at position start + i is attended exactly as a decode at that
    position: one query over keys [0, start + i] of the pool (written first, `forward`),
    a few consecutive rows per kernel work item sharing the K/V loads (`NativeAttention.prefill`).
    Each row then has the same bits whether its context came in one chunk, many, from the
    prefix cache or was decoded, whatever else shares the step (docs/determinism.md);
    SDPA's flash kernel and the chunked log-sum-exp merge give none of that."""

    flat_decode = True
    invariant_prefill: ClassVar[bool] = True
    """False: prefill chunks take SDPA (not row-invariant; `bench.invariance`'s baseline)."""
    row_tiles: ClassVar[bool] = True
    """False: each prefill row runs as its own decode call (the same bits; `bench.invariance`'s
    "untiled" run, the route before the row tiles)."""

    def __init__(self, native: NativeAttention) -> None:
        self.native = native

    def _prefill(  # type: ignore[override]
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCacheView, v_cache: KVCacheView,
        p: PrefillSeq,
    ) -> torch.Tensor:
        if not self.invariant_prefill:
            return TorchPagedAttention._prefill(q, k, v, k_cache, v_cache, p)
        threads = torch.get_num_threads()
        if self.row_tiles and self.native.prefills and isinstance(k_cache, torch.Tensor) \
                and isinstance(v_cache, torch.Tensor):
            return self.native.prefill(q, k_cache, v_cache, p.block_table, p.start_pos, threads)
        n = q.shape[0]  # a quantized pool (or an older library): one decode per row
        tables = p.block_table.view(1, -1).expand(n, -1).contiguous()
        lens = torch.arange(p.start_pos + 1, p.start_pos + n + 1, dtype=torch.long)
        if isinstance(k_cache, QuantizedCache) and isinstance(v_cache, QuantizedCache):
            return self.native.decode_quantized(q, k_cache, v_cache, tables, lens, threads)
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
        return self.native.decode(q, k_cache, v_cache, tables, lens, threads)

    def _decode(  # type: ignore[override]
        self, q: torch.Tensor, k_cache: KVCacheView, v_cache: KVCacheView, dec: DecodeBatch
    ) -> torch.Tensor:
        assert dec.block_tables is not None and dec.ctx_lens is not None
        threads = torch.get_num_threads()
        if isinstance(k_cache, QuantizedCache) and isinstance(v_cache, QuantizedCache):
            return self.native.decode_quantized(q, k_cache, v_cache, dec.block_tables,
                                                dec.ctx_lens, threads)
        assert isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
        return self.native.decode(q, k_cache, v_cache, dec.block_tables, dec.ctx_lens, threads)


def default_backend(dtype: torch.dtype, device: torch.device, plain_kv: bool = True,
                    quantized_kv: bool = False) -> AttentionBackend:
    """The in-place kernel for bfloat16 on CPU where it is built, over a plain KV pool
    (unquantized, whole and contiguous) or a quantized one (fp8/int8, read with its
    scales, pdserve/engine/kernels/_attn_q8.c); else the torch backend."""
    if NATIVE is not None and dtype == torch.bfloat16 and device.type == "cpu" and (
            plain_kv or (quantized_kv and NATIVE.reads_quantized)):
        return InPlacePagedAttention(NATIVE)
    return TorchPagedAttention()


def describe() -> str:
    """Which decode attention path bf16 uses in this process, for benchmark output and logs."""
    return "in-place native" if NATIVE is not None else "gather + SDPA (native kernel not built)"
