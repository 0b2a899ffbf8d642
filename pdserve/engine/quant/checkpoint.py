"""Read one fused linear of a pre-quantized (AWQ or GPTQ) checkpoint into the int4 path.

The loader names each fused parameter's float sources (`...q_proj.weight` [N, K], ...);
a quantized checkpoint stores each source as `qweight`/`qzeros`/`scales` (+ GPTQ's
`g_idx`) under the same prefix. Shapes are checked against the layout the
`quantization_config` implies, so a mislabelled checkpoint fails with the tensor's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pdserve.engine.quant.formats import PrequantConfig, QuantizationError
from pdserve.engine.quant.linear import int4_linear
from pdserve.engine.quant.pack import Int4Parts, awq_parts, gptq_parts

# (name, expected shape) -> tensor; raises the loader's CheckpointError when absent or misshapen.
GetTensor = Callable[[str, tuple[int, ...]], torch.Tensor]


def read_parts(get: GetTensor, has: Callable[[str], bool], prefix: str, n: int, k: int,
               pq: PrequantConfig) -> Int4Parts:
    """Int4Parts of the linear stored under `prefix` (weight [n, k] in float form)."""
    group = pq.group_size or k
    if n % 8 or k % 8 or k % group:
        raise QuantizationError(f"{prefix}: a {n}x{k} weight does not fit {pq.method} 4-bit packing "
                                f"with group_size {pq.group_size or -1}")
    groups = k // group
    qzeros = get(prefix + "qzeros", (groups, n // 8))
    scales = get(prefix + "scales", (groups, n))
    if pq.method == "awq":
        return awq_parts(get(prefix + "qweight", (k, n // 8)), qzeros, scales, pq)
    g_idx = get(prefix + "g_idx", (k,)) if has(prefix + "g_idx") else None
    if pq.desc_act and g_idx is None:
        raise QuantizationError(f"{prefix}: gptq desc_act checkpoint lacks g_idx")
    return gptq_parts(get(prefix + "qweight", (k // 8, n)), qzeros, scales, g_idx, pq)


def load_linear(get: GetTensor, has: Callable[[str], bool], sources: Sequence[tuple[str, tuple[int, ...]]],
                pq: PrequantConfig, dtype: torch.dtype, device: torch.device,
                part_of: Callable[[int, Int4Parts], Int4Parts] | None = None) -> nn.Module:
    """The int4 layer for one fused parameter built from float `sources` (name, [N, K]);
    `part_of(index, parts)`: the part of source `index` this process holds (tensor
    parallel), default all of it."""
    parts = []
    for index, (name, shape) in enumerate(sources):
        if not name.endswith(".weight") or len(shape) != 2:
            raise QuantizationError(f"{name} is not a linear weight")
        read = read_parts(get, has, name.removesuffix("weight"), shape[0], shape[1], pq)
        parts.append(read if part_of is None else part_of(index, read))
    return int4_linear(parts, dtype, device)
