"""The native int4 GEMV (pdserve/engine/kernels/_int4_gemv.c) for decode's 1-4 rows: x @ W^T over the codes in
aten's CPU int4pack layout against a float64 reference of the exact dequantized weight
((q - 8) * scale + offset, codes unpacked by aten from the same bytes), for every group size
it takes and both scale dtypes; each row's result independent of the rows beside it and of
the thread count; NaN carried; and the layer that runs it for up to 4 rows.

Bound: one bf16 rounding of each output (2^-8 |ref|), the rows' fixed-point rounding (each
element by at most half a step, 2^-15 of its group of 64's largest, times |w|), and float32
arithmetic on each chunk's exact integer sums (K * 2^-22 (|x| @ |W|^T))."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pdserve.engine.kernels.table import INT4_VNNI_ROWS
from pdserve.engine.quant import int4_kernel
from pdserve.engine.quant.linear import INT4_KERNEL_ROWS, Int4Linear, quantize_weight
from pdserve.engine.quant.pack import quantize_int4

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not int4_kernel.gemv_available(),
                       reason="native int4 GEMV needs the built library and AVX-512 VBMI, VNNI, BF16"),
]
ACT_GROUP, ACT_MAX = 64, 16383  # pdserve/engine/kernels/_act_q16.h


def _layer(n: int, k: int, seed: int, group: int = 128) -> Int4Linear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w += 0.02 * torch.rand(n, 1, generator=torch.Generator().manual_seed(seed + 1))  # offsets matter
    layer = quantize_weight(w.to(torch.bfloat16), "int4")
    assert isinstance(layer, Int4Linear)
    if group != layer.group:  # the same weight in other groups, through the same packer
        parts = quantize_int4(w, group)
        layer = Int4Linear(parts, torch.bfloat16, torch.device("cpu"))
    return layer


def _exact_weight(layer: Int4Linear) -> torch.Tensor:
    """The padded [N, K] weight in float64: (q - 8) * scale + offset, unrounded."""
    sz = layer.scales_and_zeros.double()  # [K / group, N, 2]
    n, k = sz.shape[1], sz.shape[0] * layer.group
    eye = torch.eye(k, dtype=torch.bfloat16)
    unit = torch.stack([torch.ones(k // layer.group, n), torch.zeros(k // layer.group, n)], -1)
    codes = torch._weight_int4pack_mm_for_cpu(eye, layer.packed, layer.group, unit.to(torch.bfloat16))
    q = (codes.double() + 8).t()  # (q - 8) * 1 + 0, exact
    scale = sz[..., 0].t().repeat_interleave(layer.group, 1)
    offset = sz[..., 1].t().repeat_interleave(layer.group, 1)
    return (q - 8) * scale + offset


def _assert_within_bound(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    m, k = x.shape
    ref = x.double() @ w.t()
    groups = -(-k // ACT_GROUP)
    padded = torch.nn.functional.pad(x.double().abs(), (0, groups * ACT_GROUP - k))
    half_step = (padded.reshape(m, groups, ACT_GROUP).amax(dim=2) / (2 * ACT_MAX)).repeat_interleave(ACT_GROUP, 1)
    bound = 2**-8 * ref.abs() + half_step[:, :k] @ w.abs().t() + k * 2**-22 * (x.double().abs() @ w.abs().t())
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item()} over bound at {int((err - bound).argmax())}"


@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("shape", [(64, 256), (192, 768), (128, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_are_x_times_the_exact_weight_within_the_bound(shape: tuple[int, int], group: int) -> None:
    layer = _layer(*shape, seed=shape[1] + group, group=group)
    w = _exact_weight(layer)
    x = torch.randn(4, shape[1], generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
    x[2, 5] = 300.0  # an outlier coarsens only its own group of 64
    full = int4_kernel.gemv(x, layer.packed, layer.scales_and_zeros, group)
    assert full.shape == (4, w.shape[0]) and full.dtype == torch.bfloat16
    _assert_within_bound(full, x, w)
    for m in range(1, 5):  # a row's sums do not depend on the rows beside it
        assert torch.equal(int4_kernel.gemv(x[:m], layer.packed, layer.scales_and_zeros, group), full[:m])
        assert torch.equal(int4_kernel.gemv(x[m - 1:m], layer.packed, layer.scales_and_zeros, group), full[m - 1:m])


def test_float32_scales_give_the_bf16_scales_result() -> None:
    layer = _layer(128, 512, seed=3)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sz = layer.scales_and_zeros
    as_bf16 = int4_kernel.gemv(x, layer.packed, sz, layer.group)
    assert torch.equal(int4_kernel.gemv(x, layer.packed, sz.float(), layer.group), as_bf16)  # same values


def test_threads_split_the_channels_without_changing_a_bit() -> None:
    layer = _layer(448, 256, seed=4)  # 7 blocks of 64 channels: an uneven split
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    one = int4_kernel.gemv(x, layer.packed, layer.scales_and_zeros, layer.group)
    torch.set_num_threads(2)  # the one_torch_thread fixture restores the setting
    assert torch.equal(int4_kernel.gemv(x, layer.packed, layer.scales_and_zeros, layer.group), one)


def test_nan_in_a_row_reaches_only_that_row() -> None:
    layer = _layer(64, 256, seed=5)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[0, 200] = float("nan")
    y = int4_kernel.gemv(x, layer.packed, layer.scales_and_zeros, layer.group)
    assert y[0].isnan().all() and y[1].isfinite().all()


def test_the_layer_runs_the_route_the_kernel_table_gives_each_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GEMV up to 4 rows; above, the AMX GEMM where this CPU (as masked) has it, else the
    GEMV's arithmetic in register tiles (`int4_gemm_vnni`, to `INT4_VNNI_ROWS` rows) and
    unpack + matmul past it (pdserve/engine/kernels/table.py)."""
    layer = _layer(128, 256, seed=6)
    routes = layer.plan(torch.bfloat16)
    many = "int4_gemm_amx" if int4_kernel.available() else "int4_gemm_vnni"
    past = "int4_gemm_amx" if int4_kernel.available() else "int4_dequant"
    expected = {1: "int4_gemv", 4: "int4_gemv", 5: many, 40: many, INT4_VNNI_ROWS + 1: past}
    assert {m: routes.kernel_for(m).name for m in expected} == expected
    calls: list[tuple[str, int]] = []

    def spy(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, *args: object) -> torch.Tensor:
            calls.append((name, x.shape[0]))
            return fn(x, *args)
        return run

    kernels = {"int4_gemv": int4_kernel.gemv, "int4_gemm_amx": int4_kernel.matmul, "int4_gemm_vnni": int4_kernel.tiles}
    monkeypatch.setattr(int4_kernel, "gemv", spy("int4_gemv", kernels["int4_gemv"]))
    monkeypatch.setattr(int4_kernel, "matmul", spy("int4_gemm_amx", kernels["int4_gemm_amx"]))
    monkeypatch.setattr(int4_kernel, "tiles", spy("int4_gemm_vnni", kernels["int4_gemm_vnni"]))
    counts = (1, 2, 3, 4, 5, 16, 40, INT4_VNNI_ROWS + 1)
    for rows in counts:
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        y, name = layer(x), routes.kernel_for(rows).name
        if name in kernels:  # the layer adds nothing to the kernel's result
            assert torch.equal(y, kernels[name](x, layer.packed, layer.scales_and_zeros, layer.group))
        else:
            assert torch.equal(y, torch.nn.functional.linear(x, layer.dense_weight(torch.bfloat16)))
        if rows <= 4 or name == "int4_gemm_vnni":
            _assert_within_bound(y, x, _exact_weight(layer))
    assert INT4_KERNEL_ROWS == 4
    native = [(routes.kernel_for(m).name, m) for m in counts]
    assert calls == [c for c in native if c[0] in kernels]


def test_gemv_rejects_what_it_cannot_run() -> None:
    layer = _layer(64, 384, seed=7, group=128)
    sz, packed = layer.scales_and_zeros, layer.packed
    with pytest.raises(ValueError, match="cannot run 5 x 384"):
        int4_kernel.gemv(torch.randn(5, 384).bfloat16(), packed, sz, 128)  # more than 4 rows
    with pytest.raises(ValueError, match="bf16"):
        int4_kernel.gemv(torch.randn(1, 384), packed, sz, 128)  # float32
    assert not int4_kernel.gemv_runs(torch.randn(5, 384).bfloat16(), sz, 128)
    assert not int4_kernel.gemv_runs(torch.randn(1, 384).bfloat16(), sz, 96)  # neither 32 nor 64 | group
    assert int4_kernel.gemv_runs(torch.randn(1, 384).bfloat16(), sz, 128)
