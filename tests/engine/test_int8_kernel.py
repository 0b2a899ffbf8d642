"""The native small-M int8 GEMM (engine/_int8_gemm.c): its packed layout, its numerics
against x @ (q s)^T in float32 on both its AMX and AVX-512 BF16 paths, and the one
function that routes an int8 layer's call to it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.config import CacheConfig, EngineConfig
from engine.llm_engine import LLMEngine
from engine.quant import int8_kernel
from engine.quant.linear import Int8Linear, quantize_weight
from engine.quant.pack import quantize_int8

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not int8_kernel.available(),
                       reason="native int8 kernel needs the built library and AVX-512 BF16"),
]
SHAPES = [(2048, 768), (37, 53), (100, 130), (16, 2), (5, 1)]  # ragged N and K, K odd, K < 32


def _parts(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 1000 + k)
    parts = quantize_int8(torch.randn(n, k, generator=g) * 0.05)
    return parts.q, parts.scales.to(torch.bfloat16)


def test_pack_puts_16_channels_by_2_k_in_each_32_bytes() -> None:
    q, scales = _parts(37, 53)
    packed = int8_kernel.pack(q, scales)
    assert packed.codes.shape == (3, 27, 16, 2) and packed.codes.is_contiguous()
    t, p, c, j = torch.meshgrid(*(torch.arange(s) for s in packed.codes.shape), indexing="ij")
    n, k = 16 * t + c, 2 * p + j
    inside = (n < 37) & (k < 53)
    assert torch.equal(packed.codes[inside], q[n[inside], k[inside]])
    assert not packed.codes[~inside].any()  # padding is zero codes
    assert packed.scales.dtype == torch.float32 and torch.equal(packed.scales, scales.float())


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "avx512bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matmul_is_x_times_dequantized_weight_within_bf16(shape: tuple[int, int], amx: bool) -> None:
    if amx and not int8_kernel.amx_available():
        pytest.skip("no AMX on this CPU")
    q, scales = _parts(*shape)
    packed = int8_kernel.pack(q, scales)
    w = q.float() * scales.float()[:, None]
    for m in (1, 3, 8, 16, 17, 32):
        x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y = int8_kernel.matmul(x, packed, amx=amx)
        ref = x.float() @ w.t()
        assert y.dtype == torch.bfloat16 and y.shape == (m, shape[0])
        # one bf16 rounding of each output, plus float32 summation-order noise
        err = (y.float() - ref).abs()
        assert (err <= ref.abs() * 2.0**-8 + 1e-3 * ref.abs().max()).all(), (m, err.max().item())


def test_matmul_rejects_what_it_cannot_run() -> None:
    packed = int8_kernel.pack(*_parts(32, 64))
    with pytest.raises(ValueError, match="bf16"):
        int8_kernel.matmul(torch.randn(2, 64), packed)  # float32
    with pytest.raises(ValueError, match="bf16"):
        int8_kernel.matmul(torch.randn(2, 63).bfloat16(), packed)
    with pytest.raises(ValueError, match="cannot run 33"):
        int8_kernel.matmul(torch.randn(33, 64).bfloat16(), packed)


def test_a_bf16_int8_layer_holds_its_codes_once_and_runs_the_kernel_for_any_rows() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    fp32 = quantize_weight(w, "int8", torch.float32)
    assert isinstance(fp32, Int8Linear) and fp32.native is None and fp32.q is not None  # torch's paths
    layer = quantize_weight(w, "int8", torch.bfloat16)
    assert isinstance(layer, Int8Linear) and layer.native is not None
    assert layer.q is None  # one copy of the codes: 1 byte a weight, as int8 promises
    assert layer.native.codes.dtype == torch.int8 and layer.native.codes.numel() == 96 * 64
    for rows in (1, 16, 70):  # one row, one kernel call, several 32-row calls
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        blocks = [int8_kernel.matmul(x[i:i + 32], layer.native) for i in range(0, rows, 32)]
        assert torch.equal(layer(x), torch.cat(blocks))


def test_bf16_int8_engine_decodes_through_the_kernel_deterministically(
    tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = int8_kernel.matmul

    def counted(x: torch.Tensor, w: int8_kernel.PackedInt8, amx: bool = True) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, amx)

    monkeypatch.setattr(int8_kernel, "matmul", counted)
    d = str(tiny_model_dir("llama"))
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(4)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

    def run(quantization: str) -> list[list[int]]:
        engine = LLMEngine(EngineConfig(model_dir=d, dtype="bfloat16", quantization=quantization,
                                        cache=CacheConfig(num_blocks=64)))
        return [out.token_ids for out in engine.generate(prompts, greedy)]

    first = run("int8")
    assert 4 in calls  # the batch of 4 decoding sequences ran the native kernel
    assert run("int8") == first
    want = run("none")
    same = sum(a == b for got, ref in zip(first, want, strict=True) for a, b in zip(got, ref, strict=True))
    # Greedy tokens of the bf16 model mostly survive int8 (a broken kernel agrees ~never).
    assert same >= 0.6 * sum(map(len, want))
