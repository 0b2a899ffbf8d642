"""`pdserve plan` with weight quantization, a KV-cache dtype and a cost line: the design's
Llama 3 8B 4-bit AWQ example on one 80 GB A100 and its cost per 1M output tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.planner.capacity import PlanError, compute_plan, parse_size

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "torch_dtype": "bfloat16", "max_position_embeddings": 8192,
}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
A100 = parse_size("80GiB")
LINEAR_PARAMS = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)  # q, o, k, v, gate, up, down
OTHER_PARAMS = 8_030_261_248 - LINEAR_PARAMS  # embeddings, LM head, norms


def _model(tmp_path: Path, name: str, **extra: object) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA3_8B, **extra}))
    return d


def test_design_awq_example(tmp_path: Path) -> None:
    p = compute_plan(_model(tmp_path, "awq", quantization_config=AWQ), A100, 4096, device="cuda")
    assert p.quantization == "awq" and p.param_count == 8_030_261_248  # the published Llama 3 8B count
    groups = LINEAR_PARAMS // 128
    # 4-bit codes, an fp16 scale and a 4-bit zero per group of 128; embeddings and LM head bf16.
    assert p.weight_bytes == LINEAR_PARAMS // 2 + groups * 2 + groups // 2 + OTHER_PARAMS * 2
    assert round(p.weight_bytes / 1e9, 2) == 5.73
    assert round(p.kv_budget_bytes / 1e9) == 72  # the design's "~72 GB left for KV"
    assert p.kv_bytes_per_request == 4096 * 128 * 1024  # 0.5 GiB per full 4K sequence at 16 bits
    assert p.max_concurrency == 133
    fp8 = compute_plan(_model(tmp_path, "awq8", quantization_config=AWQ), A100, 4096, device="cuda",
                       kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 64 * 1024 and fp8.max_concurrency == 266


def test_on_the_fly_schemes_shrink_only_the_linears(tmp_path: Path) -> None:
    d = _model(tmp_path, "bf16")
    plans = {q: compute_plan(d, A100, 4096, device="cuda", quantization=q) for q in ("none", "int8", "int4")}
    assert plans["none"].weight_bytes == 8_030_261_248 * 2
    # The LM head (128,256 x 4,096, untied) turns int8 with them by default: a byte a weight
    # and a bf16 scale a row in place of its bf16 weight.
    head, vocab = 128256 * 4096, 128256
    rest = (OTHER_PARAMS - head) * 2 + head + 2 * vocab
    assert plans["int8"].weight_bytes == LINEAR_PARAMS + 2 * _rows() + rest
    groups = LINEAR_PARAMS // 128
    assert plans["int4"].weight_bytes == LINEAR_PARAMS // 2 + 2 * 2 * groups + rest
    assert (plans["int8"].lm_head_quantization, plans["none"].lm_head_quantization) == ("int8", "none")
    float_head = compute_plan(d, A100, 4096, device="cuda", quantization="int8", lm_head_quantization="none")
    assert float_head.weight_bytes == LINEAR_PARAMS + 2 * _rows() + OTHER_PARAMS * 2
    assert plans["none"].max_concurrency < plans["int8"].max_concurrency < plans["int4"].max_concurrency
    with pytest.raises(PlanError, match="already awq-quantized"):
        compute_plan(_model(tmp_path, "awq", quantization_config=AWQ), A100, 4096, device="cuda", quantization="int8")


def _rows() -> int:
    """Output channels of the decoder linears (int8 keeps one scale per row)."""
    return 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)


@pytest.mark.parametrize(("tok_s", "usd"), [(2400, "0.23"), (4800, "0.12")])
def test_design_cost_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str], tok_s: int, usd: str) -> None:
    """An A100 at $2/h: 2,400 tok/s (16-bit) costs $0.23 per 1M output tokens, the
    4-bit AWQ model's ~4,800 tok/s at batch 64 $0.12."""
    d = _model(tmp_path, "awq", quantization_config=AWQ)
    p = compute_plan(d, A100, 4096, device="cuda", gpu_hourly_cost=2.0, throughput=tok_s)
    assert p.cost_per_million_tokens is not None and f"{p.cost_per_million_tokens:.2f}" == usd
    argv = ["plan", "--model", str(d), "--device-memory", "80GiB", "--max-model-len", "4096", "--device", "cuda",
            "--gpu-hourly-cost", "2", "--throughput", str(tok_s), "--kv-cache-dtype", "fp8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"${usd} per 1M output tokens at {tok_s:,} tok/s and $2.00/h" in out
    assert "quantization:         awq" in out and "x 1 bytes (fp8)" in out


def test_a_cost_needs_its_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _model(tmp_path, "bf16")
    with pytest.raises(PlanError, match="needs both"):
        compute_plan(d, A100, 4096, gpu_hourly_cost=2.0)
    argv = ["plan", "--model", str(d), "--device-memory", "80GiB", "--max-model-len", "8", "--gpu-hourly-cost", "2"]
    assert main(argv) == 2
    assert "needs both" in capsys.readouterr().err
