"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Both are the Llama-family decoder (Mixtral's attention is Mistral's, Qwen3-MoE's
is Qwen3's, see `ModelConfig`) with the MLP of the sparse layers replaced by
top-k routed experts: a router scores every expert per token (softmax in
float32), the `top_k` best are kept, their probabilities renormalised to sum 1
where the family does so (`MoEConfig.renormalize`), and the token's output is
the weighted sum of those experts' SwiGLU MLPs. Neither family has shared experts.

Each expert's gate and up projections are fused into one matmul, like the dense
MLP; an expert runs once per step over exactly the tokens routed to it, in
expert order (the order HF sums them in).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM, WeightSpec, _param
from engine.moe_config import MoEConfig


class SparseMoE(nn.Module):
    """Router + experts of one layer."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu)")
        hd, inter = cfg.hidden_size, moe.expert_intermediate_size
        self.moe = moe
        self.inter = inter
        self.router_weight = _param(moe.num_experts, hd, dtype=dtype, device=device)
        self.gate_up = nn.ParameterList(_param(2 * inter, hd, dtype=dtype, device=device)
                                        for _ in range(moe.num_experts))
        self.down = nn.ParameterList(_param(hd, inter, dtype=dtype, device=device)
                                     for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for tokens x [T, hidden]."""
        probs = torch.softmax(F.linear(x, self.router_weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.float32_weights else weights.to(x.dtype)), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        # Only experts some token picked run; `unique` is sorted, so the sum is in expert order.
        for e in torch.unique(experts).tolist():
            token, slot = torch.where(experts == e)
            gate, up = F.linear(x[token], self.gate_up[e]).split([self.inter, self.inter], dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[e]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers route to experts (`cfg.moe`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
    ) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} has no experts; use LlamaForCausalLM")
        super().__init__(cfg, dtype, device, max_positions=max_positions)
        self.moe = cfg.moe
        for i in self.moe.sparse_layers:
            # The dense MLP built by the base class is never filled (torch.empty): replace it.
            self.layers[i].mlp = SparseMoE(cfg, self.moe, dtype, device)

    def linear_weights(self) -> list[str]:
        """The decoder linears weight quantization applies to: experts are not among them
        (they are served in the compute dtype)."""
        sparse = tuple(f"layers.{i}.mlp." for i in self.moe.sparse_layers)
        return [n for n in super().linear_weights() if not n.startswith(sparse)]

    def weight_specs(self) -> list[WeightSpec]:
        sparse = tuple(f"layers.{i}.mlp." for i in self.moe.sparse_layers)
        specs = [s for s in super().weight_specs() if not s.param.startswith(sparse)]
        for i in self.moe.sparse_layers:
            specs += expert_specs(self.cfg, self.moe, i)
        return specs


def expert_specs(cfg: ModelConfig, moe: MoEConfig, layer: int) -> list[WeightSpec]:
    """Checkpoint tensors of layer `layer`'s router and experts, in the family's names."""
    hd, inter = cfg.hidden_size, moe.expert_intermediate_size
    lp = f"layers.{layer}.mlp."
    if moe.naming == "mixtral":
        block = f"model.layers.{layer}.block_sparse_moe."
        gate, up, down = "w1", "w3", "w2"
    else:
        block = f"model.layers.{layer}.mlp."
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    specs = [WeightSpec(lp + "router_weight", ((block + "gate.weight", (moe.num_experts, hd)),))]
    for e in range(moe.num_experts):
        x = f"{block}experts.{e}."
        specs.append(WeightSpec(f"{lp}gate_up.{e}", ((x + gate + ".weight", (inter, hd)),
                                                      (x + up + ".weight", (inter, hd)))))
        specs.append(WeightSpec(f"{lp}down.{e}", ((x + down + ".weight", (hd, inter)),)))
    return specs
