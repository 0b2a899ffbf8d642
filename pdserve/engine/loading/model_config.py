"""ModelConfig: the architecture facts the engine needs, parsed from a Hugging Face dir.

Reads `config.json` (both the transformers >= 5 `rope_parameters` form and the
older `rope_theta` + `rope_scaling` form) and, through `pdserve/common/generation_config.py` (the one
reader of that file), `generation_config.json` for eos ids.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.common.generation_config import (
    GenerationConfigError,
    parse_generation_config,
    read_generation_config,
    token_ids,
)
from pdserve.common.kv_layout import KVLayout, kv_dtype_for
from pdserve.engine.loading.moe_config import (
    MOE_ARCHITECTURES,
    MoEConfig,
    MoEConfigError,
    parse_moe,
)
from pdserve.engine.quant.formats import (
    PrequantConfig,
    QuantizationError,
    parse_quantization_config,
)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)


# Used when config.json has no "architectures" list.
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


class ModelConfigError(ValueError):
    """config.json is missing, unreadable, lacks a required field or names an unsupported model."""


@dataclass(frozen=True)
class RopeScaling:
    """Rope scaling parameters; only `llama3` and `default` (none) are implemented."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2, or attention_bias=True)
    o_proj_bias: bool = False  # bias on o_proj (only with attention_bias=True on Llama)
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    # Mistral-style sliding window. Not implemented as a window: the runner caps
    # max_model_len at it, where full attention and windowed attention agree.
    sliding_window: int | None = None
    # `quantization_config.quant_method` ("none": a float checkpoint); `prequant` is
    # how the loader reads its tensors (pdserve/engine/quant/formats.py).
    quantization: str = "none"
    prequant: PrequantConfig | None = None
    moe: MoEConfig | None = None  # routed experts (Mixtral, Qwen3-MoE); None: dense
    # sha256 of config.json bytes; stable identity for KV compatibility hashes.
    model_id: str = field(default="", compare=False)

    @property
    def position_limit(self) -> int:
        """The longest sequence this model serves: its positions, capped at the sliding
        window (attention here is full, which equals windowed within the window)."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path/config.json` (+ `generation_config.json` if present)."""
        d = Path(path)
        cfg_path = d / "config.json"
        if not d.is_dir():
            raise ModelConfigError(f"model directory {d} does not exist")
        if not cfg_path.is_file():
            raise ModelConfigError(f"{cfg_path} is missing")
        raw = cfg_path.read_bytes()
        try:
            cfg = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ModelConfigError(
                f"{cfg_path} is not valid JSON: {e.msg} at line {e.lineno}"
            ) from e
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"{cfg_path} must hold a JSON object")
        try:
            gen = read_generation_config(d, sampling=False)
        except GenerationConfigError as e:
            raise ModelConfigError(str(e)) from e
        model_id = hashlib.sha256(raw).hexdigest()[:16]
        return cls._build(cfg, gen.eos_token_ids, gen.bos_token_id, model_id, str(cfg_path))

    @classmethod
    def from_dict(
        cls,
        cfg: dict[str, Any],
        gen: dict[str, Any] | None = None,
        model_id: str = "",
        source: str = "config.json",
    ) -> ModelConfig:
        """Build from parsed config.json (and generation_config.json) dicts."""
        try:
            g = parse_generation_config(gen or {}, sampling=False)
        except GenerationConfigError as e:
            raise ModelConfigError(str(e)) from e
        return cls._build(cfg, g.eos_token_ids, g.bos_token_id, model_id, source)

    @classmethod
    def _build(
        cls, cfg: dict[str, Any], gen_eos: tuple[int, ...], gen_bos: int | None, model_id: str, source: str
    ) -> ModelConfig:
        archs = cfg.get("architectures") or []
        model_type = str(cfg.get("model_type", ""))
        arch = (
            str(archs[0]) if archs else _ARCH_BY_MODEL_TYPE.get(model_type, model_type or "<none>")
        )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"unsupported architecture {arch!r} in {source}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ModelConfigError(f"{source} lacks required field {key!r}")
            return cfg[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        theta, scaling = _parse_rope(cfg)
        is_qwen2 = model_type == "qwen2" or arch == "Qwen2ForCausalLM"
        # Mixtral's attention is Mistral's; Qwen3-MoE's is Qwen3's.
        is_mistral = model_type in ("mistral", "mixtral") or arch in ("MistralForCausalLM", "MixtralForCausalLM")
        is_qwen3 = model_type in ("qwen3", "qwen3_moe") or arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
        # Mistral never has attention biases; Llama and Qwen3 put attention_bias on
        # q/k/v/o alike; Qwen2 always has q/k/v bias and never o bias.
        attn_bias = bool(cfg.get("attention_bias", False)) and not is_mistral
        qkv_bias = attn_bias or is_qwen2
        o_bias = attn_bias and not is_qwen2
        window = cfg.get("sliding_window")
        if is_qwen2 and not cfg.get("use_sliding_window", False):
            window = None
        eos = gen_eos or _cfg_eos(cfg.get("eos_token_id"))
        bos = gen_bos if gen_bos is not None else cfg.get("bos_token_id")
        dtype = cfg.get("torch_dtype") or cfg.get("dtype")
        try:
            prequant = parse_quantization_config(cfg.get("quantization_config"))
        except QuantizationError as e:
            raise ModelConfigError(f"{source}: {e}") from None
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=is_qwen3,
            rope_scaling=scaling,
            eos_token_ids=eos,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            torch_dtype=str(dtype) if dtype else None,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            sliding_window=int(window) if window else None,
            quantization=prequant.method if prequant else "none",
            prequant=prequant,
            moe=_moe(cfg, arch, int(need("num_hidden_layers")), source),
            model_id=model_id,
        )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` (transformers >= 5) or `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    scaling_raw = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling_raw = params
    rope_type = "default"
    if isinstance(scaling_raw, dict):
        rope_type = str(scaling_raw.get("rope_type") or scaling_raw.get("type") or "default")
    theta_f = float(theta) if theta is not None else 10000.0
    if rope_type == "default" or not isinstance(scaling_raw, dict):
        return theta_f, None
    if rope_type != "llama3":
        raise ModelConfigError(f"unsupported rope scaling type {rope_type!r} (supported: llama3)")
    return theta_f, RopeScaling(
        rope_type="llama3",
        factor=float(scaling_raw["factor"]),
        low_freq_factor=float(scaling_raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling_raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            scaling_raw.get("original_max_position_embeddings", 8192)
        ),
    )


