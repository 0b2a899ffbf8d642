"""The native int8 GEMM (pdserve/engine/kernels/_int8_gemm.c, pdserve/engine/kernels/_int8_gemv.c, pdserve/engine/kernels/_int8_vnni.c,
pdserve/engine/kernels/_int8_amx_rows.c, pdserve/engine/kernels/_int8_amx_q8.c): its packed layout, its numerics against
x @ (q s)^T in float32 on each of its paths (float32 GEMV, integer dot products over
fixed-point rows, AVX-512 BF16, AMX, AMX for up to 16 rows widening the codes or multiplying
them as int8 against fixed-point rows) and in float64 on the chosen path for every row count
1-20, the fixed-point rows' own error bound (per group of 64 k for VNNI, 256 for AMX_Q8),
the one function that picks a path per call, and the layer that runs it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.quant import int8_kernel
from pdserve.engine.quant.linear import Int8Linear, quantize_weight
from pdserve.engine.quant.pack import quantize_int8

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not int8_kernel.available(),
                       reason="native int8 kernel needs the built library and AVX-512 BF16"),
]
SHAPES = [(2048, 768), (37, 53), (100, 130), (16, 2), (5, 1)]  # ragged N and K, K odd, K < 32
ACT_MAX = 16383  # pdserve/engine/kernels/_act_q16.h: the fixed-point rows of the VNNI and AMX_Q8 paths
ACT_GROUP = {int8_kernel.VNNI: 64, int8_kernel.AMX_Q8: 256}  # k per row scale
GEMV_PATHS = (int8_kernel.GEMV, int8_kernel.VNNI)  # up to 4 rows


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


def _rows_for(path: int) -> tuple[int, ...]:
    if path in (int8_kernel.AMX_ROWS, int8_kernel.AMX_Q8):
        return tuple(range(1, 17))
    return (1, 2, 3, 4) if path in GEMV_PATHS else (1, 2, 3, 4, 8, 16, 17, 32, 33, 70)


def _skip_without(path: int) -> None:
    if path in (int8_kernel.AMX, int8_kernel.AMX_ROWS, int8_kernel.AMX_Q8) and not int8_kernel.amx_available():
        pytest.skip("no AMX on this CPU")


@pytest.mark.parametrize("path", list(int8_kernel.PATHS.values()), ids=list(int8_kernel.PATHS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matmul_is_x_times_dequantized_weight_within_bf16(shape: tuple[int, int], path: int) -> None:
    _skip_without(path)
    q, scales = _parts(*shape)
    packed = int8_kernel.pack(q, scales)
    w = q.float() * scales.float()[:, None]
    for m in _rows_for(path):
        x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        y = int8_kernel.matmul(x, packed, path)
        ref = x.float() @ w.t()
        assert y.dtype == torch.bfloat16 and y.shape == (m, shape[0])
        # one bf16 rounding of each output, plus float32 summation-order noise
        err = (y.float() - ref).abs()
        assert (err <= ref.abs() * 2.0**-8 + 1e-3 * ref.abs().max()).all(), (m, err.max().item())


@pytest.mark.parametrize("path", GEMV_PATHS, ids=("gemv", "vnni"))
def test_gemv_handles_extreme_codes_and_rows_of_different_size(path: int) -> None:
    # -128 and 127 codes (every sign and the widest magnitude), one row 1000x the others
    q = torch.tensor([[-128, 127] * 20, [127, -128] * 20] * 9, dtype=torch.int8)  # [18, 40]
    scales = torch.linspace(0.5, 2.0, 18).to(torch.bfloat16)
    packed = int8_kernel.pack(q, scales)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1] *= 1000.0
    ref = x.float() @ (q.float() * scales.float()[:, None]).t()
    for m in (1, 2, 3, 4):
        y = int8_kernel.matmul(x[:m], packed, path)
        for row in range(m):
            assert torch.allclose(y[row].float(), ref[row], rtol=2.0**-8, atol=1e-3 * ref[row].abs().max().item())


@pytest.mark.parametrize("path", list(int8_kernel.PATHS.values()), ids=list(int8_kernel.PATHS))
def test_threads_split_the_tiles_without_changing_a_bit(path: int) -> None:
    _skip_without(path)
    packed = int8_kernel.pack(*_parts(100, 130))
    rows = {int8_kernel.GEMV: 4, int8_kernel.VNNI: 4, int8_kernel.AMX_ROWS: 16, int8_kernel.AMX_Q8: 16}.get(path, 40)
    x = torch.randn(rows, 130, generator=torch.Generator().manual_seed(5))
    one = int8_kernel.matmul(x.bfloat16(), packed, path)
    torch.set_num_threads(2)  # the one_torch_thread fixture restores the setting
    assert torch.equal(int8_kernel.matmul(x.bfloat16(), packed, path), one)


def test_one_function_picks_the_path_by_rows() -> None:
    amx = int8_kernel.amx_available()
    assert [int8_kernel.path_for(m) for m in (1, 2, 3, 4)] == [int8_kernel.VNNI] * 4  # decode
    # 5-16 rows (batched decode): AMX int8 tile multiplies; more: AMX over whole tiles
    rows16 = int8_kernel.AMX_Q8 if amx else int8_kernel.DPBF16
    assert [int8_kernel.path_for(m) for m in (5, 8, 16)] == [rows16] * 3
    above = int8_kernel.AMX if amx else int8_kernel.DPBF16
    assert [int8_kernel.path_for(m) for m in (17, 32, 33, 512)] == [above] * 4


@pytest.mark.parametrize("shape", [(768, 2048), (37, 53), (33, 77)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_chosen_path_matches_float64_for_every_row_count_to_20(shape: tuple[int, int]) -> None:
    """Bound: one bf16 rounding of the output (2^-8 relative) plus float32 summation,
    at most K * 2^-23 of sum_k |x q s| (the scale is float32 in the kernel), plus, where the
    path runs fixed-point rows, their rounding (`_fixed_point_error`)."""
    q, scales = _parts(*shape)
    packed = int8_kernel.pack(q, scales)
    w = q.double() * scales.double()[:, None]
    for m in range(1, 21):
        x = torch.randn(m, shape[1], generator=torch.Generator().manual_seed(100 + m)).to(torch.bfloat16)
        y = int8_kernel.matmul(x, packed).double()
        ref = x.double() @ w.t()
        bound = ref.abs() * 2.0**-8 + shape[1] * 2.0**-23 * (x.double().abs() @ w.abs().t())
        if int8_kernel.path_for(m) in ACT_GROUP:
            bound += _fixed_point_error(x, w, ACT_GROUP[int8_kernel.path_for(m)])
        assert ((y - ref).abs() <= bound).all(), (m, int8_kernel.path_for(m))


def _fixed_point_error(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """The most that rounding x to 15-bit fixed point per group of `group` k moves x @ w^T:
    each element by half a step, max |x in its group| / (2 * 16383), times |w| (float64)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.double().abs(), (0, groups * group - k))
    step = padded.reshape(m, groups, group).amax(dim=2) / ACT_MAX
    half_steps = (step / 2).repeat_interleave(group, dim=1)[:, :k]
    return half_steps @ w.abs().t()


