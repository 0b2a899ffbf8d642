"""Model definitions; `MODEL_REGISTRY` maps HF architecture names to model classes."""

from __future__ import annotations

from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.moe import MoEForCausalLM

# The dense architectures share one implementation, differences are config flags;
# the MoE ones add routed experts to it (`ModelConfig.moe`).
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM"]
