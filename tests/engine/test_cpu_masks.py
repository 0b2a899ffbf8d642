"""`PDSERVE_CPU_FEATURES` (pdserve/engine/kernels/cpu_features.py, pdserve/engine/kernels/_pd_cpu.h) and the kernel table
(pdserve/engine/kernels/table.py) under every CPU kind this host can emulate: the library runs as
that CPU would, each route only ever reaches a kernel that takes it (no error code), and
at bf16 every row of a linear and of paged attention has the same bits whatever else
shares the call, under each mask.

Between masks (docs/determinism.md): the emulated path (avx2, portable) equals the
AVX-512 BF16 path bit for bit; AMX tiles sum each 32-k chunk in their own order, so the
AMX path and the others agree within bf16 rounding, not bitwise."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from pdserve.engine.attention.native import NATIVE, InPlacePagedAttention
from pdserve.engine.attention.paged import build_metadata, order_chunks
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.kernels import bf16_gemv, cpu_features
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels import table as kernel_table
from pdserve.engine.kernels.table import LinearSpec
from pdserve.engine.quant import int8_kernel
from pdserve.engine.quant.linear import Int4Linear, Int8Linear, quantize_weight

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(native_kernels.LIB is None, reason="the native library is not built"),
]
HOST = native_kernels.features()
MASKS = tuple(dict.fromkeys(
    [m for m in ("amx", "-amx", "avx512", "avx2", "portable")
     if cpu_features.effective(m) <= HOST and (m != "amx" or "amx_bf16" in HOST)]))
"""Every CPU kind this host can run as (-amx: AVX-512 BF16 without AMX, the AMD EPYC kind)."""


@pytest.fixture(params=MASKS)
def mask(request: pytest.FixtureRequest) -> Iterator[frozenset[str]]:
    feats = cpu_features.effective(request.param) & HOST
    previous = native_kernels.set_features(feats)
    yield feats
    native_kernels.set_features(previous)


def test_the_python_feature_bits_are_the_c_headers() -> None:
    assert native_kernels.LIB is not None
    assert [native_kernels.LIB.pd_cpu_feature_bit(i) for i in range(len(cpu_features.FEATURES))] == [
        f.bit for f in cpu_features.FEATURES]


def test_the_setting_parses_levels_and_dropped_features() -> None:
    assert cpu_features.parse("") == cpu_features.ALL
    assert cpu_features.parse("-amx") == cpu_features.LEVELS["avx512_bf16"]
    assert cpu_features.parse("avx2") == {"avx2"} and cpu_features.parse("portable") == set()
    assert cpu_features.parse("-avx512") == {"avx2"}  # and everything that needs AVX-512
    assert cpu_features.parse("amx,-amx_int8") == cpu_features.ALL - {"amx_int8"}
    for bad in ("avx3", "-sse9"):
        with pytest.raises(ValueError, match="PDSERVE_CPU_FEATURES"):
            cpu_features.parse(bad)


def test_the_library_runs_as_the_masked_cpu(mask: frozenset[str]) -> None:
    assert native_kernels.features() == mask
    lib = native_kernels.LIB
    assert lib is not None
    assert bool(lib.pd_int8_gemm_amx_supported()) == ("amx_int8" in mask)
    assert bool(lib.pd_bf16_gemv_supported()) == ("avx512_bf16" in mask)
    x, w = torch.ones(2, 64).bfloat16(), torch.ones(32, 64).bfloat16()
    if "amx_bf16" not in mask:  # a forced path the CPU lacks is refused, never run
        with pytest.raises(ValueError, match="code 4"):
            bf16_gemv.gemv(x, w, None, bf16_gemv.AMX)


ROW_COUNTS = (1, 2, 3, 4, 5, 8, 16, 17, 33, 130)


@pytest.mark.parametrize("shape", [(768, 768), (100, 2049), (2048, 96)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_each_bf16_row_has_the_same_bits_whatever_shares_the_call(mask: frozenset[str],
                                                                   shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(max(ROW_COUNTS), k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    full = bf16_gemv.gemv(x, w, b)
    for m in ROW_COUNTS:
        assert torch.equal(bf16_gemv.gemv(x[:m], w, b), full[:m]), m
        assert torch.equal(bf16_gemv.gemv(x[m - 1 : m], w, b)[0], full[m - 1]), m
    torch.set_num_threads(2)  # the fixture restores one thread
    assert torch.equal(bf16_gemv.gemv(x, w, b), full)


def test_masks_agree_bitwise_without_amx_and_within_bf16_rounding_with_it() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(40, 1000, generator=g).bfloat16()
    w = (torch.randn(300, 1000, generator=g) * 0.05).bfloat16()
    ys = {}
    previous = native_kernels.set_features(HOST)
    try:
        for m in MASKS:
            native_kernels.set_features(cpu_features.effective(m) & HOST)
            ys[m] = bf16_gemv.gemv(x, w)
    finally:
        native_kernels.set_features(previous)
    exact = x.double() @ w.double().T
    bound = 2.0**-8 * exact.abs() + 2.0**-14 * (x.double().abs() @ w.double().abs().T)
    plain = [ys[m] for m in MASKS if m != "amx"]
    assert all(torch.equal(y, plain[0]) for y in plain)  # the emulation is exact
    for y in ys.values():
        assert bool(((y.double() - exact).abs() <= bound).all())


def test_every_route_runs_under_every_mask(mask: frozenset[str]) -> None:
    """Each layer's plan holds only kernels whose features the mask leaves, and a call of
    every bucket's row count succeeds (no kernel returns a code for a shape sent to it)."""
    torch.manual_seed(0)
    w = (torch.randn(128, 256) * 0.05).bfloat16()
    int4 = quantize_weight(w, "int4")
    int8 = quantize_weight(w, "int8")
    assert isinstance(int4, Int4Linear) and isinstance(int8, Int8Linear)
    int4_plan = int4.plan(torch.bfloat16)
    plans = [int4_plan, kernel_table.plan(bf16_gemv.SPEC)]
    if int8.native is not None:
        plans.append(int8.plan)
    for plan in plans:
        for route in plan.routes:
            assert route.kernel.features <= mask, route
    assert kernel_table.plan(bf16_gemv.SPEC).invariant
    for lo, _ in kernel_table.buckets("int4") + kernel_table.buckets("int8"):
        for rows in (lo, lo + 1):
            x = torch.randn(rows, 256).bfloat16()
            assert int4(x).shape == (rows, 128) and int8(x).shape == (rows, 128)
    if "avx512_vbmi" not in mask:
        assert int4_plan.kernel_for(1).name == "int4_aten"


