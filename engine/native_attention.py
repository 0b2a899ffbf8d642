"""Decode attention read in place from the paged pool (engine/_cpu_kernels.c, via ctypes).

`TorchPagedAttention` gathers each decoding sequence's whole context out of the
pool per layer per step (read, write, read again) and pads it to its group's
longest; on a CPU decode step at a batch of 16 that gather moves more bytes than
the layer's weights. `InPlacePagedAttention` walks each sequence's block table
in C instead, reading each K/V row once. Prefill chunks still go through the
torch path (one SDPA call per chunk, where the gather is amortised over the
chunk's tokens).

The library is optional (engine/native_kernels.py): `NATIVE` is None without it,
and `default_backend` then gives the torch backend.
It serves bfloat16 by default: float32 keeps SDPA, so float32 greedy output stays
bit-identical to what the exactness suites were computed with.
"""

from __future__ import annotations

import ctypes
import math

import torch

from engine import native_kernels
from engine.attention import AttentionBackend, DecodeBatch, TorchPagedAttention
from engine.native_kernels import DTYPE_CODES as _DTYPE_CODES

_ERRORS = {1: "out of memory", 2: "block id outside the pool", 3: "bad context length or shape"}


class NativeAttention:
    """The loaded kernel library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

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


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
    lens: torch.Tensor, b: int, d: int, kd: int,
) -> None:
    if q.dtype not in _DTYPE_CODES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"paged decode attention serves float32/bfloat16, got {q.dtype}/{k.dtype}")
    if k.shape != v.shape or kd != d:
        raise ValueError(f"pool views {tuple(k.shape)}/{tuple(v.shape)} do not fit q's head_dim {d}")
    if q.shape[1] % k.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[2]} KV heads")
    for t in (q, k, v, tables, lens):
        if t.device.type != "cpu":
            raise ValueError("paged decode attention needs CPU tensors")
    # q's rows may be apart (a view of the qkv projection); each row's heads must not be.
    if q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.stride(0) < q.shape[1] * q.shape[2]:
        raise ValueError("paged decode attention needs q's heads of each row contiguous")
    if not all(t.is_contiguous() for t in (k, v, tables, lens)):
        raise ValueError("paged decode attention needs contiguous pool views and tables")
    if tables.dtype != torch.long or lens.dtype != torch.long:
        raise ValueError("block tables and context lengths must be int64")
    if tables.dim() != 2 or tables.shape[0] != b or tuple(lens.shape) != (b,):
        raise ValueError(f"{b} queries need [{b}, n] block tables and [{b}] lengths")


NATIVE: NativeAttention | None = (
    NativeAttention(native_kernels.LIB) if native_kernels.LIB is not None else None
)


class InPlacePagedAttention(TorchPagedAttention):
    """Decodes through the native kernel over the pool in place; prefill as the torch backend."""

    flat_decode = True

    def __init__(self, native: NativeAttention) -> None:
        self.native = native

    def _decode(  # type: ignore[override]
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dec: DecodeBatch
    ) -> torch.Tensor:
        assert dec.block_tables is not None and dec.ctx_lens is not None
        return self.native.decode(q, k_cache, v_cache, dec.block_tables, dec.ctx_lens,
                                  torch.get_num_threads())


def default_backend(dtype: torch.dtype, device: torch.device,
                    plain_kv: bool = True) -> AttentionBackend:
    """The in-place kernel for bfloat16 on CPU over a plain (not quantized) KV pool where
    it is built, else the torch backend."""
    if NATIVE is not None and dtype == torch.bfloat16 and device.type == "cpu" and plain_kv:
        return InPlacePagedAttention(NATIVE)
    return TorchPagedAttention()


def describe() -> str:
    """Which decode attention path bf16 uses in this process, for benchmark output and logs."""
    return "in-place native" if NATIVE is not None else "gather + SDPA (native kernel not built)"
