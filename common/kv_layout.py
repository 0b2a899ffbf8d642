"""The shape of a paged KV pool, shared by the engine and the transfer layer.

Pool tensor layout (one contiguous tensor per worker):

    kv[layer, kv_index, block, slot, kv_head, head_dim]    kv_index 0 = K, 1 = V

so one block of one layer's K (or V) is a contiguous run of
`block_size * num_kv_heads * head_dim` elements. Block 0 is the null block:
never handed out, padding writes land there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
NULL_BLOCK = 0


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
    dtype: str  # KV-cache dtype: "float32" | "float16" | "bfloat16"
    weights: str = ""  # weights fingerprint (engine.weights_fingerprint); "" only in tests
    compute_dtype: str | None = None  # dtype the weights run in; None: the KV dtype
    quantization: str = "none"  # weight quantization method; "none" is all the engine loads

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x KV heads x head_dim x bytes -- never the query head count."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def block_elems_per_layer_kv(self) -> int:
        """Elements in one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.block_elems_per_layer_kv * self.bytes_per_element

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
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
        ))
        return hashlib.sha256(key.encode()).hexdigest()[:16]
