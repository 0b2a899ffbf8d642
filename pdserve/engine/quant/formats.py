"""Which weight quantization a worker serves, and what it costs in bytes. Torch-free.

Schemes (the string the KV compatibility hash, metrics and `/v1/models` report):

- `none`: weights in the compute dtype.
- `int8` (`--quantization int8`): symmetric, one scale per output channel.
- `int4` (`--quantization int4`): asymmetric, groups of `INT4_GROUP` input channels,
  one scale and one zero point per group and output channel.
- `awq` / `gptq`: a pre-quantized 4-bit checkpoint (`quantization_config` in
  config.json), loaded into the int4 path as stored.

Embeddings, norms and MoE routers stay in the compute dtype under every scheme; MoE
experts are quantized like the dense linears. The LM head (`--lm-head-quantization`,
`served_lm_head`): `auto` gives on-the-fly int8/int4 an int8 per-output-channel head
(measured harmless with `bench/quality.py`, bench/README.md) and leaves every other
scheme's head in the compute dtype; `none` keeps it there; `int8` quantizes it under any
scheme. A tied head gets its own int8 copy; the embedding lookup stays in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ON_THE_FLY = ("int8", "int4")
QUANTIZATION_CHOICES = ("none", *ON_THE_FLY)
PREQUANTIZED = ("awq", "gptq")
LM_HEAD_CHOICES = ("auto", "none", "int8")
INT4_GROUP = 128
# Group sizes the int4 kernels take; a checkpoint's per-channel (-1) or larger
# multiple-of-128 groups are served as 128-groups with repeated scales (exact).
KERNEL_GROUPS = (32, 64, 128, 256)


class QuantizationError(ValueError):
    """A quantization request or checkpoint `quantization_config` the engine cannot serve."""


@dataclass(frozen=True)
class PrequantConfig:
    """A pre-quantized checkpoint's `quantization_config`, as the loader reads it."""

    method: str  # awq | gptq
    group_size: int  # input channels per scale; -1 in the checkpoint reads as 0 (per channel)
    desc_act: bool = False  # GPTQ act-order: `g_idx` assigns channels to groups out of order
    zero_offset: int = 0  # GPTQ v1 stores zero - 1; the loader adds this back

    def kernel_group(self, in_features: int) -> int:
        """The group size the int4 kernel runs for a layer of `in_features` inputs."""
        g = self.group_size or in_features
        if g in KERNEL_GROUPS:
            return g
        if g % INT4_GROUP == 0:
            return INT4_GROUP
        raise QuantizationError(f"{self.method} group_size {self.group_size} is not served "
                                f"(supported: {', '.join(map(str, KERNEL_GROUPS))}, -1, or a multiple of 128)")


def parse_quantization_config(raw: Any) -> PrequantConfig | None:
    """config.json's `quantization_config` (None when absent); QuantizationError when
    it names a method or layout the engine cannot serve."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise QuantizationError("quantization_config must be a JSON object")
    method = str(raw.get("quant_method", "")).lower()
    if method not in PREQUANTIZED:
        raise QuantizationError(f"quantization_config.quant_method {method or '<none>'!r} is not served "
                                f"(supported: {', '.join(PREQUANTIZED)})")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise QuantizationError(f"{method} with bits={bits!r} is not served (only 4-bit)")
    group = raw.get("group_size", raw.get("q_group_size"))
    if not isinstance(group, int) or isinstance(group, bool) or (group < 1 and group != -1):
        raise QuantizationError(f"{method} group_size {group!r} must be a positive integer or -1")
    if method == "awq":
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm" or raw.get("zero_point", True) is not True:
            raise QuantizationError(f"awq version {version!r} with zero_point={raw.get('zero_point')!r} "
                                    "is not served (only GEMM with zero points)")
        return PrequantConfig("awq", max(group, 0))
    fmt = str(raw.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantizationError(f"gptq checkpoint_format {fmt!r} is not served (gptq, gptq_v2)")
    return PrequantConfig("gptq", max(group, 0), desc_act=bool(raw.get("desc_act", False)),
                          zero_offset=1 if fmt == "gptq" else 0)


def served_quantization(requested: str, prequant: PrequantConfig | None) -> str:
    """The scheme a worker runs: the checkpoint's method for a pre-quantized checkpoint,
    else `requested` (`none`, `int8`, `int4`)."""
    if requested not in QUANTIZATION_CHOICES:
        raise QuantizationError(f"unknown quantization {requested!r}; choose one of "
                                f"{', '.join(QUANTIZATION_CHOICES)}")
    if prequant is None:
        return requested
    if requested != "none":
        raise QuantizationError(f"the checkpoint is already {prequant.method}-quantized; "
                                f"--quantization {requested} applies to float checkpoints only")
    return prequant.method


def served_lm_head(requested: str, scheme: str) -> str:
    """The LM head's quantization (`none` | `int8`) for `--lm-head-quantization requested`
    next to the served weight `scheme` (`served_quantization`)."""
    if requested not in LM_HEAD_CHOICES:
        raise QuantizationError(f"unknown LM head quantization {requested!r}; choose one of "
                                f"{', '.join(LM_HEAD_CHOICES)}")
    if requested == "auto":
        return "int8" if scheme in ON_THE_FLY else "none"
    return requested


def linear_weight_bytes(out_features: int, in_features: int, scheme: str, compute_bytes: int,
                        group_size: int = INT4_GROUP) -> int:
    """Bytes one linear layer's weight takes under `scheme`, with its scales and zeros.

    int8: 1 byte a weight + a compute-dtype scale per output channel. int4: half a byte
    a weight + a compute-dtype (scale, zero) pair per group and output channel. awq/gptq
    as stored: half a byte a weight, an fp16 scale and a 4-bit zero per group (GPTQ adds
    an int32 `g_idx` per input channel)."""
    n, k = out_features, in_features
    groups = -(-k // (group_size or k))
    if scheme == "none":
        return n * k * compute_bytes
    if scheme == "int8":
        return n * k + n * compute_bytes
    if scheme == "int4":
        return n * k // 2 + 2 * groups * n * compute_bytes
    if scheme in PREQUANTIZED:
        extra = 4 * k if scheme == "gptq" else 0
        return n * k // 2 + groups * n * 2 + groups * n // 2 + extra
    raise QuantizationError(f"unknown quantization scheme {scheme!r}")
