"""bench/gpu_serve.py: the HBM arithmetic with known answers, the bfloat16 / padded-vocab
writer it relies on, and one end-to-end run of the script on CPU (tiny shape).

The GPU-only part (`measure_hbm_gbps`, a CUDA copy) has no test here; `bench/gpu_check.sh`
runs it on a GPU. Everything below runs on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bench.gpu_serve import (
    LLAMA3_8B,
    PRESETS,
    DecodeResult,
    LlamaShape,
    PrefillResult,
    copy_gbps,
    decode_row,
    decode_step_bytes,
    ensure_model,
    hbm_limit,
    kv_bytes_per_token,
    mean_decode_context,
    param_count,
    parse_args,
    prefill_flops,
    prefill_peak_fraction,
    weight_bytes,
)
from bench.stack import StackConfig, stack_commands
from pdserve.builtin.default_model import WeightFormat, write_default_model
from pdserve.engine.loading.model_config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
# hidden 4, 1 layer, 2 heads / 1 KV head of dim 2, FFN 8, vocab 10: small enough to add up by hand.
SMALL = LlamaShape(hidden=4, layers=1, heads=2, kv_heads=1, head_dim=2, ffn=8, vocab=10)


def test_llama3_8b_param_count_and_bytes() -> None:
    # Meta's published count for Llama-3-8B: 8.03e9 (untied 128,256 x 4,096 embedding and LM head).
    assert param_count(LLAMA3_8B) == 8_030_261_248
    assert weight_bytes(LLAMA3_8B, 2) == 16_060_522_496
    assert kv_bytes_per_token(LLAMA3_8B, 2) == 131_072  # 2 x 32 layers x 8 heads x 128 x 2 B


def test_small_shape_by_hand() -> None:
    # embed + head 2*10*4 = 80; layer: q,o 2*(4*4) = 32, k,v 2*(4*2) = 16, mlp 3*4*8 = 96,
    # norms 8 -> 152; final norm 4.
    assert param_count(SMALL) == 236
    assert kv_bytes_per_token(SMALL, 2) == 8  # 2 (K, V) x 1 layer x 1 head x 2 dims x 2 B
    # Batch 2 at context 3: weights but the embedding (236 - 40) + 2 gathered rows (8) = 204
    # params = 408 B, plus KV 2 x 3 x 8 = 48 B.
    assert decode_step_bytes(SMALL, batch=2, context=3, dtype_bytes=2) == 456
    # 456 B/s moves one step per second: 2 tokens/s; measuring 1.5 is 0.75 of it.
    assert hbm_limit(1.5, batch=2, step_bytes=456, hbm_gbps=456e-9) == pytest.approx(
        (456, 2.0, 0.75)
    )


def test_llama3_8b_limit_at_batch_1_and_32() -> None:
    ctx = mean_decode_context(129, 128)  # 128-token prompt + BOS, 128 output tokens
    assert ctx == 193
    b1 = decode_step_bytes(LLAMA3_8B, 1, ctx, 2)
    assert b1 == (8_030_261_248 - 525_336_576 + 4096) * 2 + 193 * 131_072
    assert hbm_limit(100.0, 1, b1, 4800).limit_tokens_per_s == pytest.approx(4.8e12 / b1)
    assert 318 < 4.8e12 / b1 < 320  # ~15.03 GB per step at batch 1
    b32 = decode_step_bytes(LLAMA3_8B, 32, ctx, 2)
    assert b32 - b1 == 31 * (4096 * 2 + 193 * 131_072)


def test_prefill_flops_by_hand_and_fraction_of_peak() -> None:
    # SMALL, 3 tokens: matmul weights per layer q,o 32 + k,v 16 + MLP 96 = 144 -> 3 x 2 x 144
    # = 864; one LM-head row 2 x 10 x 4 = 80; causal attention 4 x 2 heads x 2 dims x (1+2+3)
    # = 96 in the one layer.
    assert prefill_flops(SMALL, 3) == 864 + 80 + 96
    # 2 requests of 3 tokens in 0.5 s (12 tok/s): 4 prompts' FLOPs a second.
    p = PrefillResult(2, 6, 12.0, None, None, 0)
    got = prefill_peak_fraction(p, SMALL, peak_tflops=1040 * 8 / 1e12)
    assert got == pytest.approx({"flops_per_s": 4 * 1040, "fraction_of_peak": 0.5})
    assert prefill_peak_fraction(p._replace(tokens_per_s=0.0), SMALL, 989)["fraction_of_peak"] == 0
    # Llama-3-8B at 2,048 tokens: ~14.5 GFLOP a token (2 x 6.98e9 matmul weights + attention),
    # so 989 TFLOP/s is ~68k prompt tokens/s.
    per_token = prefill_flops(LLAMA3_8B, 2048) / 2048
    assert 14.4e9 < per_token < 14.6e9


def test_copy_bandwidth_counts_read_and_write() -> None:
    assert copy_gbps(nbytes=10**9, copies=10, seconds=5.0) == 4.0


def test_decode_row_reports_both_limits() -> None:
    d = DecodeResult(
        batch=2, mean_prompt_tokens=1.0, tokens_per_s=1.5, tpot_p50_s=None, itl_p50_s=None, failed=0
    )
    row = decode_row(d, SMALL, output_len=4, dtype_bytes=2, hbm_gbps=456e-9, measured_gbps=228e-9)
    assert row["mean_context"] == 3 and row["step_bytes"] == 456
    assert (row["fraction"], row["fraction_measured"]) == pytest.approx((0.75, 1.5))
    assert decode_row(d, SMALL, 4, 2, 456e-9, None)["fraction_measured"] is None


def test_shape_from_written_config(tmp_path: Path) -> None:
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
           "vocab_size": 128256}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert LlamaShape.from_model_config(ModelConfig.from_hf_dir(tmp_path)) == LLAMA3_8B
    spec = PRESETS["llama3-8b"].spec
    assert (spec.hidden_size, spec.head_dim, spec.rope_theta) == (4096, 128, 500000.0)


def test_bfloat16_write_is_the_float32_model_rounded(tmp_path: Path) -> None:
    write_default_model(tmp_path / "f32")
    write_default_model(tmp_path / "bf16", fmt=WeightFormat("bfloat16", vocab_size=4096))
    f32, bf16 = (
        load_file(tmp_path / "f32" / "model.safetensors"),
        load_file(tmp_path / "bf16" / "model.safetensors"),
    )
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["torch_dtype"]) == (4096, "bfloat16")
    assert f32.keys() == bf16.keys()
    for name, ref in f32.items():
        got = bf16[name]
        assert got.dtype == torch.bfloat16
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = ref.shape[0]
            assert (
                got.shape == (4096, ref.shape[1]) and not got[rows:].any()
            )  # padded rows are zero
            got = got[:rows]
        assert torch.equal(got, ref.to(torch.bfloat16)), name  # round to nearest even, as torch


def test_tiled_fill_is_deterministic_and_normal(tmp_path: Path) -> None:
    fmt = WeightFormat("bfloat16", tiled=True)
    a = load_file(write_default_model(tmp_path / "a", fmt=fmt) / "model.safetensors")
    b = load_file(write_default_model(tmp_path / "b", fmt=fmt) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    w = a["model.layers.0.mlp.up_proj.weight"].float()
    assert 0.019 < w.std().item() < 0.021 and abs(w.mean().item()) < 1e-3
    assert not torch.equal(w, a["model.layers.1.mlp.up_proj.weight"].float())
    assert 0.19 < a["lm_head.weight"].float().std().item() < 0.21


def test_ensure_model_reuses_a_match_and_refuses_another(tmp_path: Path) -> None:
    d = tmp_path / "m"
    assert ensure_model(d, PRESETS["tiny"], "bfloat16") is True
    assert ensure_model(d, PRESETS["tiny"], "bfloat16") is False
    with pytest.raises(SystemExit, match="torch_dtype"):
        ensure_model(d, PRESETS["tiny"], "float32")
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary directory left


def test_workers_get_the_dtype_and_measure_hbm_needs_cuda() -> None:
    cfg = StackConfig("/m", "cuda", "bfloat16", 2, "8GiB", 8192, 60.0)
    gateway, prefill, decode = stack_commands(cfg, port=1234, control_port=5678)
    assert gateway[3:] == ["gateway", "--port", "1234", "--control-port", "5678", "--model", "/m"]
    for cmd, role in ((prefill, "prefill"), (decode, "decode")):
        assert cmd[3] == role and "tcp://127.0.0.1:5678" in cmd
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert cmd[cmd.index("--kv-cache-memory") + 1] == "8GiB"
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--measure-hbm"])


def test_end_to_end_tiny_model_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_serve.json"
    cmd = [sys.executable, "-m", "bench.gpu_serve", "--shape", "tiny", "--device", "cpu",
           "--model-dir", str(tmp_path / "tiny"), "--batches", "1,4", "--prompt-len", "16", "--output-len", "8",
           "--prefill-len", "64", "--prefill-requests", "4", "--threads", "1", "--output-json", str(out)]
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path / "home")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert (result["dtype"], result["device"], result["hbm_gbps_measured"]) == (
        "bfloat16",
        "cpu",
        None,
    )
    assert result["prefill"]["tokens_per_s"] > 0 and result["prefill"]["failed"] == 0
    assert result["prefill"]["prompt_tokens"] == 4 * 65  # exact sizes (+ BOS) from the tokenizer
    assert [r["batch"] for r in result["decode"]] == [1, 4]
    for row in result["decode"]:
        assert row["tokens_per_s"] > 0 and row["failed"] == 0
        assert 0 < row["fraction"] <= 1
    assert "fraction" in proc.stdout and "prefill:" in proc.stdout
