"""`pdserve plan`: the design's capacity example, exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pdserve.cli import main
from pdserve.planner.capacity import PlanError, compute_plan, format_bytes, parse_size

GiB = 2**30
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "torch_dtype": "float16",
}


def _model(tmp_path: Path, name: str, **overrides: object) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA2_7B, **overrides}))
    return d


@pytest.fixture
def gqa_7b(tmp_path: Path) -> Path:
    """Llama-2-7B shape with 8 KV heads: the design's worked example."""
    return _model(tmp_path, "llama-7b-gqa", num_key_value_heads=8)


def test_design_example_figures(gqa_7b: Path) -> None:
    p = compute_plan(gqa_7b, parse_size("80GiB"), 8192, concurrency=32, dtype="float16")
    assert p.kv_bytes_per_token == 128 * 1024  # 2 x 32 x 8 x 128 x 2
    assert p.kv_bytes_per_request == 1 * GiB
    assert p.concurrency_kv_bytes == 32 * GiB
    # 5.93B parameters with GQA (K/V projections are 4x smaller than Llama-2-7B's).
    assert p.param_count == 5_933_109_248
    assert p.weight_bytes == 2 * 5_933_109_248
    assert p.overhead_bytes == 8 * GiB
    assert p.kv_budget_bytes == 72 * GiB - p.weight_bytes
    assert p.token_budget == p.kv_budget_bytes // (128 * 1024)
    assert p.max_concurrency == 60 and p.fits is True


def test_true_llama2_7b_weights_are_about_13_gib(tmp_path: Path) -> None:
    d = _model(tmp_path, "llama-2-7b")  # 32 KV heads (MHA)
    p = compute_plan(d, 80 * GiB, 8192, device="cuda")
    assert p.param_count == 6_738_415_616  # the published Llama-2-7b count
    assert p.dtype == "float16"  # auto on CUDA: from the config
    assert round(p.weight_bytes / GiB) == 13
    assert p.kv_bytes_per_token == 512 * 1024  # uses KV heads: here 32
    assert p.kv_bytes_per_request == 4 * GiB


def test_kv_uses_kv_heads_never_query_heads(tmp_path: Path) -> None:
    a = compute_plan(_model(tmp_path, "a", num_key_value_heads=8), 80 * GiB, 1024)
    b = compute_plan(_model(tmp_path, "b", num_key_value_heads=1), 80 * GiB, 1024)
    assert a.kv_bytes_per_token == 8 * b.kv_bytes_per_token


def test_does_not_fit_and_dtype_override(gqa_7b: Path) -> None:
    p = compute_plan(gqa_7b, 24 * GiB, 8192, concurrency=32, dtype="bf16")
    assert p.dtype == "bfloat16" and p.fits is False and p.max_concurrency == 10
    f32 = compute_plan(gqa_7b, 80 * GiB, 8192, dtype="float32")
    assert f32.kv_bytes_per_token == 256 * 1024
    tiny = compute_plan(gqa_7b, 8 * GiB, 8192)  # weights alone exceed the device
    assert tiny.kv_budget_bytes == 0 and tiny.max_concurrency == 0


