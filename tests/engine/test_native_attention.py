"""In-place paged decode attention (pdserve/engine/kernels/_cpu_kernels.c) against a direct softmax over
each sequence's own keys, the torch backend, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.attention import native as native_attention
from pdserve.engine.attention.native import InPlacePagedAttention, NativeAttention, default_backend
from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks
from pdserve.engine.core.runner_types import SeqChunk

BS, KVH, HEADS, D, NBLOCKS = 16, 2, 6, 64, 600


@pytest.fixture(scope="module")
def native() -> NativeAttention:
    # `make install` / `pip install -e .` builds it; a missing build is a failure, not a skip.
    assert native_attention.NATIVE is not None, "pdserve/engine/kernels/_cpu_kernels.c was not built (pip install -e .)"
    return native_attention.NATIVE


def _setup(ctx: list[int], dtype: torch.dtype, seed: int = 0) -> tuple[list[SeqChunk], torch.Tensor,
                                                                       torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NBLOCKS, BS, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(NBLOCKS, BS, KVH, D, generator=g).to(dtype)
    k_cache[0] = 1e4  # the null block: padding must never reach the output
    v_cache[0] = 1e4
    perm = (torch.randperm(NBLOCKS - 1, generator=g) + 1).tolist()  # fragmented tables
    chunks, taken = [], 0
    for n in ctx:
        nb = math.ceil(n / BS)
        chunks.append(SeqChunk([1], n - 1, perm[taken:taken + nb], True))
        taken += nb
    return chunks, k_cache, v_cache


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, c: SeqChunk) -> torch.Tensor:
    """float64 softmax attention of one decode over its own keys only."""
    n = c.start_pos + 1
    slots = torch.arange(n)
    blocks = torch.tensor(c.block_table)[slots // BS]
    keys = k_cache[blocks, slots % BS].double()
    vals = v_cache[blocks, slots % BS].double()
    qh = q.double().view(KVH, HEADS // KVH, D)
    scores = torch.einsum("kgd,tkd->kgt", qh, keys) / math.sqrt(D)
    return torch.einsum("kgt,tkd->kgd", scores.softmax(-1), vals).reshape(-1)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_decode_equals_softmax_over_each_sequences_own_keys(
    native: NativeAttention, dtype: torch.dtype, tol: float
) -> None:
    ctx = [40, 1500, 17, 700, 1, 250, 16, 33]  # lengths on and off block boundaries
    chunks, k_cache, v_cache = _setup(ctx, dtype)
    order = order_chunks(chunks)
    meta = build_metadata(chunks, order, BS, dtype, torch.device("cpu"), flat_decode=True)
    g = torch.Generator().manual_seed(1)
    # q as the model hands it over: a view into the qkv projection, rows apart.
    q = torch.randn(len(ctx), HEADS + 2 * KVH, D, generator=g).to(dtype)[:, :HEADS]
    k_new = torch.randn(len(ctx), KVH, D, generator=g).to(dtype)
    v_new = torch.randn(len(ctx), KVH, D, generator=g).to(dtype)
    out = InPlacePagedAttention(native).forward(q, k_new, v_new, k_cache, v_cache, meta)
    assert out.dtype == dtype and out.shape == (len(ctx), HEADS * D)
    for row, i in enumerate(order):
        want = _reference(q[row], k_cache, v_cache, chunks[i])
        # bf16: one rounding of the output (2^-8 relative) on values of magnitude <~ 3.
        torch.testing.assert_close(out[row].double(), want, rtol=tol, atol=tol)


def test_bf16_matches_the_gather_backend_within_one_rounding(native: NativeAttention) -> None:
    ctx = [300, 64, 900, 129]
    chunks, k_cache, v_cache = _setup(ctx, torch.bfloat16, seed=3)
    order = order_chunks(chunks)
    q = torch.randn(len(ctx), HEADS, D).bfloat16()
    k_new = torch.randn(len(ctx), KVH, D).bfloat16()
    v_new = torch.randn(len(ctx), KVH, D).bfloat16()
    dev = torch.device("cpu")
    grouped = build_metadata(chunks, order, BS, torch.bfloat16, dev)
    flat = build_metadata(chunks, order, BS, torch.bfloat16, dev, flat_decode=True)
    want = TorchPagedAttention().forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), grouped)
    got = InPlacePagedAttention(native).forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(), flat)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)


def test_prefill_chunks_beside_decodes_go_through_the_torch_path(native: NativeAttention) -> None:
    chunks, k_cache, v_cache = _setup([50, 20], torch.float32, seed=5)
    chunks.append(SeqChunk(list(range(10)), 30, chunks[0].block_table[:3], True))  # a later chunk
    order = order_chunks(chunks)
    t = 1 + 1 + 10
    q, k_new, v_new = torch.randn(t, HEADS, D), torch.randn(t, KVH, D), torch.randn(t, KVH, D)
    dev = torch.device("cpu")
    want = TorchPagedAttention().forward(q, k_new, v_new, k_cache.clone(), v_cache.clone(),
                                         build_metadata(chunks, order, BS, torch.float32, dev))
    got = InPlacePagedAttention(native).forward(
        q, k_new, v_new, k_cache.clone(), v_cache.clone(),
        build_metadata(chunks, order, BS, torch.float32, dev, flat_decode=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_block_ids_and_lengths_are_refused_not_read(native: NativeAttention) -> None:
    _, k_cache, v_cache = _setup([1], torch.bfloat16)
    q = torch.randn(1, HEADS, D).bfloat16()
    lens = torch.tensor([20])
    for table in ([[NBLOCKS, 3]], [[-1, 3]], [[3, 10**12]]):
        with pytest.raises(ValueError, match="block id outside the pool"):
            native.decode(q, k_cache, v_cache, torch.tensor(table), lens, 2)
    with pytest.raises(ValueError, match="context length"):  # 40 keys, 2 blocks of 16
        native.decode(q, k_cache, v_cache, torch.tensor([[3, 4]]), torch.tensor([40]), 2)
    with pytest.raises(ValueError, match="int64"):
        native.decode(q, k_cache, v_cache, torch.tensor([[3, 4]], dtype=torch.int32), lens, 2)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        native.decode(q.half(), k_cache.half(), v_cache.half(), torch.tensor([[3, 4]]), lens, 2)
    with pytest.raises(ValueError, match="heads of each row contiguous"):
        native.decode(q.transpose(1, 2).contiguous().transpose(1, 2), k_cache, v_cache,
                      torch.tensor([[3, 4]]), lens, 2)
    with pytest.raises(ValueError, match="head_dim"):
        native.decode(q[..., :32].contiguous(), k_cache, v_cache, torch.tensor([[3, 4]]), lens, 2)


def test_default_backend_is_in_place_for_bf16_on_cpu_only(native: NativeAttention) -> None:
    cpu = torch.device("cpu")
    assert isinstance(default_backend(torch.bfloat16, cpu), InPlacePagedAttention)
    assert type(default_backend(torch.float32, cpu)) is TorchPagedAttention  # float32 stays exact
    assert type(default_backend(torch.float16, cpu)) is TorchPagedAttention