def test_disabled_kernels_fall_through_to_the_next_entry() -> None:
    spec = LinearSpec("int4", "bfloat16", "cpu", 256, 128, 128)
    plan = kernel_table.plan(spec, disabled={"int4_gemv", "int4_gemm_amx", "int4_gemm_vnni"})
    assert plan.names() == ((1, 32, "int4_aten"), (33, kernel_table.INF, "int4_dequant"))
    if kernel_table.available_features() >= kernel_table.INT4_Q16:  # AMX off: the next entry takes 5+
        assert kernel_table.plan(spec, disabled={"int4_gemm_amx"}).kernel_for(5).name == "int4_gemm_vnni"
    assert kernel_table.plan(bf16_gemv.SPEC, disabled=set(bf16_gemv.NATIVE)).names() == (
        (1, kernel_table.INF, "bf16_aten"),)
    assert not kernel_table.plan(bf16_gemv.SPEC, disabled=set(bf16_gemv.NATIVE)).invariant
    reasons = kernel_table.reasons(spec, features=frozenset())
    assert reasons["int4_gemv"] is not None and "needs CPU features" in reasons["int4_gemv"]
    assert reasons["int4_aten"] is None


BS, KVH, HEADS, D = 16, 2, 6, 64


def test_attention_rows_are_the_same_bits_chunked_unchunked_cached_and_decoded(mask: frozenset[str]) -> None:
    """One sequence of 70 tokens: prefilled in one chunk, in chunks of 13, as a prefix-cache
    hit of 48 then a 22-token chunk, and token by token as decodes (beside another
    sequence's decode): every position's attention output is the same bits."""
    assert NATIVE is not None
    n, table = 70, list(range(1, 1 + math.ceil(70 / BS)))
    g = torch.Generator().manual_seed(11)
    q = torch.randn(n, HEADS, D, generator=g).bfloat16()
    k = torch.randn(n, KVH, D, generator=g).bfloat16()
    v = torch.randn(n, KVH, D, generator=g).bfloat16()
    other = SeqChunk([1], 29, [20, 21], True)
    backend = InPlacePagedAttention(NATIVE)

    def run(splits: list[int], with_other: bool = False) -> torch.Tensor:
        kc = torch.zeros(24, BS, KVH, D, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        kc[20:22], vc[20:22] = 0.5, 0.25
        outs, start = [], 0
        for end in splits:
            chunk = SeqChunk(list(range(end - start)), start, table, True)
            chunks = [other, chunk] if with_other else [chunk]
            meta = build_metadata(chunks, order_chunks(chunks), BS, torch.bfloat16, torch.device("cpu"),
                                  flat_decode=True)
            qs, ks, vs = q[start:end], k[start:end], v[start:end]
            if with_other:
                qs, ks, vs = (torch.cat([t[:1], t]) for t in (qs, ks, vs))
            out = backend.forward(qs, ks, vs, kc, vc, meta)
            outs.append(out[1:] if with_other else out)
            start = end
        return torch.cat(outs)

    whole = run([n])
    assert torch.equal(run(list(range(13, n, 13)) + [n]), whole)
    assert torch.equal(run([48, n]), whole)
    assert torch.equal(run(list(range(1, n + 1)), with_other=True), whole)


def test_the_int8_librarys_own_choice_is_the_tables(mask: frozenset[str]) -> None:
    """The C default (`choose_path`, pdserve/engine/kernels/_int8_gemm.c) and the table pick the same path
    for every row count, so the codes cannot drift apart."""
    plan = kernel_table.plan(LinearSpec("int8", "bfloat16"), features=mask)
    if not all(r.kernel.path for r in plan.routes):  # torch's int8 kernels: no packed copy at all
        assert not int8_kernel.packs_for(torch.bfloat16, torch.device("cpu"))
        return
    assert int8_kernel.packs_for(torch.bfloat16, torch.device("cpu"))
    lib = native_kernels.LIB
    assert lib is not None
    for m in (1, 4, 5, 16, 17, 300):
        assert int(lib.pd_int8_gemm_path(m)) == plan.kernel_for(m).path, m
