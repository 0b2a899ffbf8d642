"""The shape of a paged KV pool, shared by the engine and the transfer layer.

Pool tensor layout (one contiguous tensor per worker):

    kv[layer, kv_index, block, slot, kv_head, head_dim]    kv_index 0 = K, 1 = V

so one block of one layer's K (or V) is a contiguous run of
`block_size * num_kv_heads * head_dim` elements. Block 0 is the null block:
never handed out, padding writes land there.

A quantized KV cache (`fp8_e4m3`, `int8`) keeps the same row order as raw bytes,
`kv[layer, kv_index, block, 1, 1, row_bytes]` (uint8): each (layer, K/V, block) row
holds one float32 scale per KV head, then the block's `block_size * num_kv_heads *
head_dim` one-byte values, then zero padding to a whole number of 8-byte words. A
row carries its scales, so everything that copies, ships or checksums rows (CoW
copies, the prefix cache, every transport) moves the scales with their blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "int8": 1}
# KV-cache dtypes stored quantized, with per-block-per-head scales in each row.
QUANTIZED_KV_DTYPES = ("fp8_e4m3", "int8")
SCALE_BYTES = 4  # one float32 scale per (layer, K/V, block, KV head)
KV_CACHE_DTYPE_CHOICES = ("auto", "fp8", "fp8_e4m3", "int8")  # vLLM's --kv-cache-dtype names
KV_CACHE_DTYPE_HELP = ("auto (default): the serving dtype; fp8 (= fp8_e4m3) or int8: one byte a "
                       "value (half of bf16), plus a float32 scale per block and KV head")
NULL_BLOCK = 0


def normalize_kv_cache_dtype(name: str) -> str:
    """`fp8` -> `fp8_e4m3`; `auto` stays; ValueError naming the choices otherwise."""
    d = name.strip().lower()
    if d not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(
            f"unknown KV-cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPE_CHOICES)}")
    return "fp8_e4m3" if d == "fp8" else d


def kv_dtype_for(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The pool's KV dtype: the compute dtype for `auto`, else the quantized one."""
    d = normalize_kv_cache_dtype(kv_cache_dtype)
    return compute_dtype if d == "auto" else d


@dataclass(frozen=True)
class KVLayout:
    """The pool's shape and the identity of the model that fills it.

    Every field is part of `compat_hash`: KV computed by one model is garbage to
    another, even one with the same config (a fine-tune), the same weights in another
    compute dtype or quantization, or the same blocks in another size or KV dtype.
    """

    model_id: str  # identity of the model config (the engine: SHA-256 of config.json)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # KV-cache dtype: "float32" | "float16" | "bfloat16" | "fp8_e4m3" | "int8"
    weights: str = ""  # weights fingerprint (pdserve.engine.loading.weights_fingerprint); "" only in tests
    compute_dtype: str | None = None  # dtype the weights run in; None: the KV dtype
    quantization: str = "none"  # weight quantization method; "none" is all the engine loads
    lm_head: str = "none"  # the LM head's quantization (none | int8): it changes the sampled tokens
    # The draft model's own layout hash when its KV ships with this pool's (draft_kv=prefill):
    # then a prefill and a decode worker with different drafts cannot pair.
    draft: str = ""
    # The kernel families its bf16/int8/int4 arithmetic routes to (pdserve/engine/kernels/numerics.py):
    # AMX and non-AMX workers compute bf16 in different orders, so their KV does not mix.
    numerics: str = ""

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_KV_DTYPES

    @property
    def storage_dtype(self) -> str:
        """The pool array's element type: the KV dtype, or raw bytes when quantized."""
        return "uint8" if self.quantized else self.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes -- never the query head count.

        The values only: a quantized block's scales are in `block_bytes_per_layer`."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def block_elems_per_layer_kv(self) -> int:
        """Elements in one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one (layer, K/V, block) row: the values, and when quantized their
        per-head scales padded to whole 8-byte words."""
        values = self.block_elems_per_layer_kv * self.bytes_per_element
        if not self.quantized:
            return values
        return -(-(values + self.num_kv_heads * SCALE_BYTES) // 8) * 8

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block of one layer, K and V together (scales included)."""
        return 2 * self.row_bytes

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        if self.quantized:
            return (self.num_layers, 2, num_blocks, 1, 1, self.row_bytes)
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def weight_dtype(self) -> str:
        return self.compute_dtype or self.dtype

    @property
    def compat_hash(self) -> str:
        """Two pools can exchange blocks only if these hashes are equal."""
        key = "|".join((
            "v2", f"config={self.model_id}", f"weights={self.weights}",
            f"dtype={self.weight_dtype}", f"quant={self.quantization}", f"kv_dtype={self.dtype}",
            f"block={self.block_size}",
            f"heads={self.num_layers}x{self.num_kv_heads}x{self.head_dim}",
            "order=layer,kv,block,slot,head,dim",
            *((f"lm_head={self.lm_head}",) if self.lm_head != "none" else ()),
            *((f"draft={self.draft}",) if self.draft else ()),
            *((f"numerics={self.numerics}",) if self.numerics else ()),
        ))
        return hashlib.sha256(key.encode()).hexdigest()[:16]