@pytest.mark.parametrize("path", list(ACT_GROUP), ids=["vnni", "amx_q8"])
def test_fixed_point_rows_stay_in_their_bound_and_per_group(path: int) -> None:
    """The VNNI and AMX_Q8 paths' error stays inside its stated bound, and an outlier coarsens
    only its own group: a row whose group 0 holds a 10^4x element keeps group 1's terms as
    fine as a row without it, where one scale per row would have lost 13 of their 15 bits."""
    _skip_without(path)
    group = ACT_GROUP[path]
    n, k = 48, 2 * group
    q, scales = _parts(n, k)
    packed = int8_kernel.pack(q, scales)
    w = q.double() * scales.double()[:, None]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x[1] = x[0]
    x[1, 3] = 1e4  # in group 0 only
    y = int8_kernel.matmul(x, packed, path).double()
    ref = x.double() @ w.t()
    bound = (ref.abs() * 2.0**-8 + k * 2.0**-23 * (x.double().abs() @ w.abs().t())
             + _fixed_point_error(x, w, group))
    assert ((y - ref).abs() <= bound).all()
    # group 1 alone (group 0's codes zeroed): the outlier row must match the plain row there
    q1 = q.clone()
    q1[:, :group] = 0
    y1 = int8_kernel.matmul(x, int8_kernel.pack(q1, scales), path)
    assert torch.equal(y1[0], y1[1])


