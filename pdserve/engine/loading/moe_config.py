"""Mixture-of-experts facts of a `config.json` (Mixtral, Qwen3-MoE), torch-free.

Parsed here so that the engine, `pdserve plan` and the checks in the CLI read
them one way. Neither family has shared experts (Qwen2-MoE's shared expert is
not carried over to Qwen3-MoE), so every routed layer is top-k experts only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts each token is routed to
    expert_intermediate_size: int
    # Top-k router probabilities divided by their sum (Mixtral always; Qwen3-MoE
    # when `norm_topk_prob`), else the raw softmax probabilities.
    renormalize: bool
    sparse_layers: tuple[int, ...]  # layers whose MLP is the routed experts; the rest are dense
    # Checkpoint names: "mixtral" (block_sparse_moe.gate, experts.E.w1/w3/w2) or
    # "qwen" (mlp.gate, experts.E.gate_proj/up_proj/down_proj).
    naming: str
    # Mixtral scales each expert's output by the float32 routing weight; Qwen3-MoE
    # casts the weights to the compute dtype first (as HF does; equal in float32).
    float32_weights: bool

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


class MoEConfigError(ValueError):
    """A MoE config.json field is missing or out of range."""


def parse_moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEConfig | None:
    """The MoE config of architecture `arch` (None for a dense one)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    mixtral = arch == "MixtralForCausalLM"
    # Hub Qwen3-MoE checkpoints say num_experts; transformers >= 5 writes num_local_experts.
    experts = cfg.get("num_local_experts") if mixtral else cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    inter = cfg.get("intermediate_size" if mixtral else "moe_intermediate_size")
    for key, value in (("experts", experts), ("num_experts_per_tok", top_k), ("expert size", inter)):
        if not isinstance(value, int) or value < 1:
            raise MoEConfigError(f"{source}: {arch} needs a positive integer {key}, got {value!r}")
    assert isinstance(experts, int) and isinstance(top_k, int) and isinstance(inter, int)
    if top_k > experts:
        raise MoEConfigError(f"{source}: num_experts_per_tok {top_k} exceeds the {experts} experts")
    if mixtral:
        sparse = tuple(range(num_layers))
    else:
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=inter,
        renormalize=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        naming="mixtral" if mixtral else "qwen",
        float32_weights=mixtral,
    )
