"""Model definitions; `MODEL_REGISTRY` maps HF architecture names to model classes."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM

# All four architectures share one implementation; differences are config flags.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM"]
