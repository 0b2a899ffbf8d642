"""The native int4 GEMM (pdserve/engine/kernels/_int4_gemm.c): x @ W^T over the codes in aten's CPU int4pack
layout, against a float64 reference of the dequantized weight, for every row count up to
past 300; its thread split; and the layer that runs it for prefill (Int4Linear), against the
old path that unpacks the whole weight and runs F.linear.

Tolerance (bf16): the kernel widens each weight exactly as the reference below does (float32
(q - 8) * scale + offset, rounded to bf16), multiplies exactly and sums in float32, then
rounds once to bf16: |y - ref| <= 2^-8 |ref| + 2^-16 (|x| @ |W|^T)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.quant import int4_kernel
from pdserve.engine.quant.linear import INT4_KERNEL_ROWS, Int4Linear, int4_linear, quantize_weight
from pdserve.engine.quant.pack import Int4Parts, quantize_int4

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not int4_kernel.available(),
                       reason="native int4 kernel needs the built library, AMX-BF16 and AVX-512 VBMI"),
]


def _layer(n: int, k: int, seed: int) -> Int4Linear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    layer = quantize_weight(w.to(torch.bfloat16), "int4")
    assert isinstance(layer, Int4Linear)
    return layer


def _reference_weight(layer: Int4Linear) -> torch.Tensor:
    """The padded [N, K] weight in float64, each value as the kernel widens it, computed from
    the codes (unpacked by aten from the same bytes) and the layer's scales and offsets."""
    sz = layer.scales_and_zeros.double()  # [K / group, N, 2]
    n, k = sz.shape[1], sz.shape[0] * layer.group
    eye = torch.eye(k, dtype=torch.bfloat16)  # row j of W^T is e_j @ W^T: the codes' weights
    ones = torch.ones(k, n, 2, dtype=torch.bfloat16)
    codes = torch._weight_int4pack_mm_for_cpu(eye, layer.packed, layer.group,
                                              torch.stack([ones[::layer.group, :, 0],
                                                           torch.zeros(k // layer.group, n,
                                                                       dtype=torch.bfloat16)], -1))
    q = (codes.double() + 8).t()  # (q - 8) * 1 + 0 = q - 8, exact: the codes [N, K]
    scale = sz[..., 0].t().repeat_interleave(layer.group, 1)
    offset = sz[..., 1].t().repeat_interleave(layer.group, 1)
    return ((q - 8) * scale + offset).float().to(torch.bfloat16).double()


def _assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.t()
    tol = 2 ** -8 * ref.abs() + 2 ** -16 * (x.double().abs() @ w.abs().t())
    err = (y.double() - ref).abs()
    assert (err <= tol).all(), f"max error {err.max().item()} at {divmod(int(err.argmax()), err.shape[1])}"


@pytest.mark.parametrize("shape", [(200, 300), (64, 128), (192, 512)],
                         ids=["ragged-N-and-K", "one-block-one-group", "3-blocks-4-groups"])
def test_every_row_count_is_x_times_the_dequantized_weight(shape: tuple[int, int]) -> None:
    layer = _layer(*shape, seed=shape[0])
    w = _reference_weight(layer)
    k = w.shape[1]
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    full = int4_kernel.matmul(x, layer.packed, layer.scales_and_zeros, layer.group)
    assert full.shape == (300, w.shape[0]) and full.dtype == torch.bfloat16
    _assert_close(full, x, w)
    for m in range(1, 300):  # each row's sums do not depend on the rows around it
        assert torch.equal(int4_kernel.matmul(x[:m], layer.packed, layer.scales_and_zeros, layer.group),
                           full[:m]), f"{m} rows"


