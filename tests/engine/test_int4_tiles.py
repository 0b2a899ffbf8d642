"""The int4 GEMM of CPUs without AMX (pdserve/engine/kernels/_int4_tiles.c, `int4_gemm_vnni`): the int4
GEMV's arithmetic in register tiles over many rows. Every row it returns is the GEMV's row bit
for bit, whatever the row count, the rows beside it or the thread count, so an int4 layer's
rows are the same bits in the 1-4 row bucket (the GEMV) and the 5+ one; against a float64
reference of the exact dequantized weight within the GEMV's bound (tests/engine/test_int4_gemv.py);
routed by the kernel table for 5 to `INT4_VNNI_ROWS` rows where the CPU (as masked) has
AVX-512 VNNI, VBMI and BF16, and never the aten fallback there; gone under `avx2` and
`portable`, where those rows run aten's kernel; and an int4 bf16 engine whose decoded
logprobs are the bits a re-prefill of the same text gives."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine.kernels import cpu_features
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels import table as kernel_table
from pdserve.engine.quant import int4_kernel
from pdserve.engine.quant.linear import Int4Linear
from pdserve.engine.quant.pack import quantize_int4
from tests.engine.test_int4_gemv import _assert_within_bound, _exact_weight, _layer

ROOT = Path(__file__).resolve().parents[2]
HOST = native_kernels.features()
WITH = tuple(
    m
    for m in ("amx", "-amx")
    if cpu_features.effective(m) & HOST >= kernel_table.INT4_Q16
    and (m != "amx" or "amx_bf16" in HOST)
)
"""The CPU kinds this host can run as that have the kernel (-amx: the AMD EPYC kind)."""
WITHOUT = ("avx512", "avx2", "portable")
VNNI_ROWS = kernel_table.INT4_VNNI_ROWS

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not int4_kernel.tiles_available(),
        reason="the int4 VNNI GEMM needs the built library and AVX-512 VNNI, VBMI, BF16",
    ),
]


@pytest.fixture(params=WITH)
def mask(request: pytest.FixtureRequest) -> Iterator[frozenset[str]]:
    """The library masked to a CPU kind that has the kernel."""
    previous = native_kernels.set_features(cpu_features.effective(request.param) & HOST)
    yield native_kernels.features()
    native_kernels.set_features(previous)


@pytest.fixture(params=WITHOUT)
def lacking(request: pytest.FixtureRequest) -> Iterator[frozenset[str]]:
    """The library masked to a CPU kind without the kernel."""
    previous = native_kernels.set_features(cpu_features.effective(request.param) & HOST)
    yield native_kernels.features()
    native_kernels.set_features(previous)


def _tiles(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    return int4_kernel.tiles(x, layer.packed, layer.scales_and_zeros, layer.group)


def _gemv(x: torch.Tensor, layer: Int4Linear) -> torch.Tensor:
    return int4_kernel.gemv(x, layer.packed, layer.scales_and_zeros, layer.group)


@pytest.mark.parametrize(
    "shape, group",
    [((64, 96), 32), ((192, 768), 64), ((448, 2048), 128), ((128, 512), 256)],
    ids=["K96-group32", "3-blocks-group64", "7-blocks-group128", "group256"],
)
def test_every_row_is_the_gemv_row_bit_for_bit(
    mask: frozenset[str], shape: tuple[int, int], group: int
) -> None:
    layer = _layer(*shape, seed=shape[0] + group, group=group)
    k = shape[1]
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
    x[7, 3] = 300.0  # an outlier coarsens only its own row's group of 64
    full = _tiles(x, layer)
    assert full.shape == (40, layer.scales_and_zeros.shape[1]) and full.dtype == torch.bfloat16
    _assert_within_bound(full, x, _exact_weight(layer))
    for i in range(0, 40, 4):  # the GEMV, 1 and 4 rows at a time, gives every row's bits
        assert torch.equal(_gemv(x[i : i + 4], layer), full[i : i + 4]), i
        assert torch.equal(_gemv(x[i : i + 1], layer), full[i : i + 1]), i
    for m in range(1, 41):  # and the GEMM's rows do not depend on how many share the call
        assert torch.equal(_tiles(x[:m], layer), full[:m]), f"{m} rows"
        assert torch.equal(_tiles(x[m - 1 : m], layer), full[m - 1 : m]), f"row {m - 1} alone"


def test_rows_past_a_panel_and_threads_change_no_bit() -> None:
    layer = _layer(448, 256, seed=4)  # 7 blocks of 64 channels: an uneven split over 2 threads
    x = torch.randn(150, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    one = _tiles(x, layer)  # 150 rows: several panels of rows, a ragged last one
    rows = torch.cat([_gemv(x[i : i + 1], layer) for i in range(150)])
    assert torch.equal(one, rows)
    torch.set_num_threads(2)  # the one_torch_thread fixture restores the setting
    assert torch.equal(_tiles(x, layer), one)
    assert torch.equal(_tiles(x[:37], layer), one[:37])


def test_float32_scales_give_the_bf16_scales_result() -> None:
    layer = _layer(128, 512, seed=3)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sz = layer.scales_and_zeros
    as_bf16 = _tiles(x, layer)
    assert torch.equal(
        int4_kernel.tiles(x, layer.packed, sz.float(), layer.group), as_bf16
    )  # same values


def test_nan_in_a_row_reaches_only_that_row() -> None:
    layer = _layer(64, 256, seed=5)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[4, 200] = float("nan")
    y = _tiles(x, layer)
    assert y[4].isnan().all() and y[[0, 1, 2, 3, 5, 6]].isfinite().all()


@pytest.mark.parametrize("group", [32, 128])
def test_an_uneven_layer_is_the_exact_weight_and_its_rows_match_across_buckets(
    mask: frozenset[str], group: int
) -> None:
    """N 200 (padded to 256) and K 300 (padded to the group): the layer's output for 5-40
    rows is x times the exact weight within the bound, and each row the bits it has alone
    (the GEMV's bucket)."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(group)) * 0.05
    parts = quantize_int4(
        torch.nn.functional.pad(w, (0, -300 % group)), group
    )  # as quantize_weight pads K
    layer = Int4Linear(parts._replace(q=parts.q[:, :300]), torch.bfloat16, torch.device("cpu"))
    assert layer.pad_k == -300 % group
    exact = _exact_weight(layer)[:200, :300]
    x = torch.randn(40, 300, generator=torch.Generator().manual_seed(group + 1)).to(torch.bfloat16)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for m in (5, 6, 7, 16, 32, 33, 40):
        y = layer(x[:m])
        assert y.shape == (m, 200)
        _assert_within_bound(y, x[:m], exact)
        assert torch.equal(y, alone[:m]), f"{m} rows"
    assert torch.equal(layer(x.reshape(2, 20, 300)).reshape(40, 200), alone)


def test_the_table_routes_5_to_the_bound_rows_to_it_and_never_to_aten(
    mask: frozenset[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = _layer(
        128, 256, seed=6
    )  # built and first called under the mask: its routes are the mask's
    plan = layer.plan(torch.bfloat16)
    if (
        "amx_bf16" in mask
    ):  # AMX hosts keep their AMX GEMM for 5+ rows; the -amx run covers this kernel
        assert plan.kernel_for(5).name == "int4_gemm_amx"
        return
    assert plan.names() == (
        (1, 4, "int4_gemv"),
        (5, VNNI_ROWS, "int4_gemm_vnni"),
        (VNNI_ROWS + 1, kernel_table.INF, "int4_dequant"),
    )
    calls: list[int] = []
    tiles = int4_kernel.tiles

    def spy(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, group: int) -> torch.Tensor:
        calls.append(x.shape[0])
        return tiles(x, packed, sz, group)

    def aten(*args: object) -> torch.Tensor:
        raise AssertionError("an int4 layer fell back to aten's kernel")

    monkeypatch.setattr(int4_kernel, "tiles", spy)
    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", aten)
    rows = (5, 8, 16, 32, VNNI_ROWS)
    for m in rows:
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        assert torch.equal(layer(x), tiles(x, layer.packed, layer.scales_and_zeros, layer.group))
    assert calls == list(rows)
    layer(
        torch.randn(VNNI_ROWS + 1, 256).bfloat16()
    )  # past the bound: unpack + matmul, still not aten
    assert calls == list(rows)


def test_without_vnni_vbmi_or_bf16_the_entry_is_gone_and_aten_takes_the_rows(
    lacking: frozenset[str],
) -> None:
    layer = _layer(128, 256, seed=8)
    names = layer.plan(torch.bfloat16).names()
    assert all(name != "int4_gemm_vnni" for _, _, name in names)
    assert layer.plan(torch.bfloat16).kernel_for(5).name == "int4_aten"
    spec = kernel_table.LinearSpec("int4", "bfloat16", "cpu", 256, 128, 128)
    assert "needs CPU features" in (kernel_table.reasons(spec)["int4_gemm_vnni"] or "")
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    assert torch.equal(
        layer(x),
        torch._weight_int4pack_mm_for_cpu(x, layer.packed, layer.group, layer.scales_and_zeros),
    )
    with pytest.raises(ValueError, match="code 4"):  # the kernel itself refuses this CPU
        _tiles(x, layer)


@pytest.mark.parametrize("setting", ["avx2", "portable", ""])
def test_the_setting_at_load_decides_the_route(setting: str) -> None:
    """`PDSERVE_CPU_FEATURES` read when a worker starts: the entry vanishes under avx2 and
    portable, and is there unmasked on this CPU (unless it has AMX, whose GEMM comes first)."""
    code = (
        "import torch; from pdserve.engine.kernels import table; "
        "print(table.plan(table.LinearSpec('int4', 'bfloat16', 'cpu', 768, 1280, 128)).kernel_for(16).name)"
    )
    env = {**os.environ, "PDSERVE_CPU_FEATURES": setting, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()[-1]
    expected = (
        "int4_aten" if setting else ("int4_gemm_amx" if "amx_bf16" in HOST else "int4_gemm_vnni")
    )
    assert out == expected


def test_the_per_layer_bench_times_it() -> None:
    from bench.int4_gemm import PATHS, _row

    at8 = _row(128, 256, 8, reps=2)
    assert "vnni" in at8 and "gemv" not in at8 and set(at8) <= {"bf16", *PATHS}
    assert {"gemv", "vnni"} <= set(_row(128, 256, 4, reps=2)) and all(t > 0 for t in at8.values())


def test_an_int4_bf16_engine_decodes_the_bits_a_re_prefill_gives(
    tiny_model_dir: Callable[..., Path],
) -> None:
    """End to end (engine, int4 weights, bf16, a bf16 LM head): each generated token's
    logprob, computed by a decode step (1 row: the GEMV), equals the prompt logprob of
    the same position when prompt + generated is prefilled at once (tens of rows: the
    tiles), bit for bit; and a batch of prompts prefilled together gives each the tokens
    and logprobs it gets alone. What a recovery (re-prefill on another worker) relies on."""
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model_dir=str(tiny_model_dir("llama")),
        dtype="bfloat16",
        num_threads=1,
        quantization="int4",
        lm_head_quantization="none",
        cache=CacheConfig(block_size=16, num_blocks=64),
    )
    engine = LLMEngine(config)
    prompts = [[1, *range(40, 60)], [1, *range(90, 102)], [1, 5, 6, 7, 8, 9, 10]]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
    alone = [engine.generate([p], params)[0] for p in prompts]
    together = engine.generate(prompts, params)
    for a, t in zip(alone, together, strict=True):
        assert t.choices[0] == a.choices[0]
    first = alone[0]
    text = prompts[0] + list(first.token_ids)
    again = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    (full,) = LLMEngine(config).generate([text], again)  # a fresh engine: no prefix cache
    assert full.prompt_logprobs is not None
    decoded = [lp.logprob for lp in first.choices[0].logprobs or ()]
    prefilled = [lp.logprob for lp in full.prompt_logprobs[len(prompts[0]) :]]  # type: ignore[union-attr]
    assert prefilled == decoded
