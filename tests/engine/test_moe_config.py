"""MoE facts parsed from config.json: which layers route, the renormalisation rule, and
bad fields refused in one line naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError

BASE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4, "intermediate_size": 96,
                        "vocab_size": 128}


def _cfg(arch: str, **extra: Any) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": [arch], **BASE, **extra})


def test_mixtral_routes_every_layer_and_renormalises() -> None:
    cfg = _cfg("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2, attention_bias=True)
    assert cfg.moe is not None
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_intermediate_size) == (8, 2, 96)
    assert cfg.moe.sparse_layers == tuple(range(6)) and cfg.moe.renormalize and cfg.moe.naming == "mixtral"
    assert not cfg.attention_bias and not cfg.qk_norm  # Mistral's attention


def test_qwen3_moe_sparse_step_dense_layers_and_norm_topk_prob() -> None:
    cfg = _cfg("Qwen3MoeForCausalLM", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
               decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    assert cfg.moe is not None and cfg.qk_norm  # Qwen3's attention
    assert cfg.moe.sparse_layers == (1, 5) and cfg.moe.renormalize and cfg.moe.expert_intermediate_size == 24
    plain = _cfg("Qwen3MoeForCausalLM", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24)
    assert plain.moe is not None and plain.moe.sparse_layers == tuple(range(6)) and not plain.moe.renormalize
    assert _cfg("Qwen3ForCausalLM").moe is None


@pytest.mark.parametrize(("arch", "extra", "message"), [
    ("MixtralForCausalLM", {"num_experts_per_tok": 2}, "positive integer experts, got None"),
    ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 0}, "num_experts_per_tok, got 0"),
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}, "expert size, got None"),
    ("Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8},
     "num_experts_per_tok 5 exceeds the 4 experts"),
])
def test_bad_moe_fields_are_one_line_errors(arch: str, extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message) as e:
        _cfg(arch, **extra)
    assert "\n" not in str(e.value)
