"""The bf16 native fast paths against the torch ops the model ran before. The fused
residual add + RMSNorm rounds at the same points, so it is at most one bf16 ulp apart
(float32 summation order of the mean); the in-place rotary embedding is bit-identical;
float32 (and a missing library) goes through the torch ops unchanged."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.kernels import fused_ops
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
