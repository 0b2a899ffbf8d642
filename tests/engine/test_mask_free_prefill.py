"""Chunked / prefix-hit prefill attends without a dense [n, ctx] mask, and computes what
the dense-mask formulation computed."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention import chunk as chunk_attention
from pdserve.engine.attention import paged as attention
from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks
from pdserve.engine.core.runner_types import SeqChunk


def _dense_mask_reference(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
                          start: int) -> torch.Tensor:
    """What the backend computed before: a float additive [n, ctx] mask and enable_gqa."""
    n, ctx = q.shape[0], keys.shape[0]
    allowed = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]
    mask = torch.zeros(n, ctx, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                         vals.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_hit_and_later_chunk_match_the_dense_mask_without_building_one(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    bs, kvh, heads, d, nblocks = 16, 2, 6, 32, 64
    k_cache = torch.randn(nblocks, bs, kvh, d, dtype=dtype)
    v_cache = torch.randn(nblocks, bs, kvh, d, dtype=dtype)
    # A prefix-cache hit (37 cached tokens, 20 new) and a whole prompt in one step.
    hit = SeqChunk(list(range(20)), 37, list(range(1, 5)), True)
    whole = SeqChunk(list(range(9)), 0, [7], True)
    chunks = [hit, whole]

    def no_dense_mask(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a prefill chunk built a dense mask")

    monkeypatch.setattr(attention, "_additive", no_dense_mask)
    monkeypatch.setattr(chunk_attention, "dense_fallback", no_dense_mask)
    fused: list[bool] = []
    cpu_flash = chunk_attention._cpu_flash

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Any:
        fused.append(causal)
        return cpu_flash(q, k, v, causal)

    monkeypatch.setattr(chunk_attention, "_cpu_flash", spy)
    meta = build_metadata(chunks, order_chunks(chunks), bs, dtype, torch.device("cpu"))
    n = meta.num_tokens
    q = torch.randn(n, heads, d, dtype=dtype)
    k_new = torch.randn(n, kvh, d, dtype=dtype)
    v_new = torch.randn(n, kvh, d, dtype=dtype)
    out = TorchPagedAttention().forward(q, k_new, v_new, k_cache, v_cache, meta)

    # The prefix-hit chunk: two fused calls (its cached prefix unmasked, itself causal).
    assert fused == [False, True]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for p, c in zip(meta.prefills, chunks, strict=True):
        slots = torch.arange(c.end_pos)
        blocks = torch.tensor(c.block_table)[slots // bs]
        keys, vals = k_cache[blocks, slots % bs], v_cache[blocks, slots % bs]
        want = _dense_mask_reference(q[p.q_start:p.q_end], keys, vals, c.start_pos)
        torch.testing.assert_close(out[p.q_start:p.q_end], want, rtol=tol, atol=tol)
        assert math.isfinite(float(out[p.q_start:p.q_end].float().abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "start"), [(1, 30), (7, 1), (16, 48), (33, 5)])
def test_chunk_causal_attention_is_the_lower_right_causal_pattern(dtype: torch.dtype, n: int,
                                                                  start: int) -> None:
    torch.manual_seed(n * 100 + start)
    q = torch.randn(1, 8, n, 16, dtype=dtype)
    k = torch.randn(1, 2, start + n, 16, dtype=dtype)
    v = torch.randn(1, 2, start + n, 16, dtype=dtype)
    got = chunk_attention.chunk_causal_attention(q, k, v, start)
    want = chunk_attention.dense_fallback(q, k, v, start)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash attention's log-sum-exp)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "start"), [(1, 300), (64, 1000), (257, 33)])
def test_chunk_attention_on_cuda_merges_two_flash_calls(dtype: torch.dtype, n: int, start: int) -> None:
    gen = torch.Generator().manual_seed(n + start)
    q, k, v = (torch.randn(1, h, length, 128, generator=gen).to("cuda", dtype)
               for h, length in ((32, n), (8, start + n), (8, start + n)))
    assert chunk_attention.lse_attention(q) is chunk_attention._cuda_flash
    got = chunk_attention.chunk_causal_attention(q, k, v, start)
    want = chunk_attention.dense_fallback(q.float(), k.float(), v.float(), start)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
