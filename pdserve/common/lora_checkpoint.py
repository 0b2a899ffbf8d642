"""The one reader of PEFT LoRA checkpoints' metadata (`adapter_config.json` and the
safetensors header of `adapter_model.safetensors`), stdlib only: the gateway checks an
adapter with it before serving it, and the engine (`pdserve/engine/lora/checkpoint.py`) plans
its tensors with it.

What is served: `r`, `lora_alpha`, `use_rslora` (scale alpha/sqrt(r), else alpha/r),
`rank_pattern` / `alpha_pattern` (matched as PEFT's `get_pattern_key` does),
`target_modules` among the seven decoder projections, any subset of layers. Refused with
a `LoraError` that says why: a missing or unreadable file, a tensor that is no LoRA
weight of a decoder projection, lora_A without lora_B, shapes that disagree with the
configured rank or (given the model's `ProjectionDims`) with the model, a rank above
`max_rank`, a layer the model lacks, DoRA, trained biases, `modules_to_save`,
`fan_in_fan_out`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from typing import Any

from pdserve.common.lora import LoraError, adapter_files

# PEFT module name -> (fused linear of the engine's model, block it lives in)
MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv", "self_attn"), "k_proj": ("qkv", "self_attn"), "v_proj": ("qkv", "self_attn"),
    "o_proj": ("o", "self_attn"), "gate_proj": ("gate_up", "mlp"), "up_proj": ("gate_up", "mlp"),
    "down_proj": ("down", "mlp"),
}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_FLOAT_DTYPES = ("F32", "F16", "BF16")
MAX_HEADER_BYTES = 16 << 20


@dataclass(frozen=True)
class ProjectionDims:
    """The decoder projections' sizes of the base model."""

    hidden: int
    q_size: int
    kv_size: int
    intermediate: int
    num_layers: int

    def module(self, name: str) -> tuple[int, int, int]:
        """(offset in its fused output, out features, in features) of a PEFT module."""
        h, q, kv, i = self.hidden, self.q_size, self.kv_size, self.intermediate
        return {"q_proj": (0, q, h), "k_proj": (q, kv, h), "v_proj": (q + kv, kv, h),
                "o_proj": (0, h, q), "gate_proj": (0, i, h), "up_proj": (i, i, h),
                "down_proj": (0, h, i)}[name]

    def fused_out(self, group: str) -> int:
        return {"qkv": self.q_size + 2 * self.kv_size, "o": self.hidden,
                "gate_up": 2 * self.intermediate, "down": self.hidden}[group]


@dataclass(frozen=True)
class ModulePlan:
    layer: int
    module: str
    rank: int
    scale: float
    a_name: str
    b_name: str


@dataclass(frozen=True)
class AdapterPlan:
    """A checked adapter's modules, in layer then projection order."""

    modules: tuple[ModulePlan, ...]
    base_model: str

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def target_modules(self) -> tuple[str, ...]:
        names = {m.module for m in self.modules}
        return tuple(n for n in MODULES if n in names)


