"""Checkpoint loading: config parsing, sharded weights, and one-line errors for bad dirs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.loading.loader import CheckpointError, load_model
from pdserve.engine.loading.model_config import ModelConfig, RopeScaling


@pytest.fixture
def ckpt(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> Path:
    """A private copy of the tiny llama checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "ckpt"))


def load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_model(path, torch.float32, "cpu")
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_missing_directory(tmp_path: Path) -> None:
    msg = load_error(tmp_path / "nope")
    assert "does not exist" in msg and "nope" in msg


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    assert "config.json is missing" in load_error(ckpt)


def test_missing_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    msg = load_error(ckpt)
    assert "no weights" in msg and "model.safetensors" in msg


def test_unsupported_architecture(ckpt: Path) -> None:
    # A real GPT-2 config: none of the Llama field names are present.
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2}
    (ckpt / "config.json").write_text(json.dumps(gpt2))
    msg = load_error(ckpt)
    assert "unsupported architecture 'GPT2LMHeadModel'" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_truncated_safetensors(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    msg = load_error(ckpt)
    assert "truncated or corrupt" in msg and "model.safetensors" in msg


def test_garbage_safetensors_header(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    assert "truncated or corrupt" in load_error(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, weights)
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight'" in load_error(ckpt)


def test_shape_mismatch(ckpt: Path) -> None:
    weights = ckpt / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, weights)
    msg = load_error(ckpt)
    assert "shape mismatch" in msg and "model.layers.0.self_attn.k_proj.weight" in msg
    assert "expected [32, 64]" in msg and "got [16, 64]" in msg


def test_invalid_config_json(ckpt: Path) -> None:
    (ckpt / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(ckpt)


def test_sharded_checkpoint_loads_same_weights(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    src = tiny_model_dir("qwen2")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    out = Path(shutil.copytree(src, tmp_path / "sharded"))
    (out / "model.safetensors").unlink()
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / fname)
        weight_map.update({k: fname for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _, single = load_model(src, torch.float32, "cpu")
    _, sharded = load_model(out, torch.float32, "cpu")
    for (name, a), (_, b) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    # A shard listed in the index but absent is named.
    (out / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in load_error(out)


def test_config_parsing_transformers5_rope_and_eos(tiny_model_dir: Callable[..., Path]) -> None:
    cfg = ModelConfig.from_hf_dir(tiny_model_dir("llama31"))
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 128)
    assert cfg.eos_token_ids == (2, 3)  # generation_config.json wins over config.json's 2
    q3 = ModelConfig.from_hf_dir(tiny_model_dir("qwen3"))
    assert (q3.head_dim, q3.qk_norm, q3.attention_bias) == (32, True, False)
    q2 = ModelConfig.from_hf_dir(tiny_model_dir("qwen2"))
    assert (q2.attention_bias, q2.o_proj_bias, q2.qk_norm) == (True, False, False)
    assert ModelConfig.from_hf_dir(tiny_model_dir("tied")).tie_word_embeddings


def test_config_parsing_legacy_rope_scaling_and_eos_fallback() -> None:
    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [7, 9],
    }
    cfg = ModelConfig.from_dict(legacy)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling.factor == 32.0
    assert cfg.num_kv_heads == 4 and cfg.head_dim == 16
    assert cfg.eos_token_ids == (7, 9)
    assert ModelConfig.from_dict(legacy, {"eos_token_id": 5}).eos_token_ids == (5,)
