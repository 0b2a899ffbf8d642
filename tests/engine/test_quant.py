"""Weight-only quantization: the int8/int4 layers against their own dequantized weights,
the error against the float weights, the loader hook for every family, and the scheme in
the KV compatibility hash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loading.loader import CheckpointError, load_model_with
from pdserve.engine.quant.formats import (
    PrequantConfig,
    QuantizationError,
    linear_weight_bytes,
    served_quantization,
)
from pdserve.engine.quant.linear import INT4_DEQUANT_ROWS, Int4Linear, Int8Linear, quantize_weight
from pdserve.engine.quant.pack import quantize_int4, quantize_int8
from pdserve.engine.runner.model_runner import ModelRunner
from tests.helpers.tiny_models import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DTYPES = (torch.float32, torch.bfloat16)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("rows", [1, 5, 64])  # aten kernel; native kernel for bf16 (else aten); converted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (40, 688), (256, 384)])  # ragged N and K too
def test_int8_layer_is_the_matmul_of_its_dequantized_weight(
    shape: tuple[int, int], dtype: torch.dtype, rows: int
) -> None:
    w = _weight(*shape)
    parts = quantize_int8(w)
    deq = parts.q.float() * parts.scales[:, None]
    assert (deq - w).abs().max() <= parts.scales.max() / 2 + 1e-7  # half a step at most
    x = torch.randn(rows, shape[1]).to(dtype)
    layer = quantize_weight(w, "int8", dtype)
    assert isinstance(layer, Int8Linear)
    codes = layer.q if layer.native is None else layer.native.codes
    assert codes is not None and codes.dtype == torch.int8
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, shape[0])
    ref = (x.float() @ parts.q.float().t()) * parts.scales.to(dtype).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("rows", [3, 40])  # aten; above: the native kernel (bf16) or the unpacked weight
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(96, 64), (40, 688), (256, 384)])
def test_int4_layer_is_the_matmul_of_its_dequantized_weight(
    shape: tuple[int, int], dtype: torch.dtype, rows: int
) -> None:
    n, k = shape
    w = _weight(n, k, seed=1)
    layer = quantize_weight(w.to(dtype), "int4")
    assert isinstance(layer, Int4Linear) and layer.group == 128 and layer.packed.dtype == torch.uint8
    k_pad = -(-k // 128) * 128
    parts = quantize_int4(torch.nn.functional.pad(w.to(dtype).float(), (0, k_pad - k)), 128)
    deq = parts.dequantize()[:, :k]
    step = parts.scales.max().item()
    assert (deq - w.to(dtype).float()).abs().max().item() <= step / 2 + 1e-6
    x = torch.randn(rows, k).to(dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, n)
    ref = x.float() @ deq.t()
    tol = 1e-4 if dtype == torch.float32 else 3e-2 * ref.abs().max().item()
    assert (y.float() - ref).abs().max().item() <= tol


@pytest.mark.skipif(native_kernels.LIB is None, reason="the native CPU kernels were not built")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_native_unpacking_gives_the_dequantized_int4_weight(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = _weight(200, 256, seed=2).to(dtype)  # N padded to 256: 4 blocks of the packed layout
    layer = quantize_weight(w, "int4")
    assert isinstance(layer, Int4Linear) and INT4_DEQUANT_ROWS < 64
    # the route without a native GEMM for these rows (pdserve/engine/kernels/table.py)
    monkeypatch.setenv("PDSERVE_DISABLED_KERNELS", "int4_gemm_amx,int4_gemm_vnni")
    dense = layer.dense_weight(dtype)
    assert dense.shape == (256, 256) and dense.dtype == dtype
    want = quantize_int4(w.float(), 128).dequantize().to(dtype)
    if dtype == torch.float32:
        assert torch.allclose(dense[:200], want, rtol=0, atol=1e-6)
    else:  # scales and offsets are stored in bf16 for a bf16 layer: within a bf16 step
        assert ((dense[:200].float() - want.float()).abs() <= 2 ** -7 * want.float().abs() + 2e-3).all()
    assert not dense[200:].any()  # the padding rows are zero weights
    x = torch.randn(64, 256).to(dtype)
    assert layer.plan(dtype).kernel_for(64).name == "int4_dequant"
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dense)[:, :200])


def test_int4_groups_are_asymmetric_and_128_wide() -> None:
    levels = (torch.arange(128) % 16).float()
    w = torch.cat([levels / 15, -levels * 0.2])[None].repeat(16, 1)  # [0, 1] and [-3, 0] on 16 levels
    parts = quantize_int4(w, 128)
    assert parts.scales.shape == (16, 2)
    assert torch.allclose(parts.scales[0], torch.tensor([1 / 15, 3 / 15]))
    assert parts.zeros[0].tolist() == [0.0, 15.0]  # each group's own range, not a shared one
    assert torch.allclose(parts.dequantize(), w, atol=1e-6)  # both ranges sit on the 16-level grids


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_loads_quantized_and_keeps_embeddings_float(
    tiny_model_dir: Callable[..., Path], family: str
) -> None:
    d = tiny_model_dir(family)
    _, ref = load_model_with(d, torch.float32, "cpu", None)
    for scheme, cls in (("int8", Int8Linear), ("int4", Int4Linear)):
        _, m = load_model_with(d, torch.float32, "cpu", None, quantization=scheme)
        layers = [m.get_submodule(n) for n in m.linear_weights()]
        assert all(isinstance(layer, cls) for layer in layers)
        assert isinstance(m.embed_tokens, torch.nn.Parameter) and torch.equal(m.embed_tokens, ref.embed_tokens)
        assert isinstance(m.lm_head_q, Int8Linear)  # the head's own int8 copy (auto); tests/engine/test_quant_lm_head.py
        x = torch.randn(4, m.cfg.hidden_size)
        attn, ref_attn = m.layers[0].self_attn, ref.layers[0].self_attn
        got = attn.qkv_weight(x)
        want = x @ ref_attn.qkv_weight.t()
        # The quantization error is a small fraction of the output, never garbage.
        assert (got - want).norm() / want.norm() < (0.02 if scheme == "int8" else 0.2)


def _engine(model_dir: Path, quantization: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", quantization=quantization,
                                  cache=CacheConfig(num_blocks=64)))


def test_quantized_greedy_stays_close_to_float(tiny_model_dir: Callable[..., Path]) -> None:
    d = tiny_model_dir("llama")
    prompt = list(range(3, 40))
    want = _engine(d, "none").generate([prompt], GREEDY)[0].token_ids
    int8 = _engine(d, "int8").generate([prompt], GREEDY)[0].token_ids
    int4 = _engine(d, "int4").generate([prompt], GREEDY)[0].token_ids
    assert int8[:6] == want[:6]  # decisive tiny-model logits survive int8
    assert int4[0] == want[0]


def test_quantization_is_in_the_compat_hash(tiny_model_dir: Callable[..., Path]) -> None:
    d = str(tiny_model_dir("llama"))
    layouts = {q: ModelRunner.layout_for(EngineConfig(model_dir=d, dtype="float32", quantization=q))
               for q in ("none", "int8", "int4")}
    assert {q: lay.quantization for q, lay in layouts.items()} == {"none": "none", "int8": "int8", "int4": "int4"}
    assert len({lay.compat_hash for lay in layouts.values()}) == 3
    runner = ModelRunner(EngineConfig(model_dir=d, dtype="float32", quantization="int4",
                                      cache=CacheConfig(num_blocks=8)))
    assert runner.layout == layouts["int4"] and runner.quantization == "int4"


def test_bad_quantization_requests_are_clear_errors(tiny_model_dir: Callable[..., Path]) -> None:
    d = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="unsupported quantization 'int3'"):
        EngineConfig(model_dir=d, quantization="int3")
    with pytest.raises(QuantizationError, match="already awq-quantized"):
        served_quantization("int8", PrequantConfig("awq", 128))
    with pytest.raises(CheckpointError, match="unknown quantization"):
        load_model_with(d, torch.float32, "cpu", None, quantization="fp4")


def test_weight_bytes_per_scheme() -> None:
    n, k = 4096, 4096
    assert linear_weight_bytes(n, k, "none", 2) == 2 * n * k
    assert linear_weight_bytes(n, k, "int8", 2) == n * k + 2 * n
    assert linear_weight_bytes(n, k, "int4", 2) == n * k // 2 + 2 * 2 * n * (k // 128)
    # AWQ as stored: fp16 scale + 4-bit zero per group of 128.
    assert linear_weight_bytes(n, k, "awq", 2) == n * k // 2 + n * (k // 128) * 2 + n * (k // 128) // 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_cuda_layers_match_their_cpu_twins(scheme: str) -> None:
    w = _weight(256, 512).to(torch.bfloat16)
    x = torch.randn(4, 512).to(torch.bfloat16)
    cpu = quantize_weight(w, scheme)(x).float()
    gpu = quantize_weight(w.cuda(), scheme)(x.cuda()).float().cpu()
    assert (gpu - cpu).abs().max().item() <= 3e-2 * cpu.abs().max().item()
