"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Both are the Llama-family decoder (Mixtral's attention is Mistral's, Qwen3-MoE's
is Qwen3's, see `ModelConfig`) with the MLP of the sparse layers replaced by
top-k routed experts: a router scores every expert per token (softmax in
float32), the `top_k` best are kept, their probabilities renormalised to sum 1
where the family does so (`MoEConfig.renormalize`), and the token's output is
the weighted sum of those experts' SwiGLU MLPs. Neither family has shared experts.

Each expert's gate and up projections are fused into one matmul, like the dense
MLP; an expert runs once per step over exactly the tokens routed to it, in
expert order (the order HF sums them in). Weight quantization (`--quantization
int8|int4`, AWQ/GPTQ checkpoints) replaces every expert's two linears like the
dense ones (`linear_weights`), so each expert's small-M matmul runs the quantized
kernel; the router stays in the compute dtype (tiny, and a rounding must not flip
a token's experts).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.engine.kernels.fused_ops import silu_mul
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.loading.moe_config import MoEConfig
from pdserve.engine.models.llama import LlamaForCausalLM, WeightSpec, _param
from pdserve.engine.quant.linear import linear

# An expert's linears by parameter name (under `layers.{i}.mlp.experts.{e}.`).
EXPERT_LINEARS = ("gate_up_weight", "down_weight")


class Expert(nn.Module):
    """One expert's SwiGLU MLP; each weight a float parameter or a quantized layer."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.inter = inter
        self.gate_up_weight = _param(2 * inter, hidden, dtype=dtype, device=device)
        self.down_weight = _param(hidden, inter, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(silu_mul(linear(x, self.gate_up_weight, None), self.inter), self.down_weight, None)


class SparseMoE(nn.Module):
    """Router + experts of one layer."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu)")
        hd, inter = cfg.hidden_size, moe.expert_intermediate_size
        self.moe = moe
        self.router_weight = _param(moe.num_experts, hd, dtype=dtype, device=device)
        self.experts = nn.ModuleList(Expert(hd, inter, dtype, device) for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for tokens x [T, hidden]."""
        probs = torch.softmax(linear(x, self.router_weight, None).float(), dim=-1)
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
            y = self.experts[e](x[token]) * weights[token, slot, None]
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
        """The decoder linears weight quantization applies to: attention, the dense layers'
        MLPs and every expert's two linears (the routers are not among them)."""
        sparse = tuple(f"layers.{i}.mlp." for i in self.moe.sparse_layers)
        dense = [n for n in super().linear_weights() if not n.startswith(sparse)]
        return dense + [f"layers.{i}.mlp.experts.{e}.{n}" for i in self.moe.sparse_layers
                        for e in range(self.moe.num_experts) for n in EXPERT_LINEARS]

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
        specs.append(WeightSpec(f"{lp}experts.{e}.gate_up_weight", ((x + gate + ".weight", (inter, hd)),
                                                                    (x + up + ".weight", (inter, hd)))))
        specs.append(WeightSpec(f"{lp}experts.{e}.down_weight", ((x + down + ".weight", (hd, inter)),)))
    return specs