def test_rows_past_a_panel_of_x_run_in_panels_with_the_same_sums() -> None:
    layer = _layer(64, 2048, seed=9)  # 1 MiB of x is 256 rows of K = 2048: panels of 256
    w = _reference_weight(layer)
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = int4_kernel.matmul(x, layer.packed, layer.scales_and_zeros, layer.group)
    _assert_close(full, x, w)
    for m in (255, 256, 257, 288, 289):
        assert torch.equal(int4_kernel.matmul(x[:m], layer.packed, layer.scales_and_zeros, layer.group),
                           full[:m]), f"{m} rows"


def test_threads_split_the_channels_without_changing_a_bit() -> None:
    layer = _layer(448, 256, seed=3)  # 7 blocks of 64 channels: an uneven split
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    one = int4_kernel.matmul(x, layer.packed, layer.scales_and_zeros, layer.group)
    torch.set_num_threads(2)  # the one_torch_thread fixture restores the setting
    assert torch.equal(int4_kernel.matmul(x, layer.packed, layer.scales_and_zeros, layer.group), one)


@pytest.mark.parametrize("rows", [INT4_KERNEL_ROWS + 1, 33, 128, 257])
def test_layer_prefill_is_the_old_dequantize_then_matmul_within_bf16(rows: int) -> None:
    layer = _layer(200, 300, seed=5)
    x = torch.randn(2, rows, 300, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    y = layer(x)
    dense = layer.dense_weight(torch.bfloat16)  # the old path: the whole weight unpacked
    old = F.linear(F.pad(x, (0, dense.shape[1] - 300)), dense)[..., :200]
    assert y.shape == (2, rows, 200)
    _assert_close(y.reshape(-1, 200), F.pad(x, (0, dense.shape[1] - 300)).reshape(-1, dense.shape[1]),
                  _reference_weight(layer)[:200])
    assert ((y.float() - old.float()).abs() <= 2 ** -7 * old.float().abs() + 1e-2).all()


def test_act_order_layer_runs_the_kernel_on_permuted_inputs() -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(96, 256, generator=g) * 0.05
    perm = torch.randperm(256, generator=g)
    parts = quantize_int4(w[:, perm], 128)  # stored column j is input channel perm[j]
    layer = int4_linear([Int4Parts(parts.q, parts.scales, parts.zeros, 128, perm)], torch.bfloat16,
                        torch.device("cpu"))
    assert isinstance(layer, Int4Linear) and layer.perm is not None
    x = torch.randn(48, 256, generator=g).to(torch.bfloat16)
    _assert_close(layer(x), x[:, perm], _reference_weight(layer)[:96])
    float_ref = x.double() @ parts._replace(perm=perm).dequantize().double().t()  # un-permuted weight
    assert (layer(x).double() - float_ref).abs().max() <= 2e-2 * float_ref.abs().max()


def test_matmul_rejects_what_it_cannot_run() -> None:
    layer = _layer(64, 128, seed=8)
    sz, packed = layer.scales_and_zeros, layer.packed
    with pytest.raises(ValueError, match="bf16"):
        int4_kernel.matmul(torch.randn(4, 128), packed, sz, 128)  # float32
    with pytest.raises(ValueError, match="bf16"):
        int4_kernel.matmul(torch.randn(4, 96).bfloat16(), packed, sz, 128)  # K is not the weight's
    with pytest.raises(ValueError, match="cannot run"):
        int4_kernel.matmul(torch.randn(4, 128).bfloat16(), packed, sz[:, :32].contiguous(), 128)  # N 32
    assert not int4_kernel.runs(torch.randn(4, 128), sz, 128)
    assert int4_kernel.matmul(torch.randn(0, 128).bfloat16(), packed, sz, 128).shape == (0, 64)


def test_the_per_layer_bench_times_every_path() -> None:
    from bench.int4_gemm import PATHS, _row

    times = _row(128, 256, 4, reps=2)  # up to 4 rows: the GEMV too
    assert set(times) == {"bf16", *PATHS} and all(t > 0 for t in times.values())
    assert set(_row(128, 256, 8, reps=2)) == {"bf16", *PATHS} - {"gemv"}
