"""AWQ and GPTQ checkpoints (written by tests/helpers/quant_checkpoints.py from the
formats' published layouts) load into the int4 path: the dequantized weights equal the
ones the checkpoint encodes, sit within half a step of the originals, and the served
greedy output equals that of a float checkpoint holding those dequantized weights."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loading.loader import CheckpointError, load_model_with
from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError
from pdserve.engine.quant.linear import ConcatLinear, Int4Linear
from pdserve.engine.quant.pack import Int4Parts, awq_parts, gptq_parts
from tests.helpers.quant_checkpoints import write_fake_quant, write_quantized

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
# (method, group, desc_act, checkpoint_format, sym)
CASES = {
    "awq-g32": ("awq", 32, False, "gptq", False),
    "awq-per-channel": ("awq", -1, False, "gptq", False),
    "gptq-v1-sym": ("gptq", 32, False, "gptq", True),
    "gptq-v2-act-order": ("gptq", 32, True, "gptq_v2", False),
}


def _write(src: Path, dst: Path, case: str) -> dict[str, torch.Tensor]:
    method, group, desc_act, fmt, sym = CASES[case]
    return write_quantized(src, dst, method, group, desc_act=desc_act, checkpoint_format=fmt, sym=sym)


def _parts(d: Path, prefix: str, n: int, k: int) -> Int4Parts:
    t = load_file(str(d / "model.safetensors"))
    pq = ModelConfig.from_hf_dir(d).prequant
    assert pq is not None
    if pq.method == "awq":
        return awq_parts(t[prefix + "qweight"], t[prefix + "qzeros"], t[prefix + "scales"], pq)
    return gptq_parts(t[prefix + "qweight"], t[prefix + "qzeros"], t[prefix + "scales"], t.get(prefix + "g_idx"), pq)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dequantized_weights_match_the_checkpoint_and_the_originals(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, case: str
) -> None:
    src = tiny_model_dir("llama")
    deq = _write(src, tmp_path / case, case)
    originals = load_file(str(src / "model.safetensors"))
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        w = originals[name]
        parts = _parts(tmp_path / case, name.removesuffix("weight"), *w.shape)
        got = parts.dequantize()
        assert torch.equal(got, deq[name]), name  # exactly what the checkpoint encodes
        step = parts.scales.max().item()
        assert (got - w).abs().max().item() <= step / 2 + 1e-3, name
        assert parts.group in (32, 64, 128)


def _greedy(model_dir: Path, prompt: list[int]) -> tuple[int, ...]:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", cache=CacheConfig(num_blocks=64)))
    return engine.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize("case", ["awq-g32", "gptq-v2-act-order"])
def test_served_output_equals_the_dequantized_float_model(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, case: str
) -> None:
    src = tiny_model_dir("qwen2")  # q/k/v biases ride along the quantized qkv
    deq = _write(src, tmp_path / "q", case)
    ref = write_fake_quant(src, tmp_path / "ref", deq)
    _, model = load_model_with(tmp_path / "q", torch.float32, "cpu", None)
    qkv = model.layers[0].self_attn.qkv_weight
    # act-order gives q, k and v their own channel orders: three kernels, one output.
    assert isinstance(qkv, ConcatLinear if CASES[case][2] else Int4Linear)
    prompt = list(range(5, 37))
    assert _greedy(tmp_path / "q", prompt) == _greedy(ref, prompt)


def test_quantized_checkpoint_reports_its_method_and_refuses_requantization(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    _write(tiny_model_dir("llama"), tmp_path / "awq", "awq-g32")
    cfg = EngineConfig(model_dir=str(tmp_path / "awq"), dtype="float32", cache=CacheConfig(num_blocks=8))
    from pdserve.engine.runner.model_runner import ModelRunner

    assert ModelRunner.layout_for(cfg).quantization == "awq"
    with pytest.raises(CheckpointError, match="already awq-quantized"):
        load_model_with(tmp_path / "awq", torch.float32, "cpu", None, quantization="int8")


@pytest.mark.parametrize(("qc", "message"), [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not served"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits=8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "awq", "bits": 4, "group_size": 0}, "group_size 0"),
])
def test_unservable_quantization_configs_are_one_line_errors(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, qc: dict[str, object], message: str
) -> None:
    src = tiny_model_dir("llama")
    d = tmp_path / "bad"
    d.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dir(d)


def test_a_mislabelled_checkpoint_names_the_tensor(tiny_model_dir: Callable[..., Path], tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    _write(src, tmp_path / "awq", "awq-g32")
    cfg_path = tmp_path / "awq" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["group_size"] = 64  # the tensors hold 32-groups
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"qzeros.*expected \[1, "):
        load_model_with(tmp_path / "awq", torch.float32, "cpu", None)


# (family, an expert's gate/up and down tensors of its first routed layer)
MOE_EXPERTS = {
    "mixtral": ("model.layers.0.block_sparse_moe.experts.3.w1.weight",
                "model.layers.0.block_sparse_moe.experts.3.w2.weight"),
    "qwen3_moe": ("model.layers.0.mlp.experts.5.gate_proj.weight", "model.layers.0.mlp.experts.5.down_proj.weight"),
}


@pytest.mark.parametrize("case", ["awq-g32", "gptq-v2-act-order"])
@pytest.mark.parametrize("family", sorted(MOE_EXPERTS))
def test_moe_experts_load_from_awq_and_gptq_checkpoints(
    tiny_model_dir: Callable[..., Path], tmp_path: Path, family: str, case: str
) -> None:
    """Every expert's `qweight`/`qzeros`/`scales` (+ `g_idx`) under its float name loads
    into the int4 path; the router stays float; served greedy output equals the float
    model holding the dequantized weights."""
    src = tiny_model_dir(family)
    deq = _write(src, tmp_path / "q", case)
    originals = load_file(str(src / "model.safetensors"))
    for name in MOE_EXPERTS[family]:
        w = originals[name]
        parts = _parts(tmp_path / "q", name.removesuffix("weight"), *w.shape)
        assert torch.equal(parts.dequantize(), deq[name]), name
        assert (parts.dequantize() - w).abs().max().item() <= parts.scales.max().item() / 2 + 1e-3, name
    _, model = load_model_with(tmp_path / "q", torch.float32, "cpu", None)
    moe = model.layers[0].mlp
    assert isinstance(moe.router_weight, torch.nn.Parameter)
    for expert in moe.experts:
        assert isinstance(expert.gate_up_weight, ConcatLinear if CASES[case][2] else Int4Linear)
        assert isinstance(expert.down_weight, Int4Linear)
    ref = write_fake_quant(src, tmp_path / "ref", deq)
    prompt = list(range(5, 37))
    assert _greedy(tmp_path / "q", prompt) == _greedy(ref, prompt)