def _moe(cfg: dict[str, Any], arch: str, num_layers: int, source: str) -> MoEConfig | None:
    try:
        return parse_moe(cfg, arch, num_layers, source)
    except MoEConfigError as e:
        raise ModelConfigError(str(e)) from None


def _cfg_eos(value: Any) -> tuple[int, ...]:
    """config.json's eos ids, used when generation_config.json names none."""
    try:
        return token_ids(value)
    except GenerationConfigError as e:
        raise ModelConfigError(f"config.json: {e}") from None


def kv_layout(model_config: ModelConfig, block_size: int, dtype: str, weights: str,
              kv_cache_dtype: str = "auto", quantization: str | None = None,
              lm_head: str = "none", numerics: str = "") -> KVLayout:
    """The KV pool layout for this model run in `dtype` with weights fingerprint `weights`
    (`pdserve.engine.loading.loader.weights_fingerprint`) and weight `quantization` (the served scheme,
    `pdserve.engine.quant.formats.served_quantization`; None: the checkpoint's) and LM head
    quantization `lm_head` (`served_lm_head`); allocates nothing.
    The KV cache is kept in the compute dtype unless `kv_cache_dtype` names a quantized one."""
    scheme = model_config.quantization if quantization is None else quantization
    return KVLayout(
        model_id=model_config.model_id,
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=block_size,
        dtype=kv_dtype_for(kv_cache_dtype, dtype),
        weights=weights,
        compute_dtype=dtype,
        quantization=scheme,
        lm_head=lm_head,
        numerics=numerics,
    )
