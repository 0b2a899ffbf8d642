"""Tiny random-weight Hugging Face checkpoints for tests.

`make_tiny_model(out_dir, family)` builds a model from a `transformers` config,
seeded so the same family always gives the same weights, and saves it in the
Hugging Face layout (`config.json`, `model.safetensors`, `generation_config.json`)
exactly as a real checkpoint would be laid out.

Norm weights and biases are randomised after HF's init (which sets them to 1 and
0): otherwise a model that ignored them would still match the reference. The
init scale is raised so logits are decisive and greedy argmax is not decided by
float noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "llama31", "mistral", "qwen2", "qwen3", "tied", "mqa", "mixtral", "qwen3_moe")

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 384,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# family -> (transformers config class name, overrides, generation_config eos ids)
_FAMILY_SPECS: dict[str, tuple[str, dict[str, Any], int | list[int]]] = {
    "llama": ("LlamaConfig", {"rope_theta": 10000.0}, 2),
    "llama31": (
        "LlamaConfig",
        {
            "vocab_size": 320,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
        [2, 3],
    ),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}, 2),
    "qwen2": ("Qwen2Config", {"vocab_size": 352, "rope_theta": 1000000.0}, [2, 5]),
    # Explicit head_dim (32) differs from hidden/heads (16), as in real Qwen3.
    "qwen3": ("Qwen3Config", {"head_dim": 32, "rope_theta": 1000000.0}, [2, 3]),
    "tied": ("LlamaConfig", {"tie_word_embeddings": True, "vocab_size": 256}, 2),
    "mqa": ("LlamaConfig", {"num_key_value_heads": 1, "num_attention_heads": 4}, 2),
    # Mixtral: every layer routed, top-2 of 4, renormalised.
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
                                  "sliding_window": None, "rope_theta": 1000000.0}, 2),
    # Qwen3-MoE: top-2 of 8 without renormalisation (norm_topk_prob false), layer 1 dense.
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": False, "mlp_only_layers": [1], "head_dim": 32,
                                     "rope_theta": 1000000.0}, [2, 3]),
}


def make_hf_config(family: str = "llama", **overrides: Any) -> Any:
    """The `transformers` config object for `family`, with `overrides` applied last."""
    import transformers

    if family not in _FAMILY_SPECS:
        raise ValueError(f"unknown tiny model family {family!r}; known: {', '.join(FAMILIES)}")
    cls_name, fam_overrides, _ = _FAMILY_SPECS[family]
    kwargs = {**_BASE, **fam_overrides, **overrides}
    if "rope_theta" in kwargs or "rope_scaling" in kwargs:
        # transformers >= 5 folds theta and scaling into rope_parameters.
        rope = dict(kwargs.pop("rope_scaling", None) or {"rope_type": "default"})
        rope["rope_theta"] = kwargs.pop("rope_theta", 10000.0)
        kwargs["rope_parameters"] = rope
    return getattr(transformers, cls_name)(**kwargs)


def _randomise_norms_and_biases(model: Any, scale: float) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + scale * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(scale * torch.randn_like(p))


def make_hf_model(family: str = "llama", seed: int = 0, **overrides: Any) -> Any:
    """A float32 random-weight `AutoModelForCausalLM` for `family`, deterministic in `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_hf_config(family, **overrides)
    # Distinct weights per family even where the configs coincide in shape.
    torch.manual_seed(seed * 1000 + FAMILIES.index(family))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_norms_and_biases(model, scale=0.2)
    _sharpen_routers(model, factor=ROUTER_SCALE)
    return model.eval()


# MoE routers (`*.gate.weight`, [experts, hidden]) are scaled up so each token's top-k
# experts win by a margin: with the plain init, router scores of a random model sit
# close together and a bf16 rounding (fused vs unfused norms) can swap an expert,
# which moves the logits by far more than a rounding would.
ROUTER_SCALE = 4.0


def _sharpen_routers(model: Any, factor: float) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight"):
                p.mul_(factor)


def make_tiny_model(out_dir: Path, family: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny checkpoint for `family` into `out_dir` (created) and return `out_dir`.

    `overrides` go to the `transformers` config (e.g. `hidden_size=768`).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = make_hf_model(family, seed=seed, **overrides)
    model.save_pretrained(out_dir, safe_serialization=True)
    eos = _FAMILY_SPECS[family][2]
    gen = {"bos_token_id": model.config.bos_token_id, "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir


def copy_with_one_weight_changed(src: Path, dst: Path, tensor: str | None = None) -> Path:
    """Copy checkpoint `src` to `dst` with exactly one value of one tensor changed.

    The safetensors header and every other byte stay as they are, so the two
    checkpoints differ in that one weight only (a one-value "fine-tune"). `tensor`:
    the tensor to change (default: the first in the header); float32 or float16.
    """
    import shutil
    import struct

    import numpy as np

    shutil.copytree(src, dst)
    path = Path(dst) / "model.safetensors"
    with open(path, "r+b") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        name = tensor or next(k for k in header if k != "__metadata__")
        dtype = {"F32": np.float32, "F16": np.float16}[header[name]["dtype"]]
        offset = 8 + header_len + header[name]["data_offsets"][0]
        f.seek(offset)
        old = np.frombuffer(f.read(np.dtype(dtype).itemsize), dtype=dtype)[0]
        f.seek(offset)
        f.write(np.array([old + dtype(0.5)], dtype=dtype).tobytes())
    return Path(dst)
