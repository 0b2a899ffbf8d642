"""One plain-torch model for the Llama family: Llama 2/3/3.1, Mistral, Qwen2, Qwen3.

Differences between the families are config flags (`ModelConfig`): q/k/v bias
(Qwen2), per-head q/k RMSNorm (Qwen3), llama3 rope scaling, tied embeddings.
q/k/v and gate/up projections are fused into one matmul each; `weight_specs()`
tells the loader which checkpoint tensors make up each fused parameter.

The forward takes the flattened new tokens of every sequence in the step, so each
linear layer is one matmul over the whole batch; attention goes through an
`AttentionBackend` over the paged KV pool.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.attention.paged import AttentionBackend, AttentionMetadata
from pdserve.engine.kernels.fused_ops import add_rms_norm, rope_qk, silu_mul
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.models.rope import RopeTables, apply_rope
from pdserve.engine.quant.linear import linear
from pdserve.engine.runner.kv_quant import KVCacheView

if TYPE_CHECKING:
    from pdserve.engine.lora.batch import LoraBatch, LoraLayer

# Decoder linears by parameter name: what weight quantization replaces (pdserve/engine/quant).
LINEAR_WEIGHTS = ("self_attn.qkv_weight", "self_attn.o_weight", "mlp.gate_up_weight", "mlp.down_weight")


@dataclass(frozen=True)
class WeightSpec:
    """One model parameter built from checkpoint tensors concatenated along dim 0."""

    param: str
    sources: tuple[tuple[str, tuple[int, ...]], ...]  # (checkpoint name, expected shape)


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Weights are filled by the loader; no random init (it would be wasted work).
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, self(h + delta)): the residual add fused with this norm (bf16 on
        CPU: one native pass, `h` updated in place; otherwise the ops above)."""
        return add_rms_norm(h, delta, self.weight, self.eps, self)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        qkv_out = cfg.q_size + 2 * cfg.kv_size
        self.qkv_weight = _param(qkv_out, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dtype, device=device) if cfg.attention_bias else None
        self.o_weight = _param(cfg.hidden_size, cfg.q_size, dtype=dtype, device=device)
        self.o_bias = (
            _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.o_proj_bias else None
        )
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: KVCacheView,
        v_cache: KVCacheView,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        lora: LoraLayer | None = None,
    ) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        if lora is not None:
            qkv = lora.apply("qkv", x, qkv)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = apply_rope(self.q_norm(q.reshape(t, c.num_heads, c.head_dim)), cos, sin)
            k = apply_rope(self.k_norm(k.reshape(t, c.num_kv_heads, c.head_dim)), cos, sin)
        else:
            # Rotate q and k heads in one pass over the [T, H + KVH, D] view.
            qk = rope_qk(qkv, c.num_heads, c.num_kv_heads, c.head_dim, cos, sin)
            if qk is None:
                rotated = apply_rope(qkv[:, : c.q_size + c.kv_size].reshape(t, -1, c.head_dim), cos, sin)
                qk = rotated.split([c.num_heads, c.num_kv_heads], dim=1)
            q, k = qk
            v = qkv[:, c.q_size + c.kv_size :]
        v = v.reshape(t, c.num_kv_heads, c.head_dim)
        out = backend.forward(q, k, v, k_cache, v_cache, meta)
        if lora is None:
            return linear(out, self.o_weight, self.o_bias)
        return lora.apply("o", out, linear(out, self.o_weight, self.o_bias))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu)")
        inter = cfg.intermediate_size
        self.inter = inter
        self.gate_up_weight = _param(2 * inter, cfg.hidden_size, dtype=dtype, device=device)
        self.gate_up_bias = _param(2 * inter, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.down_weight = _param(cfg.hidden_size, inter, dtype=dtype, device=device)
        self.down_bias = (
            _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.mlp_bias else None
        )

    def forward(self, x: torch.Tensor, lora: LoraLayer | None = None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias)
        if lora is not None:
            gate_up = lora.apply("gate_up", x, gate_up)
        act = silu_mul(gate_up, self.inter)
        down = linear(act, self.down_weight, self.down_bias)
        return down if lora is None else lora.apply("down", act, down)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)


