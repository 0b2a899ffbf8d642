"""PEFT LoRA checkpoints (`adapter_config.json` + `adapter_model.safetensors`) read and
checked against the base model, all or nothing.

What is served: `r`, `lora_alpha`, `use_rslora` (scale alpha/sqrt(r), else alpha/r),
`rank_pattern` / `alpha_pattern` (per-module ranks and alphas, matched the way PEFT's
`get_pattern_key` matches them), `target_modules` among the seven decoder projections
(q/k/v/o/gate/up/down), any subset of layers. Refused with a `LoraError` saying why:
a missing file, a tensor of the wrong shape or one no projection of the model has, a
rank above `max_rank`, a target module the model lacks, DoRA, trained biases,
`modules_to_save`, a `fan_in_fan_out` layout. Nothing is returned unless all of it
passed, so a refused adapter leaves nothing behind.

The per-module tensors are then fused the way the model fuses its projections
(`pdserve.engine.models.llama`: q/k/v into one matmul, gate/up into one): per layer and fused
linear, A stacked along the rank ([r_q + r_k + r_v, in]) and B block-diagonal
([out, r_q + r_k + r_v]), with a per-output-column scale, so one low-rank product
serves the fused output exactly as the separate PEFT layers would (the zero blocks add
exact zeros).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.common.lora import LoraError, adapter_files
from pdserve.engine.loading.model_config import ModelConfig

# PEFT module name -> (fused linear of pdserve.engine.models.llama, attention or mlp block)
MODULES: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv", "self_attn"), "k_proj": ("qkv", "self_attn"), "v_proj": ("qkv", "self_attn"),
    "o_proj": ("o", "self_attn"), "gate_proj": ("gate_up", "mlp"), "up_proj": ("gate_up", "mlp"),
    "down_proj": ("down", "mlp"),
}
GROUPS = ("qkv", "o", "gate_up", "down")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class FusedDelta:
    """The low-rank update of one fused linear: out += (x @ a.T @ b.T) * scale."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], block-diagonal over the fused projections
    scale: torch.Tensor  # [out], each projection's alpha / r (or / sqrt(r)); 0 where untargeted

    def to(self, dtype: torch.dtype, device: torch.device) -> FusedDelta:
        return FusedDelta(self.a.to(device, dtype), self.b.to(device, dtype),
                          self.scale.to(device, dtype))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.scale))


@dataclass(frozen=True)
class LoraWeights:
    """A checked adapter: `layers[i][group]` is layer i's update of that fused linear
    (absent where the adapter leaves it alone)."""

    fingerprint: str
    max_rank: int
    target_modules: tuple[str, ...]
    layers: tuple[dict[str, FusedDelta], ...]

    def to(self, dtype: torch.dtype, device: torch.device) -> LoraWeights:
        layers = tuple({g: d.to(dtype, device) for g, d in layer.items()} for layer in self.layers)
        return LoraWeights(self.fingerprint, self.max_rank, self.target_modules, layers)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for layer in self.layers for d in layer.values())


