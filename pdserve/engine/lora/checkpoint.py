"""PEFT LoRA checkpoints loaded for the engine's fused projections, all or nothing.

`pdserve/common/lora_checkpoint.py` checks the adapter (config and tensor header, against the
model's projection sizes and `max_rank`) and says, per layer and projection, which
tensors to read and how to scale them; nothing is returned unless all of it passed,
so a refused adapter leaves nothing behind.

The per-module tensors are then fused the way the model fuses its projections
(`pdserve.engine.models.llama`: q/k/v into one matmul, gate/up into one): per layer and fused
linear, A stacked along the rank ([r_q + r_k + r_v, in]) and B block-diagonal
([out, r_q + r_k + r_v]), with each rank column's projection scale, so one low-rank
product serves the fused output as the separate PEFT layers would (the zero blocks add
exact zeros; the scale is applied to the rank-r intermediate, PEFT applies it to the
output: the same product, rounded once more or less in another place).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.lora import LoraError, adapter_files
from pdserve.common.lora_checkpoint import MODULES, ModulePlan, ProjectionDims, plan_adapter
from pdserve.engine.loading.model_config import ModelConfig

GROUPS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class FusedDelta:
    """The low-rank update of one fused linear: out += ((x @ a.T) * rank_scale) @ b.T."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank], block-diagonal over the fused projections
    rank_scale: torch.Tensor  # [rank], its projection's alpha / r (or alpha / sqrt(r))

    def to(self, dtype: torch.dtype, device: torch.device) -> FusedDelta:
        return FusedDelta(self.a.to(device, dtype), self.b.to(device, dtype),
                          self.rank_scale.to(device, dtype))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.rank_scale))


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


def projection_dims(cfg: ModelConfig) -> ProjectionDims:
    return ProjectionDims(cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size,
                          cfg.num_layers)


def load_lora(path: str, fingerprint: str, cfg: ModelConfig, max_rank: int) -> LoraWeights:
    """Read, check and fuse the PEFT adapter at `path` for a model of `cfg` (float32, on
    the CPU); LoraError on anything it cannot serve exactly."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    dims = projection_dims(cfg)
    plan = plan_adapter(path, max_rank, dims)
    _, weights_file = adapter_files(path)
    try:
        tensors = load_file(str(weights_file))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {path!r}: cannot read adapter_model.safetensors ({e})") from None
    per_layer: list[dict[str, list[tuple[ModulePlan, torch.Tensor, torch.Tensor]]]] = [
        {} for _ in range(cfg.num_layers)]
    for m in plan.modules:
        a, b = tensors[m.a_name].float(), tensors[m.b_name].float()
        per_layer[m.layer].setdefault(MODULES[m.module][0], []).append((m, a, b))
    layers = tuple({g: _fuse(parts, dims, dims.fused_out(g)) for g, parts in groups.items()}
                   for groups in per_layer)
    return LoraWeights(fingerprint, plan.max_rank, plan.target_modules, layers)


def _fuse(parts: list[tuple[ModulePlan, torch.Tensor, torch.Tensor]], dims: ProjectionDims,
          out: int) -> FusedDelta:
    rank = sum(m.rank for m, _, _ in parts)
    b_all = torch.zeros(out, rank, dtype=torch.float32)
    scale = torch.zeros(rank, dtype=torch.float32)
    at = 0
    for m, _, b in parts:
        off, n, _ = dims.module(m.module)
        b_all[off:off + n, at:at + m.rank] = b
        scale[at:at + m.rank] = m.scale
        at += m.rank
    a_all = torch.cat([a for _, a, _ in parts], dim=0).contiguous()
    return FusedDelta(a_all, b_all, scale)