def plan_adapter(path: str, max_rank: int, dims: ProjectionDims | None = None) -> AdapterPlan:
    """Check the adapter at `path` from its config and tensor header; with `dims`, its
    shapes against the model too. LoraError on the first problem."""
    config = _read_config(path)
    header = _read_header(path)
    pairs: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = _KEY.match(name)
        if m is None or m[3] not in MODULES or MODULES[m[3]][1] != m[2]:
            raise _refuse(path, f"tensor {name!r} is not a LoRA weight of a decoder projection "
                                f"this model has ({', '.join(MODULES)})")
        if not isinstance(info, dict) or info.get("dtype") not in _FLOAT_DTYPES:
            raise _refuse(path, f"tensor {name!r} is not a float tensor")
        layer = int(m[1])
        if dims is not None and layer >= dims.num_layers:
            raise _refuse(path, f"layer {layer} is beyond the model's {dims.num_layers} layers")
        pairs.setdefault((layer, m[3]), {})[m[4]] = (name, list(info.get("shape", [])))
    if not pairs:
        raise _refuse(path, "it holds no LoRA weights of the model's projections")
    alpha = float(config.get("lora_alpha", 8))
    plans = []
    for (layer, module) in sorted(pairs, key=lambda k: (k[0], list(MODULES).index(k[1]))):
        ab = pairs[layer, module]
        if set(ab) != {"A", "B"}:
            raise _refuse(path, f"layer {layer} {module} has lora_A or lora_B only")
        key = f"model.layers.{layer}.{MODULES[module][1]}.{module}"
        rank = int(_pattern(config.get("rank_pattern") or {}, key, config["r"]))
        (a_name, a_shape), (b_name, b_shape) = ab["A"], ab["B"]
        if dims is not None:
            _, out, inp = dims.module(module)
        else:
            out, inp = (b_shape[0] if b_shape else -1), (a_shape[1] if len(a_shape) == 2 else -1)
        if a_shape != [rank, inp] or b_shape != [out, rank]:
            raise _refuse(path, f"{key} has lora_A {tuple(a_shape)} and lora_B {tuple(b_shape)}; "
                                f"the model needs ({rank}, {inp}) and ({out}, {rank})")
        if rank > max_rank:
            raise _refuse(path, f"rank {rank} of {key} is above --max-lora-rank {max_rank}")
        a = float(_pattern(config.get("alpha_pattern") or {}, key, alpha))
        scale = a / math.sqrt(rank) if config.get("use_rslora") else a / rank
        plans.append(ModulePlan(layer, module, rank, scale, a_name, b_name))
    return AdapterPlan(tuple(plans), str(config.get("base_model_name_or_path") or ""))


def _refuse(path: str, why: str) -> LoraError:
    return LoraError(f"LoRA adapter {path!r}: {why}")


def _pattern(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    for key in patterns:  # PEFT's get_pattern_key
        if re.match(rf"(.*\.)?({key})$", module_key):
            return patterns[key]
    return default


def _read_config(path: str) -> dict[str, Any]:
    config_file, _ = adapter_files(path)
    try:
        c = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(c, dict):
        raise _refuse(path, "adapter_config.json is not a JSON object")
    if str(c.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(path, f"peft_type {c.get('peft_type')!r} is not LORA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if c.get(flag):
            raise _refuse(path, f"{why} is not supported")
    if c.get("bias", "none") != "none":
        raise _refuse(path, f"trained biases (bias={c.get('bias')!r}) are not supported")
    if c.get("modules_to_save"):
        raise _refuse(path, f"modules_to_save {c['modules_to_save']!r} is not supported")
    if not isinstance(c.get("r"), int) or c["r"] < 1:
        raise _refuse(path, f"r must be a positive integer, got {c.get('r')!r}")
    targets = c.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(map(str, targets)) - set(MODULES))
        if unknown:
            raise _refuse(path, f"target modules {unknown} are not among the model's "
                                f"projections ({', '.join(MODULES)})")
    return c


def _read_header(path: str) -> dict[str, Any]:
    _, weights = adapter_files(path)
    try:
        with open(weights, "rb") as f:
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < n <= MAX_HEADER_BYTES:
                raise _refuse(path, "adapter_model.safetensors is not a safetensors file")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(path, f"cannot read adapter_model.safetensors ({e})") from None
    if not isinstance(header, dict):
        raise _refuse(path, "adapter_model.safetensors has no tensor header")
    return header


def adapter_bytes(dims: ProjectionDims, rank: int, bytes_per_element: int, align: int = 1) -> int:
    """Bytes of one resident adapter at its largest, as the engine holds it: rank `rank`
    on all seven projections of every layer, fused like the model's linears
    (pdserve/engine/lora/checkpoint.py: q/k/v A stacked [3r, in] with B block-diagonal
    [q + 2kv, 3r]; gate/up likewise; plus each rank column's scale). `align`: each fused
    rank padded to a multiple of it (a bf16 step's stacked copy, pdserve/engine/lora/batch.py)."""
    h, q, kv, i = dims.hidden, dims.q_size, dims.kv_size, dims.intermediate

    def padded(r: int) -> int:
        return -(-r // align) * align

    r3, r1, r2 = padded(3 * rank), padded(rank), padded(2 * rank)
    per_layer = (r3 * h + (q + 2 * kv) * r3 + r3      # qkv
                 + r1 * q + h * r1 + r1               # o
                 + r2 * h + 2 * i * r2 + r2           # gate_up
                 + r1 * i + h * r1 + r1)              # down
    return dims.num_layers * per_layer * bytes_per_element