def _out_slices(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """PEFT module -> (offset in its fused output, out features, in features)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return {"q_proj": (0, q, h), "k_proj": (q, kv, h), "v_proj": (q + kv, kv, h),
            "o_proj": (0, h, q), "gate_proj": (0, inter, h), "up_proj": (inter, inter, h),
            "down_proj": (0, h, inter)}


def _group_out(cfg: ModelConfig) -> dict[str, int]:
    h = cfg.hidden_size
    return {"qkv": cfg.q_size + 2 * cfg.kv_size, "o": h, "gate_up": 2 * cfg.intermediate_size,
            "down": h}


def _pattern(patterns: dict[str, Any], module_key: str, default: Any) -> Any:
    for key in patterns:  # PEFT's get_pattern_key
        if re.match(rf"(.*\.)?({key})$", module_key):
            return patterns[key]
    return default


def read_config(path: str) -> dict[str, Any]:
    config_file, _ = adapter_files(path)
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"LoRA adapter {path!r}: adapter_config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoraError(f"LoRA adapter {path!r}: adapter_config.json is not a JSON object")
    _check_config(path, config)
    return config


def _check_config(path: str, c: dict[str, Any]) -> None:
    def refuse(why: str) -> LoraError:
        return LoraError(f"LoRA adapter {path!r}: {why}")

    if str(c.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {c.get('peft_type')!r} is not LORA")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out weights")):
        if c.get(flag):
            raise refuse(f"{why} is not supported")
    if c.get("bias", "none") != "none":
        raise refuse(f"trained biases (bias={c.get('bias')!r}) are not supported")
    if c.get("modules_to_save"):
        raise refuse(f"modules_to_save {c['modules_to_save']!r} is not supported")
    if not isinstance(c.get("r"), int) or c["r"] < 1:
        raise refuse(f"r must be a positive integer, got {c.get('r')!r}")
    targets = c.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise refuse(f"target modules {unknown} are not among the model's projections "
                         f"({', '.join(MODULES)})")


def load_lora(path: str, fingerprint: str, cfg: ModelConfig, max_rank: int) -> LoraWeights:
    """Read, check and fuse the PEFT adapter at `path` for a model of `cfg` (float32, on
    the CPU); LoraError on anything it cannot serve exactly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_config(path)
    _, weights_file = adapter_files(path)
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {path!r}: cannot read adapter_model.safetensors ({e})") from None
    pairs = _pairs(path, tensors, cfg)
    if not pairs:
        raise LoraError(f"LoRA adapter {path!r} holds no LoRA weights of the model's projections")
    slices = _out_slices(cfg)
    alpha = float(config.get("lora_alpha", 8))
    layers: list[dict[str, FusedDelta]] = []
    top = 0
    for i in range(cfg.num_layers):
        per_group: dict[str, list[tuple[str, torch.Tensor, torch.Tensor, float]]] = {}
        for module, (group, block) in MODULES.items():
            if (i, module) not in pairs:
                continue
            a, b = pairs[(i, module)]
            key = f"model.layers.{i}.{block}.{module}"
            rank = int(_pattern(config.get("rank_pattern") or {}, key, config["r"]))
            off, out, inp = slices[module]
            if a.shape != (rank, inp) or b.shape != (out, rank):
                raise LoraError(f"LoRA adapter {path!r}: {key} has lora_A {tuple(a.shape)} and "
                                f"lora_B {tuple(b.shape)}; the model needs ({rank}, {inp}) and ({out}, {rank})")
            if rank > max_rank:
                raise LoraError(f"LoRA adapter {path!r}: rank {rank} of {key} is above "
                                f"--max-lora-rank {max_rank}")
            top = max(top, rank)
            a_ = float(_pattern(config.get("alpha_pattern") or {}, key, alpha))
            scale = a_ / math.sqrt(rank) if config.get("use_rslora") else a_ / rank
            per_group.setdefault(group, []).append((module, a.float(), b.float(), scale))
        layers.append({g: _fuse(parts, slices, _group_out(cfg)[g]) for g, parts in per_group.items()})
    targets = tuple(sorted({m for (_, m) in pairs}, key=list(MODULES).index))
    return LoraWeights(fingerprint, top, targets, tuple(layers))


def _pairs(path: str, tensors: dict[str, torch.Tensor], cfg: ModelConfig
           ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.match(name)
        if m is None:
            raise LoraError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA weight of a "
                            f"decoder projection this model has")
        layer, block, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in MODULES or MODULES[module][1] != block:
            raise LoraError(f"LoRA adapter {path!r}: target module {block}.{module} is not one of "
                            f"the model's projections ({', '.join(MODULES)})")
        if layer >= cfg.num_layers:
            raise LoraError(f"LoRA adapter {path!r}: layer {layer} is beyond the model's "
                            f"{cfg.num_layers} layers")
        if t.dtype not in _FLOAT_DTYPES:
            raise LoraError(f"LoRA adapter {path!r}: tensor {name!r} has dtype {t.dtype}")
        found.setdefault((layer, module), {})[ab] = t
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {path!r}: layer {layer} {module} has lora_A or lora_B only")
    return {k: (v["A"], v["B"]) for k, v in found.items()}


def _fuse(parts: list[tuple[str, torch.Tensor, torch.Tensor, float]],
          slices: dict[str, tuple[int, int, int]], out: int) -> FusedDelta:
    rank = sum(a.shape[0] for _, a, _, _ in parts)
    a_all = torch.cat([a for _, a, _, _ in parts], dim=0)
    b_all = torch.zeros(out, rank, dtype=torch.float32)
    scale = torch.zeros(out, dtype=torch.float32)
    at = 0
    for module, a, b, s in parts:
        off, n, _ = slices[module]
        r = a.shape[0]
        b_all[off:off + n, at:at + r] = b
        scale[off:off + n] = s
        at += r
    return FusedDelta(a_all.contiguous(), b_all, scale)