@pytest.mark.parametrize("path", list(ACT_GROUP), ids=["vnni", "amx_q8"])
def test_fixed_point_rows_carry_nan_and_infinity_to_the_outputs(path: int) -> None:
    _skip_without(path)
    packed = int8_kernel.pack(*_parts(32, 130))
    x = torch.randn(3, 130, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x[0, 70] = float("nan")
    x[1, 5] = float("inf")
    y = int8_kernel.matmul(x, packed, path)
    # a group holding NaN or inf marks its whole row NaN (float would give NaN or +-inf)
    assert y[0].isnan().all() and y[1].isnan().all()
    assert y[2].isfinite().all()


def test_matmul_rejects_what_it_cannot_run() -> None:
    packed = int8_kernel.pack(*_parts(32, 64))
    with pytest.raises(ValueError, match="bf16"):
        int8_kernel.matmul(torch.randn(2, 64), packed)  # float32
    with pytest.raises(ValueError, match="bf16"):
        int8_kernel.matmul(torch.randn(2, 63).bfloat16(), packed)
    with pytest.raises(ValueError, match="cannot run 5 x 64"):
        int8_kernel.matmul(torch.randn(5, 64).bfloat16(), packed, int8_kernel.GEMV)  # GEMV: <= 4 rows
    with pytest.raises(ValueError, match="cannot run 5 x 64"):  # VNNI: <= 4 rows
        int8_kernel.matmul(torch.randn(5, 64).bfloat16(), packed, int8_kernel.VNNI)
    if int8_kernel.amx_available():
        for path in (int8_kernel.AMX_ROWS, int8_kernel.AMX_Q8):  # <= 16 rows
            with pytest.raises(ValueError, match="cannot run 17 x 64"):
                int8_kernel.matmul(torch.randn(17, 64).bfloat16(), packed, path)
    with pytest.raises(ValueError, match="on path 9"):
        int8_kernel.matmul(torch.randn(2, 64).bfloat16(), packed, 9)
    assert int8_kernel.matmul(torch.randn(0, 64).bfloat16(), packed).shape == (0, 32)


def test_a_bf16_int8_layer_holds_its_codes_once_and_runs_the_kernel_for_any_rows() -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)) * 0.05
    fp32 = quantize_weight(w, "int8", torch.float32)
    assert isinstance(fp32, Int8Linear) and fp32.native is None and fp32.q is not None  # torch's paths
    layer = quantize_weight(w, "int8", torch.bfloat16)
    assert isinstance(layer, Int8Linear) and layer.native is not None
    assert layer.q is None  # one copy of the codes: 1 byte a weight, as int8 promises
    assert layer.native.codes.dtype == torch.int8 and layer.native.codes.numel() == 96 * 64
    for rows in (1, 16, 70):  # one row (GEMV), one block of rows, several blocks and a ragged one
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        assert torch.equal(layer(x), int8_kernel.matmul(x, layer.native))
    if int8_kernel.amx_available():  # past 32 rows: each row as if it ran alone in its 32-row block
        x = torch.randn(70, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        blocks = [int8_kernel.matmul(x[i:i + 32], layer.native, int8_kernel.AMX) for i in range(0, 70, 32)]
        assert torch.equal(layer(x), torch.cat(blocks))


def test_bf16_int8_engine_decodes_through_the_kernel_deterministically(
    tiny_model_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = int8_kernel.matmul

    def counted(x: torch.Tensor, w: int8_kernel.PackedInt8, path: int = int8_kernel.AUTO) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, path)

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
    # Greedy tokens of the bf16 model mostly survive int8 (a broken kernel agrees ~never;
    # this random model has near-ties everywhere: 23-26 of 40 agree, by bf16 kernel).
    assert same >= 0.5 * sum(map(len, want))
