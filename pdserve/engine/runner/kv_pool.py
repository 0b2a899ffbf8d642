"""KVPool: the one paged KV tensor of a worker, laid out as `pdserve.common.kv_layout` says.

    kv[layer, 0=K / 1=V, block, slot, kv_head, head_dim]

(a quantized KV dtype: raw uint8 rows of scales and codes, `pdserve.engine.runner.kv_quant`).

Block 0 (NULL_BLOCK) is reserved here: the block manager never hands it out, and
padded block-table entries point at it. The pool can be allocated by torch or
wrap an external buffer (e.g. shared memory the decode worker created), in which
case the buffer's owner keeps it alive and frees it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pdserve.common.kv_layout import NULL_BLOCK, KVLayout
from pdserve.engine.runner.kv_quant import KVCacheView, quantized_views

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORAGE_DTYPES = {**TORCH_DTYPES, "uint8": torch.uint8}


class KVPool:
    """One worker's KV cache tensor; `layer_views(i)` are what attention reads and writes."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int | None = None,
        device: torch.device | str = "cpu",
        buffer: torch.Tensor | np.ndarray | None = None,
    ) -> None:
        self.layout = layout
        self.dtype = STORAGE_DTYPES[layout.storage_dtype]
        if buffer is not None:
            self.kv = _wrap_buffer(buffer, layout, self.dtype)
            # Padding writes and masked reads touch the null block; keep it finite.
            self.kv[:, :, NULL_BLOCK].zero_()
        else:
            if num_blocks is None:
                raise ValueError("KVPool needs num_blocks or a buffer")
            # Zeros, not empty: masked-out slots still enter the attention matmul
            # (with weight 0), and 0 * NaN from uninitialised memory would be NaN.
            self.kv = torch.zeros(layout.pool_shape(num_blocks), dtype=self.dtype, device=device)
        if self.kv.shape[2] < 2:
            raise ValueError("a KV pool needs at least 2 blocks (the null block and one more)")
        self.num_blocks = int(self.kv.shape[2])
        self.device = self.kv.device

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    @property
    def num_usable_blocks(self) -> int:
        """Blocks the block manager may hand out (all but the null block)."""
        return self.num_blocks - 1

    def layer_views(self, layer: int) -> tuple[KVCacheView, KVCacheView]:
        """(K, V) of `layer`, each [num_blocks, block_size, kv_heads, head_dim], contiguous;
        for a quantized layout, views of each row's codes and scales."""
        if self.layout.quantized:
            return (quantized_views(self.kv[layer, 0], self.layout),
                    quantized_views(self.kv[layer, 1], self.layout))
        return self.kv[layer, 0], self.kv[layer, 1]

    def all_layer_views(self) -> list[tuple[KVCacheView, KVCacheView]]:
        return [self.layer_views(i) for i in range(self.layout.num_layers)]


def _wrap_buffer(buffer: Any, layout: KVLayout, dtype: torch.dtype) -> torch.Tensor:
    """A pool-shaped tensor sharing memory with `buffer`.

    Accepts a tensor/array already of shape `layout.pool_shape(n)` and the pool
    dtype, or any contiguous buffer of raw bytes (e.g. uint8 shared memory) whose
    size is a whole number of blocks; n is taken from the buffer.
    """
    t = torch.from_numpy(buffer) if isinstance(buffer, np.ndarray) else buffer
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kv buffer must be a torch.Tensor or numpy.ndarray, got {type(buffer)}")
    if t.dtype == dtype and t.dim() == 6:
        n = int(t.shape[2])
        if tuple(t.shape) != layout.pool_shape(n):
            raise ValueError(
                f"kv buffer shape {tuple(t.shape)} != pool shape {layout.pool_shape(n)}"
            )
        if not t.is_contiguous():
            raise ValueError("kv buffer must be contiguous")
        return t
    if not t.is_contiguous():
        raise ValueError("kv buffer must be contiguous")
    raw = t.reshape(-1).view(torch.uint8)
    block_bytes = layout.block_bytes_per_layer * layout.num_layers
    if raw.numel() % block_bytes:
        raise ValueError(
            f"kv buffer of {raw.numel()} bytes is not a whole number of {block_bytes}-byte blocks"
        )
    return raw.view(dtype).view(layout.pool_shape(raw.numel() // block_bytes))
