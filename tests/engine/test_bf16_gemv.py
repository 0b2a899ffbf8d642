"""The native bf16 GEMV (pdserve/engine/kernels/_bf16_gemv.c, pdserve/engine/kernels/bf16_gemv.py): its numerics against
a float64 reference on each path (AVX-512 BF16 dot products, AMX tiles), the inputs it
takes and refuses, and the model's `linear` hook routing decode rows (and only those)
to it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from pdserve.common import envs
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.quant.linear import linear

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(not bf16_gemv.available(),
                       reason="the native bf16 GEMV needs the built library and AVX-512 BF16"),
]
# ragged N (not a multiple of 16 or of a channel block) and K (odd, < 32, a 32-tail)
SHAPES = [(768, 768), (37, 100), (17, 2049), (48, 33), (5, 7)]


def _tensors(n: int, k: int, m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + n * 131 + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    return x, w, b


def _assert_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within one bf16 rounding of the exact float64 result, plus float32 summation error
    (bounded by a small multiple of the sum of |products|)."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T
    err = (y.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 2.0**-14 * scale + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max():.3g}"


def _paths() -> Iterator[tuple[str, int]]:
    yield from bf16_gemv.paths().items()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gemv_matches_float64_reference_within_bf16_on_every_path(shape: tuple[int, int]) -> None:
    n, k = shape
    for name, path in _paths():
        for m in range(1, bf16_gemv.ROWS + 1):
            x, w, b = _tensors(n, k, m)
            _assert_close(bf16_gemv.gemv(x, w, None, path), x, w, None)
            y = bf16_gemv.gemv(x, w, b, path)
            _assert_close(y, x, w, b)
            # a row's output does not depend on the rows beside it (batch composition)
            assert torch.equal(bf16_gemv.gemv(x[-1:], w, b, path)[0], y[-1]), (name, m)


def test_default_path_is_batch_invariant_and_thread_count_invariant() -> None:
    x, w, b = _tensors(1280, 768, bf16_gemv.ROWS)
    alone = torch.cat([bf16_gemv.gemv(x[i : i + 1], w, b) for i in range(x.shape[0])])
    for m in (2, 5, 8, bf16_gemv.ROWS):
        assert torch.equal(bf16_gemv.gemv(x[:m], w, b), alone[:m])
    torch.set_num_threads(2)  # the fixture restores one thread
    assert torch.equal(bf16_gemv.gemv(x, w, b), alone)


@pytest.mark.skipif("avx" not in bf16_gemv.paths(), reason="the prefill tiles need AVX-512 BF16")
@pytest.mark.parametrize("shape", [(37, 100), (13, 2049), (768, 768), (7, 31)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_prefill_tiles_are_the_bits_of_the_decode_tiles_and_the_emulation(shape: tuple[int, int]) -> None:
    """From TILE_ROWS rows the AVX-512 BF16 path runs 4 x 6 register tiles (_bf16_tiles.c), with
    ragged edges (M % 4, N % 6, a K tail) on the decode tiles: every M gives each row the bits
    of the decode tiles (tiles off), of the float32 emulation and of that row alone."""
    n, k = shape
    x, w, b = _tensors(n, k, 70, seed=3)
    strided = torch.cat([x, x], dim=1)[:, :k]  # rows ldx = 2k apart, read in place
    alone = torch.cat([bf16_gemv.gemv(x[i : i + 1], w, b, bf16_gemv.AVX) for i in range(70)])
    was = bf16_gemv.set_tiles(False)
    try:
        untiled = bf16_gemv.gemv(x, w, b, bf16_gemv.AVX)
    finally:
        bf16_gemv.set_tiles(was)
    assert was and torch.equal(untiled, alone)
    for m in (*range(1, 25), 31, 33, 47, 64, 70):
        for bias in (None, b):
            y = bf16_gemv.gemv(x[:m], w, bias, bf16_gemv.AVX)
            assert torch.equal(y, bf16_gemv.gemv(x[:m], w, bias, bf16_gemv.EMUL)), (m, bias is None)
            if bias is not None:
                assert torch.equal(y, alone[:m]), m
                assert torch.equal(bf16_gemv.gemv(strided[:m], w, bias, bf16_gemv.AVX), y), m
    special = x.clone()
    special[5, 0], special[6, 1], special[7, :2] = float("nan"), float("inf"), 1e-39  # NaN, inf, denormal
    special[8] = -0.0  # a -0.0 sum: + 0.0 (no bias) makes it +0.0 on every path
    assert torch.equal(bf16_gemv.gemv(special, w, None, bf16_gemv.AVX).view(torch.int16),
                       bf16_gemv.gemv(special, w, None, bf16_gemv.EMUL).view(torch.int16))


def test_row_strided_input_is_read_in_place_and_column_strided_is_refused() -> None:
    big = torch.randn(4, 2 * 300).to(torch.bfloat16)
    w = (torch.randn(40, 300) * 0.05).to(torch.bfloat16)
    rows = big[:, 100:400]  # rows 600 apart, columns contiguous
    assert not rows.is_contiguous()
    _assert_close(bf16_gemv.gemv(rows, w), rows, w, None)
    assert torch.equal(bf16_gemv.gemv(rows, w), bf16_gemv.gemv(rows.contiguous(), w))
    cols = big[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        bf16_gemv.gemv(cols, w)
    assert torch.equal(linear(cols, w, None), F.linear(cols, w))  # the hook falls back


@pytest.mark.parametrize("bad", ["float32", "rows0", "rows0_2d", "k_mismatch", "bias_shape", "weight_t"])
def test_bad_input_is_a_clear_error(bad: str) -> None:
    x, w, b = _tensors(32, 64, 2)
    args: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] = {
        "float32": (x.float(), w.float(), None),
        "rows0": (x[:0], w, None),
        "rows0_2d": (torch.zeros(0, 64, dtype=torch.bfloat16), w, None),
        "k_mismatch": (x[:, :63], w, None),
        "bias_shape": (x, w, b[:31]),
        "weight_t": (x[:, :32], w.T, None),
    }[bad]
    with pytest.raises(ValueError, match="bf16 GEMV"):
        bf16_gemv.gemv(*args)
    _assert_close(bf16_gemv.gemv(x, w, b), x, w, b)  # and the next call still works


class _Counting:
    """The native library, counting calls of the GEMV (and looks-ups of every symbol)."""

    def __init__(self, lib: object) -> None:
        self.lib, self.calls, self.looked_up = lib, 0, Counter[str]()

    def __getattr__(self, name: str) -> object:
        fn = getattr(self.lib, name)
        self.looked_up[name] += 1
        if name != "pd_bf16_gemv":
            return fn

        def call(*args: object) -> object:
            self.calls += 1
            return fn(*args)

        return call


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Counting]:
    wrapper = _Counting(native_kernels.LIB)
    monkeypatch.setattr(native_kernels, "LIB", wrapper)
    was = bf16_gemv.set_enabled(True)
    yield wrapper
    bf16_gemv.set_enabled(was)


def test_linear_hook_runs_the_kernel_for_every_bf16_row_count(counting: _Counting) -> None:
    """One table entry for every row count (pdserve/engine/kernels/table.py): decode rows, a prefill
    chunk and a whole prompt all take the kernel, so no row's bits depend on M."""
    assert bf16_gemv.kernel() in bf16_gemv.NATIVE and bf16_gemv.PLAN.invariant
    x, w, b = _tensors(256, 128, 40)
    for m in (1, 2, 3, 17, 40):
        calls = counting.calls
        y = linear(x[:m], w, b)
        assert counting.calls == calls + 1 and torch.equal(y, bf16_gemv.gemv(x[:m], w, b))
        assert torch.equal(y[-1], linear(x[m - 1 : m], w, b)[0])
    y3 = linear(x[:2].reshape(1, 2, 128), w, None)  # leading dims are flattened, then restored
    assert y3.shape == (1, 2, 256) and torch.equal(y3.reshape(2, 256), bf16_gemv.gemv(x[:2], w))
    calls = counting.calls
    # float32 and autograd keep F.linear, bit for bit
    assert torch.equal(linear(x[:2].float(), w.float(), None), F.linear(x[:2].float(), w.float()))
    wg = w.clone().requires_grad_(True)
    assert torch.equal(linear(x[:2], wg, None).detach(), F.linear(x[:2], w))
    assert counting.calls == calls
    bf16_gemv.set_enabled(False)  # what PDSERVE_BF16_GEMV=0 sets at import
    assert torch.equal(linear(x[:2], w, b), F.linear(x[:2], w, b)) and counting.calls == calls