class LlamaForCausalLM(nn.Module):
    """Llama-family decoder over a paged KV pool."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        )
        # An int8 LM head (`pdserve.engine.loading.loader.quantize_lm_head`); None: the float head above.
        self.lm_head_q: nn.Module | None = None
        # Tensor parallel (`pdserve.engine.parallel`) sums the row-parallel o_proj and down_proj
        # partial outputs across ranks here: one all-reduce per attention and MLP block.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = _no_reduce
        self.rope = RopeTables(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            max_positions or cfg.max_position_embeddings,
            dtype,
            device,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layers: Sequence[tuple[KVCacheView, KVCacheView]],
        backend: AttentionBackend,
        layer_hook: Callable[[int], None] | None = None,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], for flat tokens [T].

        `kv_layers[i]` is layer i's (K, V) pool view; `layer_hook(i)` runs once
        layer i's K/V for every token of the step is in the pool. `lora`: the rows
        that run under LoRA adapters (pdserve.engine.lora); None: every row is the base model.
        """
        h = F.embedding(input_ids, self.embed_tokens)
        return self.run_layers(h, positions, meta, kv_layers, backend, layer_hook, final_norm=True,
                               lora=lora)

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_layers: Sequence[tuple[KVCacheView, KVCacheView]],
        backend: AttentionBackend,
        layer_hook: Callable[[int], None] | None = None,
        first_layer: int = 0,
        final_norm: bool = False,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """The decoder layers over the residual stream `h`: the final norm's output with
        `final_norm`, else the residual stream after the last layer (a pipeline stage,
        `pdserve.engine.parallel`, runs its layers, numbered from `first_layer`, alone)."""
        cos, sin = self.rope.lookup(positions)
        layers = [cast(DecoderLayer, m) for m in self.layers]
        # Each residual add is fused with the norm that follows it (the next layer's
        # input norm, or the final one): the same ops, fewer passes in bf16.
        norms = [*(layer.input_layernorm for layer in layers[1:]), self.norm]
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            k_cache, v_cache = kv_layers[i]
            ll = lora.layer(first_layer + i) if lora is not None else None
            attn_out = self.reduce(layer.self_attn(x, cos, sin, k_cache, v_cache, meta, backend, ll))
            if layer_hook is not None:
                layer_hook(first_layer + i)
            h, x = layer.post_attention_layernorm.add_forward(h, attn_out)
            mlp_out = layer.mlp(x) if ll is None else layer.mlp(x, ll)
            h, x = norms[i].add_forward(h, self.reduce(mlp_out))
        return x if final_norm else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_q is not None:
            return self.lm_head_q(hidden)  # bf16 decode rows: the int8 kernel's GEMV
        weight = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, weight, None)  # decode rows in bf16: the native GEMV too

    def linear_weights(self) -> list[str]:
        """Parameter names of the decoder linears; embeddings and the LM head are not among them."""
        return [f"layers.{i}.{n}" for i in range(self.cfg.num_layers) for n in LINEAR_WEIGHTS]

    def weight_specs(self) -> list[WeightSpec]:
        """How each parameter is assembled from Hugging Face checkpoint tensor names."""
        c = self.cfg
        hd, inter = c.hidden_size, c.intermediate_size
        specs = [WeightSpec("embed_tokens", (("model.embed_tokens.weight", (c.vocab_size, hd)),))]
        for i in range(c.num_layers):
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            lp = f"layers.{i}."
            for norm in ("input_layernorm", "post_attention_layernorm"):
                specs.append(_spec(f"{lp}{norm}.weight", f"{p}{norm}.weight", (hd,)))
            qkv = ((a + "q_proj", c.q_size), (a + "k_proj", c.kv_size), (a + "v_proj", c.kv_size))
            specs.append(_fused(lp + "self_attn.qkv_weight", qkv, ".weight", hd))
            if c.attention_bias:
                specs.append(_fused(lp + "self_attn.qkv_bias", qkv, ".bias"))
            specs.append(_spec(lp + "self_attn.o_weight", a + "o_proj.weight", (hd, c.q_size)))
            if c.o_proj_bias:
                specs.append(_spec(lp + "self_attn.o_bias", a + "o_proj.bias", (hd,)))
            if c.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    specs.append(_spec(f"{lp}self_attn.{norm}.weight", f"{a}{norm}.weight", (c.head_dim,)))
            m = p + "mlp."
            gu = ((m + "gate_proj", inter), (m + "up_proj", inter))
            specs.append(_fused(lp + "mlp.gate_up_weight", gu, ".weight", hd))
            if c.mlp_bias:
                specs.append(_fused(lp + "mlp.gate_up_bias", gu, ".bias"))
                specs.append(_spec(lp + "mlp.down_bias", m + "down_proj.bias", (hd,)))
            specs.append(_spec(lp + "mlp.down_weight", m + "down_proj.weight", (hd, inter)))
        specs.append(_spec("norm.weight", "model.norm.weight", (hd,)))
        if not c.tie_word_embeddings:
            specs.append(_spec("lm_head", "lm_head.weight", (c.vocab_size, hd)))
        return specs


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def _spec(param: str, name: str, shape: tuple[int, ...]) -> WeightSpec:
    return WeightSpec(param, ((name, shape),))


def _fused(param: str, parts: tuple[tuple[str, int], ...], suffix: str, cols: int | None = None) -> WeightSpec:
    """`param` as the checkpoint's `parts` (module name, output rows) stacked: their
    `suffix` tensors, each [rows, cols] (a weight) or [rows] (a bias, no `cols`)."""
    return WeightSpec(param, tuple((n + suffix, (o,) if cols is None else (o, cols)) for n, o in parts))
