"""Triton paged decode attention: reads the KV pool in place through block tables.

Selected by `select_backend` on CUDA when triton imports and the KV cache is
unquantized. Decodes run the Triton kernels in `pdserve.engine.attention.triton_kernels` (no per-step
gather of each sequence's KV; grouped-query heads packed; float32 accumulation;
long contexts split over several programs and merged by a log-sum-exp reduction).
Prefill chunks (whole prompts, prefix-cache hits, later chunks of a chunked prefill)
run a causal kernel over the pool too, without a mask tensor.

A quantized pool (`pdserve.engine.runner.kv_quant.QuantizedCache`, one scale per block and head
ahead of one-byte codes) is not read by these kernels: the backend refuses it.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch

from pdserve.engine.attention.native import default_backend as native_default_backend
from pdserve.engine.attention.paged import (
    AttentionBackend,
    AttentionMetadata,
    DecodeBatch,
    PrefillSeq,
)
from pdserve.engine.runner.kv_quant import KVCacheView, write_plain_kv

# A split covers at least this many KV blocks; splits are added until about
# TARGET_PROGRAMS programs run (enough to fill a GPU's SMs at small batch).
MIN_BLOCKS_PER_SPLIT = 8
TARGET_PROGRAMS = 256


def triton_available() -> bool:
    """Whether triton is importable here."""
    return importlib.util.find_spec("triton") is not None


def select_backend(dtype: torch.dtype, device: torch.device, plain_kv: bool = True
                   ) -> AttentionBackend:
    """Triton on CUDA over a plain (not quantized) pool where triton is installed; else
    `pdserve.engine.attention.native.default_backend` (in-place C kernel for bf16 on CPU, or torch)."""
    if device.type == "cuda" and plain_kv and triton_available():
        return TritonPagedAttention()
    return native_default_backend(dtype, device, plain_kv)


@dataclass(frozen=True)
class SplitPlan:
    num_splits: int
    blocks_per_split: int


def plan_splits(batch: int, kv_heads: int, max_blocks: int, num_splits: int | None = None
                ) -> SplitPlan:
    """How many KV splits a decode group uses (`num_splits` forces a count)."""
    max_blocks = max(max_blocks, 1)
    if num_splits is None:
        want = math.ceil(TARGET_PROGRAMS / max(batch * kv_heads, 1))
        num_splits = min(want, math.ceil(max_blocks / MIN_BLOCKS_PER_SPLIT))
    num_splits = max(1, min(num_splits, max_blocks))
    per = math.ceil(max_blocks / num_splits)
    return SplitPlan(math.ceil(max_blocks / per), per)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dot_ok(block_size: int, head_dim: int) -> bool:
    """tl.dot needs power-of-two tiles of at least 16 on a GPU; else broadcast + sum."""
    return block_size >= 16 and head_dim >= 16 and _pow2(head_dim) == head_dim \
        and _pow2(block_size) == block_size


def _check_heads(h: int, kvh: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if h % kvh or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"{h} query heads over {kvh} KV heads, or a non-unit head_dim stride")


class TritonPagedAttention(AttentionBackend):
    """Decode and prefill attention in Triton over the paged pool."""

    flat_decode = True  # one launch over all decodes; split-KV evens out long contexts

    def __init__(self, num_splits: int | None = None) -> None:
        from pdserve.engine.attention import triton_kernels  # deferred: triton is optional

        self._kernels = triton_kernels
        self.num_splits = num_splits

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCacheView,
        v_cache: KVCacheView,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = write_plain_kv("TritonPagedAttention", k_cache, v_cache, meta.slot_mapping, k, v)
        outs = []
        if meta.decode is not None:
            b = meta.decode.num_seqs
            outs.append(self._decode(q[:b], k_cache, v_cache, meta.decode))
        for p in meta.prefills:
            outs.append(self.prefill(q[p.q_start : p.q_end], k_cache, v_cache, p))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                p: PrefillSeq) -> torch.Tensor:
        """One chunk's q [n, H, D] (its K/V already in the pool) -> [n, H * D]."""
        n, h, d = q.shape
        kvh = k_cache.shape[2]
        block_size = k_cache.shape[1]
        _check_heads(h, kvh, k_cache, v_cache)
        out = torch.empty(n, h, d, dtype=q.dtype, device=q.device)
        use_dot = _dot_ok(block_size, d)
        block_m = 16 if use_dot else 8
        self._kernels.paged_prefill_kernel[(triton_cdiv(n, block_m), h)](
            q, k_cache, v_cache, p.block_table, out,
            1.0 / math.sqrt(d), n, p.start_pos, p.ctx_len,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            out.stride(0), out.stride(1),
            GROUP=h // kvh, HEAD_DIM=d, DIM_PAD=_pow2(d),
            BLOCK_SIZE=block_size, BLOCK_PAD=_pow2(block_size),
            BLOCK_M=block_m, USE_DOT=use_dot,
        )
        return out.view(n, h * d)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                dec: DecodeBatch) -> torch.Tensor:
        """q [B, H, D] of every decode, one launch over the flat batch -> [B, H * D]."""
        if dec.block_tables is None or dec.ctx_lens is None:
            raise ValueError("TritonPagedAttention needs flat decode metadata "
                             "(build_metadata(..., flat_decode=True))")
        tables, ctx_lens = dec.block_tables, dec.ctx_lens
        b, h, d = q.shape
        kvh = k_cache.shape[2]
        block_size = k_cache.shape[1]
        _check_heads(h, kvh, k_cache, v_cache)
        q = q.contiguous()
        plan = plan_splits(b, kvh, tables.shape[1], self.num_splits)
        part = torch.empty(b, h, plan.num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, h, plan.num_splits, dtype=torch.float32, device=q.device)
        group = h // kvh
        use_dot = _dot_ok(block_size, d)
        kern = self._kernels
        kern.paged_decode_kernel[(b, kvh, plan.num_splits)](
            q, k_cache, v_cache, tables, ctx_lens, part, lse,
            1.0 / math.sqrt(d),
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            tables.stride(0),
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            GROUP=group, GROUP_PAD=max(16, _pow2(group)) if use_dot else _pow2(group),
            HEAD_DIM=d, DIM_PAD=_pow2(d),
            BLOCK_SIZE=block_size, BLOCK_PAD=_pow2(block_size),
            BLOCKS_PER_SPLIT=plan.blocks_per_split, USE_DOT=use_dot,
        )
        out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
        kern.split_reduce_kernel[(b, h)](
            part, lse, out,
            part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=plan.num_splits, SPLIT_PAD=_pow2(plan.num_splits),
            HEAD_DIM=d, DIM_PAD=_pow2(d),
        )
        return out.view(b, h * d)
