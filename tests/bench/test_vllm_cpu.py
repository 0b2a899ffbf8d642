"""bench/vllm_cpu.py and kv_tiers' vLLM arm: vLLM's KV pool is sized in bytes from
the model's config.json so that it holds as many tokens as a pdserve worker's pool,
its log's figure is read back, and the legacy size variable never reaches it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import kv_tiers, vllm_cpu
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.loadgen.launch import child_env

# bench/models.py's 125m shape: 12 layers, 4 KV heads, head_dim 768 / 12 = 64.
SHAPE_125M = {"architectures": ["LlamaForCausalLM"], "vocab_size": 2048, "hidden_size": 768,
              "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def config(tmp_path: Path, **fields: object) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE_125M, **fields}))
    return vllm_cpu.model_config(tmp_path)


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer_and_kv_head(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert vllm_cpu.kv_bytes_per_token(cfg, "bfloat16") == 2 * 12 * 4 * 64 * 2 == 12_288
    assert vllm_cpu.kv_bytes_per_token(cfg, "float32") == 24_576
    # an explicit head_dim wins over hidden / heads, and query heads never count
    wide = config(tmp_path, head_dim=128, num_attention_heads=16, hidden_size=1024, num_key_value_heads=2)
    assert vllm_cpu.kv_bytes_per_token(wide, "bfloat16") == 2 * 12 * 2 * 128 * 2


def test_the_vllm_pool_holds_the_pdserve_pools_tokens(tmp_path: Path) -> None:
    sizing = vllm_cpu.kv_sizing(config(tmp_path), "bfloat16", num_blocks=76, block_size=16)
    assert sizing == vllm_cpu.KVSizing(bytes_per_token=12_288, tokens=1216, memory_bytes=1216 * 12_288)
    assert sizing.expected_tokens(128) == 1152  # vLLM keeps whole blocks of its own size
    assert sizing.expected_tokens(16) == 1216
    assert sizing.longest_request(128) == 1024  # less vLLM's null block


def test_the_kv_size_is_read_from_vllms_log() -> None:
    log = ("INFO 12-04 21:50:01 [gpu_model_runner.py:100] Model loading took 0.3 GiB\n"
           "(EngineCore pid=77) INFO 12-04 21:50:09 [kv_cache_utils.py:2328] CPU KV cache size: 16,384 tokens, "
           "Maximum concurrency for 2,048 tokens per request: 8.00x\n")
    assert vllm_cpu.reported_kv_tokens(log) == 16_384
    assert vllm_cpu.reported_kv_tokens("INFO no such line\n") is None


def test_the_legacy_kv_space_variable_is_not_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_cpu.KV_SPACE_ENV, "2")
    env = child_env({"VLLM_CPU_OMP_THREADS_BIND": "0,1"}, unset=(vllm_cpu.KV_SPACE_ENV,))
    assert vllm_cpu.KV_SPACE_ENV not in env and env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert child_env({})[vllm_cpu.KV_SPACE_ENV] == "2"  # only when asked


def test_vllm_runs_by_default_when_its_interpreter_exists_and_only_at_bf16(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    cfg = config(tmp_path)

    def skipped(*flags: str) -> str | None:
        return kv_tiers.vllm_skipped(kv_tiers.parse_args(["--vllm-python", str(python), *flags]), cfg)

    assert skipped("--dtype", "bfloat16") is None
    assert skipped("--dtype", "bfloat16", "--no-vllm") == "--no-vllm"
    assert "float32" in (skipped() or "")  # the bench's default dtype
    python.unlink()
    assert "no " in (skipped("--dtype", "bfloat16") or "")
    assert "head_dim 16" in (vllm_cpu.unsupported(config(tmp_path, hidden_size=192)) or "")


def test_the_returning_turns_and_the_working_set_of_a_pass() -> None:
    def reply(ttft_s: float, prompt_tokens: int) -> kv_tiers.Reply:
        return kv_tiers.Reply(ttft_s, "x", prompt_tokens, 0, 0.0, completion_tokens=8)

    turns = kv_tiers.Multiturn(["a", "b", "a x c", "b x d"], [reply(1.0, 100), reply(2.0, 110),
                                                            reply(0.3, 150), reply(0.4, 160)], conversations=2)
    assert turns.returning_ttft_s == [0.3, 0.4]
    assert turns.working_set_tokens == 150 + 8 + 160 + 8
    assert turns.longest_prompt == 160
