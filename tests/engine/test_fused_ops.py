"""The bf16 native fast paths against the torch ops the model ran before. The fused
residual add + RMSNorm rounds at the same points, so it is at most one bf16 ulp apart
(float32 summation order of the mean); the in-place rotary embedding is bit-identical;
float32 (and a missing library) goes through the torch ops unchanged."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import cpu_features, fused_ops
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.models.llama import RMSNorm
from pdserve.engine.models.rope import RopeTables, apply_rope


def _norm(dtype: torch.dtype) -> RMSNorm:
    n = RMSNorm(768, 1e-5, dtype, torch.device("cpu"))
    n.weight.data = torch.randn(768, generator=torch.Generator().manual_seed(7)).to(dtype)
    return n


@pytest.mark.parametrize("rows", [1, 16, 500])
def test_bf16_fused_add_norm_rounds_where_the_torch_ops_round(rows: int) -> None:
    assert native_kernels.LIB is not None, "pdserve/engine/kernels/_cpu_kernels.c was not built (pip install -e .)"
    g = torch.Generator().manual_seed(rows)
    norm = _norm(torch.bfloat16)
    h = (torch.randn(rows, 768, generator=g) * 4).bfloat16()
    delta = torch.randn(rows, 768, generator=g).bfloat16()
    want_h = h + delta
    want = norm(want_h)
    h_in = h.clone()
    got_h, got = norm.add_forward(h_in, delta)
    assert got_h.data_ptr() == h_in.data_ptr()  # the residual is updated in place
    assert torch.equal(got_h, want_h)
    ulp = torch.maximum(want.float().abs(), torch.tensor(2.0**-126)) * 2.0**-7
    assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert (got != want).float().mean().item() < 1e-3



def test_bf16_fused_add_norm_has_the_same_bits_on_every_cpu_kind_and_for_every_row() -> None:
    """The AVX-512 elementwise loops (`residual_add16`, `scale_row16`) and the scalar ones
    (AVX2 and baseline clones) give the same residual and output bits, special values and a
    masked tail (dim 1000) included, and a row's bits do not depend on the rows beside it."""
    assert native_kernels.LIB is not None
    g = torch.Generator().manual_seed(11)
    norm = RMSNorm(1000, 1e-5, torch.bfloat16, torch.device("cpu"))
    norm.weight.data = torch.randn(1000, generator=g).bfloat16()
    h = (torch.randn(37, 1000, generator=g) * 4).bfloat16()
    delta = torch.randn(37, 1000, generator=g).bfloat16()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40,
                            3.0e38]).bfloat16()
    h[0, : special.numel()] = special
    delta[1, 990:998] = special

    def normed(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        got_h, got = fused_ops.add_rms_norm(h[rows].clone(), delta[rows].clone(), norm.weight, norm.eps, norm)
        return got_h.view(torch.int16), got.view(torch.int16)

    want_h, want = normed(slice(None))
    assert torch.equal(want_h, (h + delta).view(torch.int16))
    for row in (0, 1, 36):
        alone_h, alone = normed(slice(row, row + 1))
        assert torch.equal(alone_h, want_h[row: row + 1]) and torch.equal(alone, want[row: row + 1])
    host = native_kernels.features()
    for kind in ("avx2", "portable"):
        previous = native_kernels.set_features(cpu_features.effective(kind) & host)
        try:
            got_h, got = normed(slice(None))
            assert torch.equal(got_h, want_h) and torch.equal(got, want), kind
        finally:
            native_kernels.set_features(previous)

def test_float32_and_a_missing_library_take_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    norm = _norm(torch.float32)
    h, delta = torch.randn(4, 768, generator=g), torch.randn(4, 768, generator=g)
    got_h, got = norm.add_forward(h, delta)
    assert torch.equal(got_h, h + delta) and torch.equal(got, norm(h + delta))
    monkeypatch.setattr(native_kernels, "LIB", None)
    bnorm = _norm(torch.bfloat16)
    hb, db = h.bfloat16(), delta.bfloat16()
    got_h, got = fused_ops.add_rms_norm(hb, db, bnorm.weight, bnorm.eps, bnorm)
    assert torch.equal(got, bnorm(hb + db)) and torch.equal(hb, h.bfloat16())  # not in place
    cos = torch.ones(4, 1, 64, dtype=torch.bfloat16)
    assert fused_ops.rope_qk(torch.zeros(4, 20 * 64, dtype=torch.bfloat16), 12, 4, 64, cos, cos) is None


@pytest.mark.parametrize("tokens", [1, 16, 600])
def test_bf16_rope_in_place_equals_the_torch_rotation(tokens: int) -> None:
    assert native_kernels.LIB is not None, "pdserve/engine/kernels/_cpu_kernels.c was not built (pip install -e .)"
    tables = RopeTables(64, 500000.0, None, 2048, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(tokens)
    cos, sin = tables.lookup(torch.randint(0, 2048, (tokens,), generator=g))
    qkv = torch.randn(tokens, (12 + 2 * 4) * 64, generator=g).bfloat16()
    want = apply_rope(qkv[:, : 16 * 64].reshape(tokens, 16, 64), cos, sin)
    x = qkv.clone()
    qk = fused_ops.rope_qk(x, 12, 4, 64, cos, sin)
    assert qk is not None
    q, k = qk
    assert torch.equal(q, want[:, :12]) and torch.equal(k, want[:, 12:])
    assert q.data_ptr() == x.data_ptr()  # rotated in place in the projection's output
    assert torch.equal(x[:, 16 * 64 :], qkv[:, 16 * 64 :])  # v untouched



@pytest.mark.parametrize("head_dim", [64, 40])  # 40: each half's 20 elements end in a masked tail
def test_bf16_rope_has_the_same_bits_on_every_cpu_kind(head_dim: int) -> None:
    """The AVX-512 rotation (`rope_row16`) and the scalar one (AVX2 and baseline clones) give
    the same bits, special values included (NaN, infinities, signed zeros, denormals)."""
    assert native_kernels.LIB is not None
    tokens, heads = 33, 12 + 4
    tables = RopeTables(head_dim, 500000.0, None, 2048, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(head_dim)
    cos, sin = tables.lookup(torch.randint(0, 2048, (tokens,), generator=g))
    qkv = (torch.randn(tokens, (heads + 4) * head_dim, generator=g) * 3).bfloat16()
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40,
                            3.0e38, -3.0e38, 1e-30]).bfloat16()
    qkv[0, : special.numel()] = special
    qkv[-1, head_dim // 2: head_dim // 2 + special.numel()] = special.flip(0)

    def rotated() -> torch.Tensor:
        x = qkv.clone()
        assert fused_ops.rope_qk(x, 12, 4, head_dim, cos, sin) is not None
        return x.view(torch.int16)

    want, host = rotated(), native_kernels.features()
    assert not torch.equal(want, qkv.view(torch.int16))  # it rotated
    for kind in ("avx2", "portable"):
        previous = native_kernels.set_features(cpu_features.effective(kind) & host)
        try:
            assert torch.equal(rotated(), want), kind
        finally:
            native_kernels.set_features(previous)

def _gate_up(rows: int, inter: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).bfloat16()
    # The edges of silu's range and of bf16: NaN, infinities, signed zeros, denormals,
    # the clamp of exp's argument (|g| ~ 87..89) and values far past it.
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-40,
                            86.9, 87.1, -88.9, -89.5, 1e30, -1e30, 3.0e38, -3.0e38, 0.5]).bfloat16()
    gate_up[0, : special.numel()] = special
    gate_up[-1, inter: inter + special.numel()] = special.flip(0)
    return gate_up