def test_amx_calls_leave_torch_matmuls_untouched() -> None:
    """Both configure the thread's AMX tiles: a matmul after the kernel is the one before."""
    x, w, _ = _tensors(512, 768, 64)
    before = F.linear(x, w)
    for m in (1, 5, bf16_gemv.ROWS):
        bf16_gemv.gemv(x[:m], w)
        assert torch.equal(F.linear(x, w), before)


def test_env_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_BF16_GEMV", raising=False)
    assert envs.bf16_gemv()  # default on
    monkeypatch.setenv("PDSERVE_BF16_GEMV", "0")
    assert not envs.bf16_gemv()


def test_bench_times_every_path() -> None:
    """A fast run of bench/bf16_gemv.py's own timing code (the bench runs it per 125M shape)."""
    from bench.bf16_gemv import shape_row

    t = shape_row(64, 96, 2, reps=1)
    assert set(t) == {"F.linear", "hook", "emulated"} | ({"amx"} if bf16_gemv.amx_rows() else set()) | (
        {"avx"} if "avx512_bf16" in native_kernels.features() else set())
    assert all(v > 0 for v in t.values())


def test_linear_calls_the_kernel_unchecked(counting: _Counting, monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear`'s route test already covers what `gemv` checks, so a decode linear does not
    pay for the checks twice: it runs with `gemv` itself out of the way."""
    x, w, b = _tensors(64, 96, 2)
    expected = bf16_gemv.gemv(x, w, b)
    calls = counting.calls

    def checked(*_: object) -> torch.Tensor:
        raise AssertionError("linear went through the checked gemv")

    monkeypatch.setattr(bf16_gemv, "gemv", checked)
    assert torch.equal(linear(x, w, b), expected) and counting.calls == calls + 1


def test_linear_leaves_what_the_kernel_cannot_take_to_f_linear(counting: _Counting) -> None:
    """Inputs `gemv` would refuse never reach the unchecked call: F.linear runs (or raises) instead."""
    x, w, b = _tensors(64, 96, 2)
    with pytest.raises(RuntimeError):
        linear(x, w, b[:10])  # a bias of the wrong length is F.linear's error, not a wild read
    assert torch.equal(linear(x, w.t().contiguous().t(), b), F.linear(x, w, b))  # strided weight
    assert counting.calls == 0


def test_route_is_fixed_at_import(counting: _Counting) -> None:
    """The route is the table's choice cached at import: a call asks the library nothing else."""
    x, w, _ = _tensors(64, 96, 3)
    linear(x, w, None)
    assert set(counting.looked_up) == {"pd_bf16_gemv"}
