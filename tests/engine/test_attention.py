"""Paged decode attention against a direct softmax over each sequence's own keys."""

from __future__ import annotations

import math

import torch

from pdserve.engine.attention.paged import (
    TorchPagedAttention,
    build_metadata,
    decode_groups,
    order_chunks,
)
from pdserve.engine.core.runner_types import SeqChunk


def test_decode_groups_split_only_far_apart_long_contexts() -> None:
    assert decode_groups([100, 1516, 150, 230, 3000]) == [[0, 2, 3], [1, 4]]
    assert decode_groups([5, 256, 7]) == [[0, 2, 1]]  # short contexts never split
    assert decode_groups([300, 600, 601]) == [[0, 1], [2]]
    assert decode_groups([42]) == [[0]]


def test_mixed_context_lengths_decode_like_each_sequence_alone() -> None:
    torch.manual_seed(0)
    bs, kvh, heads, d, nblocks = 16, 2, 6, 32, 800
    k_cache = torch.randn(nblocks, bs, kvh, d)
    v_cache = torch.randn(nblocks, bs, kvh, d)
    k_cache[0] = 1e4  # the null block: padding must never reach the output
    v_cache[0] = 1e4
    ctx = [40, 2900, 17, 700, 250, 2901]  # three groups: short, ~700, ~2900
    perm = (torch.randperm(nblocks - 1) + 1).tolist()
    chunks, taken = [], 0
    for n in ctx:
        nb = math.ceil(n / bs)
        table, taken = perm[taken:taken + nb], taken + nb
        chunks.append(SeqChunk([1], n - 1, table, True))
    order = order_chunks(chunks)
    meta = build_metadata(chunks, order, bs, torch.float32, torch.device("cpu"))
    assert meta.decode is not None and len(meta.decode.groups) == 3
    q = torch.randn(len(ctx), heads, d)
    k_new = torch.randn(len(ctx), kvh, d)
    v_new = torch.randn(len(ctx), kvh, d)
    out = TorchPagedAttention().forward(q, k_new, v_new, k_cache, v_cache, meta)
    for row, i in enumerate(order):
        c = chunks[i]
        slots = torch.arange(ctx[i])
        blocks = torch.tensor(c.block_table)[slots // bs]
        keys = k_cache[blocks, slots % bs]  # [ctx, kvh, d], includes this step's key
        vals = v_cache[blocks, slots % bs]
        assert torch.equal(keys[-1], k_new[row])
        g = heads // kvh
        qh = q[row].view(kvh, g, d)
        scores = torch.einsum("kgd,tkd->kgt", qh, keys) / math.sqrt(d)
        want = torch.einsum("kgt,tkd->kgd", scores.softmax(-1), vals).reshape(-1)
        torch.testing.assert_close(out[row], want, rtol=1e-5, atol=1e-5)
