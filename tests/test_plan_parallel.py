"""`pdserve plan --devices N`: the smallest TP x PP layout that holds weights + working KV,
and the design's 70B-on-8xA100 figures (~17.5 GB of weights and ~55 GB of KV per GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.planner.capacity import CapacityPlan, compute_plan, read_model_config
from pdserve.planner.parallel import layout_plan, recommend

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096,
    "torch_dtype": "float16",
}
A100 = 80 * 10**9


@pytest.fixture
def llama_70b(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    return tmp_path


def _plan(d: Path) -> CapacityPlan:
    return compute_plan(d, A100, 4096, dtype="float16", device="cuda")


def test_70b_on_eight_a100s_per_gpu_figures(llama_70b: Path) -> None:
    p = layout_plan(_plan(llama_70b), read_model_config(llama_70b), 8, 1, 1)
    assert 17.0e9 < p.weight_bytes_per_device < 17.5e9  # 69.0B parameters x 2 bytes / 8
    assert 54.5e9 < p.kv_budget_bytes_per_device < 55.0e9  # 80 GB - 10% - weights
    assert p.kv_heads_per_device == 1  # 8 KV heads over 8 ranks
    assert p.kv_bytes_per_token_per_device == 2 * 80 * 1 * 128 * 2
    # One 4K request holds 160 MiB of KV per GPU.
    assert p.max_concurrency == p.kv_budget_bytes_per_device // (4096 * 2 * 80 * 128 * 2)


def test_the_smallest_layout_that_holds_the_working_kv(llama_70b: Path) -> None:
    plan, cfg = _plan(llama_70b), read_model_config(llama_70b)
    big = recommend(plan, cfg, max_devices=8, concurrency=300)
    assert big is not None and (big.tensor_parallel, big.pipeline_parallel) == (8, 1)
    # Fewer requests fit on fewer devices; at equal device counts TP comes before PP.
    small = recommend(plan, cfg, max_devices=8, concurrency=100)
    assert small is not None and (small.tensor_parallel, small.pipeline_parallel) == (4, 1)
    assert recommend(plan, cfg, max_devices=8, concurrency=400) is None
    # Every smaller layout really is short of the asked-for requests.
    for tp, pp in ((1, 1), (2, 1), (1, 2), (1, 3)):
        assert layout_plan(plan, cfg, tp, pp, 100).max_concurrency < 100


def test_tp_sizes_that_do_not_split_the_heads_are_skipped(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_70B, "num_attention_heads": 48,
                                                      "num_key_value_heads": 6}))
    plan, cfg = _plan(tmp_path), read_model_config(tmp_path)
    # TP 4 would hold 100 requests on 4 devices, but 4 ranks cannot share 6 KV heads
    # (nor 3 ranks the intermediate size): two stages of TP 2 it is.
    got = recommend(plan, cfg, max_devices=8, devices_per_node=4, concurrency=100)
    assert got is not None and (got.tensor_parallel, got.pipeline_parallel) == (2, 2)


def test_cli_prints_the_layout(llama_70b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", str(llama_70b), "--device-memory", "80GB", "--max-model-len", "4096",
            "--dtype", "float16", "--device", "cuda", "--devices", "8", "--concurrency", "300"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tensor parallel 8 x pipeline parallel 1 (8 devices)" in out
    assert main([*argv, "--json"]) == 0
    layout = json.loads(capsys.readouterr().out)["parallel"]
    assert layout["devices"] == 8 and layout["kv_heads_per_device"] == 1


def test_quantized_weights_need_fewer_devices(llama_70b: Path) -> None:
    cfg = read_model_config(llama_70b)
    fp16, int4 = _plan(llama_70b), compute_plan(llama_70b, A100, 4096, dtype="float16", device="cuda",
                                                quantization="int4")
    # 70 full 4K requests: fp16 weights leave two devices room for ~2, int4's for ~79.
    f, q = recommend(fp16, cfg, max_devices=8, concurrency=70), recommend(int4, cfg, max_devices=8, concurrency=70)
    assert f is not None and (f.tensor_parallel, f.pipeline_parallel) == (4, 1)
    assert q is not None and (q.tensor_parallel, q.pipeline_parallel) == (2, 1)
    assert q.weight_bytes_per_device == -(-int4.weight_bytes // 2) < 0.3 * fp16.weight_bytes
    assert layout_plan(int4, cfg, 2, 1, 70).weight_bytes_per_device < 20e9


def test_int4_layouts_whose_groups_straddle_ranks_are_skipped(tmp_path: Path) -> None:
    # 28,800 = 225 groups of 128: two ranks of down_proj would each hold 112.5 groups.
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_70B, "intermediate_size": 28800}))
    cfg = read_model_config(tmp_path)
    int4 = compute_plan(tmp_path, A100, 4096, dtype="float16", device="cuda", quantization="int4")
    assert layout_plan(int4, cfg, 2, 1, 40).max_concurrency >= 40  # TP 2 would hold them
    got = recommend(int4, cfg, max_devices=8, concurrency=40)
    assert got is not None and (got.tensor_parallel, got.pipeline_parallel) == (1, 2)