def test_auto_dtype_resolves_as_the_workers_do(gqa_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`auto` (the default): on CPU bf16 with native bf16, else float32, whatever the
    float16 checkpoint says; on CUDA the checkpoint's float16. Bytes follow."""
    amx = compute_plan(gqa_7b, 80 * GiB, 8192, cpu_flags=frozenset({"avx512_bf16", "amx_bf16"}))
    avx2 = compute_plan(gqa_7b, 80 * GiB, 8192, cpu_flags=frozenset({"avx2"}))
    cuda = compute_plan(gqa_7b, 80 * GiB, 8192, device="cuda:0", cpu_flags=frozenset({"avx2"}))
    assert (amx.dtype, avx2.dtype, cuda.dtype) == ("bfloat16", "float32", "float16")
    assert (amx.kv_bytes_per_token, avx2.kv_bytes_per_token) == (128 * 1024, 256 * 1024)
    assert (amx.weight_bytes, avx2.weight_bytes) == (2 * 5_933_109_248, 4 * 5_933_109_248)
    base = ["plan", "--model", str(gqa_7b), "--device-memory", "80GiB", "--max-model-len", "8192"]
    assert main([*base, "--device", "cuda", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["dtype"], out["device"], out["kv_bytes_per_token"]) == ("float16", "cuda", 128 * 1024)
    with pytest.raises(PlanError, match="unsupported device 'tpu'"):
        compute_plan(gqa_7b, 80 * GiB, 8192, device="tpu")
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--dtype", "int3"])
    assert exit_info.value.code == 2
    assert "argument --dtype: unknown dtype 'int3'" in capsys.readouterr().err


def test_safetensors_headers_give_exact_count(tmp_path: Path) -> None:
    d = _model(
        tmp_path,
        "small",
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=96,
        vocab_size=100,
        torch_dtype="float32",
    )
    tensors: dict[str, np.ndarray] = {
        "a": np.zeros((3, 5), np.float32),
        "b": np.zeros(7, np.float16),
    }
    save_file(tensors, str(d / "model.safetensors"))
    p = compute_plan(d, GiB, 128, dtype="float32")
    assert p.param_source == "safetensors headers" and p.param_count == 22
    assert p.weight_bytes == 22 * 4


def test_parse_and_format_sizes() -> None:
    assert parse_size("80GiB") == 80 * GiB == parse_size("80 gib") == parse_size("80Gi")
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GiB") == 3 * GiB // 2
    assert parse_size("4096") == 4096
    for bad in ("", "80XB", "GiB", "-1GiB"):
        with pytest.raises(PlanError):
            parse_size(bad)
    assert format_bytes(128 * 1024) == "128 KiB"
    assert format_bytes(GiB) == "1 GiB"
    assert format_bytes(11_866_218_496) == "11.05 GiB"


def test_cli_prints_the_figures(gqa_7b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan",
        "--model",
        str(gqa_7b),
        "--device-memory",
        "80GiB",
        "--max-model-len",
        "8192",
        "--concurrency",
        "32",
        "--dtype",
        "float16",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = {line.split(":")[0]: line for line in out.splitlines()}
    assert "131,072 bytes (128 KiB)" in lines["KV bytes per token"]
    assert "1,073,741,824 bytes (1 GiB) at max-model-len 8,192" in lines["KV per request"]
    assert "11.05 GiB" in lines["weight bytes"]
    assert "60 requests" in lines["max concurrency"]
    assert "fits: needs 34,359,738,368 bytes (32 GiB)" in lines["concurrency 32"]
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_request"] == GiB


def test_cli_rejects_bad_size(gqa_7b: Path) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--model", str(gqa_7b), "--device-memory", "lots", "--max-model-len", "8"])


TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 96, "vocab_size": 128, "torch_dtype": "float32"}


@pytest.mark.parametrize(
    ("arch", "model_type", "extra"),
    [
        # Qwen2: q/k/v bias always, never o_proj bias, even with attention_bias set.
        ("Qwen2ForCausalLM", "qwen2", {}),
        ("Qwen2ForCausalLM", "qwen2", {"attention_bias": True}),
        # Mistral: no attention bias at all, whatever attention_bias says.
        ("MistralForCausalLM", "mistral", {"attention_bias": True}),
        # Llama with attention_bias: q/k/v and o_proj bias; Qwen3: q/k norms, tied embeddings.
        ("LlamaForCausalLM", "llama", {"attention_bias": True, "mlp_bias": True}),
        ("Qwen3ForCausalLM", "qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
        # MoE: every layer routed (Mixtral); routed every 2nd layer but not layer 3 (Qwen3-MoE).
        ("MixtralForCausalLM", "mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        ("Qwen3MoeForCausalLM", "qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 4,
                                              "moe_intermediate_size": 24, "decoder_sparse_step": 2,
                                              "mlp_only_layers": [3]}),
    ],
)
def test_plan_counts_the_parameters_the_engine_and_transformers_build(
        tmp_path: Path, arch: str, model_type: str, extra: dict[str, object]) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.engine.loading.model_config import ModelConfig
    from pdserve.engine.models import MODEL_REGISTRY

    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": model_type, **TINY, **extra}))
    plan = compute_plan(d, GiB, 128)  # no weights: counted from the config
    cfg = ModelConfig.from_hf_dir(d)
    engine_model = MODEL_REGISTRY[cfg.architecture](cfg, torch.float32, torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.float32)
    assert plan.param_source == "config shapes"
    assert plan.param_count == sum(p.numel() for p in engine_model.parameters())
    assert plan.param_count == sum(p.numel() for p in hf_model.parameters())
    assert (plan.architecture, plan.num_layers, plan.num_kv_heads, plan.head_dim) == (
        cfg.architecture, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def test_plan_refuses_a_model_the_engine_cannot_serve(tmp_path: Path) -> None:
    d = _model(tmp_path, "gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(PlanError, match="unsupported architecture 'GPT2LMHeadModel'"):
        compute_plan(d, 80 * GiB, 1024)


def test_plan_counts_mixtral_8x7b_experts_total_and_active(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Mixtral-8x7B's published figures: 46.7B parameters, 12.9B of them active per token (top-2 of 8)."""
    d = _model(tmp_path, "mixtral", architectures=["MixtralForCausalLM"], model_type="mixtral",
               num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
               torch_dtype="bfloat16")
    plan = compute_plan(d, 80 * GiB, 4096)
    assert plan.param_count == 46_702_792_704
    assert plan.expert_param_count == 32 * 8 * 3 * 4096 * 14336
    assert plan.active_param_count == 12_879_925_248
    int8 = compute_plan(d, 80 * GiB, 4096, quantization="int8")  # experts shrink with attention: ~1 byte a weight
    assert plan.expert_param_count < int8.weight_bytes < 0.51 * plan.weight_bytes
    dense = compute_plan(_model(tmp_path, "dense"), 80 * GiB, 4096)
    assert dense.expert_param_count == 0 and dense.active_param_count == dense.param_count
    assert main(["plan", "--model", str(d), "--device-memory", "80GiB", "--max-model-len", "4096"]) == 0
    assert "45,097,156,608 (all experts); 12,879,925,248 parameters active per token" in capsys.readouterr().out