def _torch_silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    gate, up = gate_up.split([inter, inter], dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize(("rows", "inter"), [(1, 2048), (7, 100), (300, 1376)])
def test_bf16_silu_mul_rounds_where_the_torch_ops_round(rows: int, inter: int) -> None:
    """silu(gate) * up rounded as torch's two bf16 ops round: within one bf16 ulp of the
    torch ops (their exp is not ours), nearly always the same bits, and the same NaNs."""
    assert native_kernels.LIB is not None
    gate_up = _gate_up(rows, inter, rows)
    got, want = fused_ops.silu_mul(gate_up, inter), _torch_silu_mul(gate_up, inter)
    assert got.shape == (rows, inter) and got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    g, w = got.float()[finite], want.float()[finite]
    ulp = torch.maximum(w.abs(), torch.tensor(2.0**-126)) * 2.0**-7
    assert bool(((g - w).abs() <= ulp).all() | (g == w).all())
    assert (g != w).float().mean().item() < 1e-3


def test_bf16_silu_mul_has_the_same_bits_on_every_cpu_kind_and_for_every_row() -> None:
    """The AVX-512 loop and the scalar one (AVX2 and baseline clones) give the same bits,
    and a row's activation is the same alone and in any batch."""
    assert native_kernels.LIB is not None
    inter = 1000  # not a multiple of 16: the vector loop's masked tail
    gate_up = _gate_up(37, inter, 3)
    host = native_kernels.features()
    want = fused_ops.silu_mul(gate_up, inter)
    for row in (0, 5, 36):
        alone = fused_ops.silu_mul(gate_up[row: row + 1].clone(), inter)
        assert torch.equal(alone.view(torch.int16), want[row: row + 1].view(torch.int16))
    for kind in ("avx2", "portable"):
        previous = native_kernels.set_features(cpu_features.effective(kind) & host)
        try:
            assert torch.equal(fused_ops.silu_mul(gate_up, inter).view(torch.int16), want.view(torch.int16)), kind
        finally:
            native_kernels.set_features(previous)


def test_silu_mul_off_the_native_path_is_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fused_ops.silu_mul(gate_up, 32), _torch_silu_mul(gate_up, 32))  # float32
    monkeypatch.setattr(native_kernels, "LIB", None)
    b = gate_up.bfloat16()
    assert torch.equal(fused_ops.silu_mul(b, 32), _torch_silu_mul(b, 32))
