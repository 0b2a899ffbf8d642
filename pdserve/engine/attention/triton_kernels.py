"""Triton kernels for paged decode attention (imported only where triton is).

`paged_decode_kernel`: one program per (sequence, KV head, KV split). It loads the
query rows of every query head sharing that KV head (grouped-query heads packed,
padded to GROUP_PAD rows), walks its share of the sequence's block table and reads
K/V in place from the pool (`[num_blocks, block_size, num_kv_heads, head_dim]`,
any strides), with an online softmax accumulated in float32. Each split writes its
normalised partial output and log-sum-exp; `split_reduce_kernel` merges the splits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, o_ptr, lse_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr, USE_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    offs_t = tl.arange(0, BLOCK_PAD)
    g_ok = offs_g < GROUP
    d_ok = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :], other=0.0,
    ).to(tl.float32)
    ctx_len = tl.load(ctx_ptr + b)
    num_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, num_blocks)
    m_i = tl.full([GROUP_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], dtype=tl.float32)
    for i in range(first, last):
        blk = tl.load(table_ptr + b * stride_tb + i).to(tl.int64)
        pos = i * BLOCK_SIZE + offs_t
        t_ok = (offs_t < BLOCK_SIZE) & (pos < ctx_len)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + blk * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh
            + offs_d[None, :], mask=kv_mask, other=0.0,
        ).to(tl.float32)
        v = tl.load(
            v_ptr + blk * stride_vb + offs_t[:, None] * stride_vt + kvh * stride_vh
            + offs_d[None, :], mask=kv_mask, other=0.0,
        ).to(tl.float32)
        if USE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(t_ok[None, :], s * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        p = tl.where(t_ok[None, :], p, 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), -1e30)
    tl.store(
        o_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        out, mask=g_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)


@triton.jit
def split_reduce_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLIT_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLIT_PAD)
    offs_d = tl.arange(0, DIM_PAD)
    s_ok = offs_s < NUM_SPLITS
    d_ok = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=-1e30)
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = tl.where(s_ok & (lse > -1e29), w, 0.0)
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :], other=0.0,
    )
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, o_ptr,
    scale, n_rows, start_pos, ctx_len,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
):
    """One chunk's rows [tile * BLOCK_M, +BLOCK_M) of query head h, at positions
    start_pos + row, attend causally to the pool (which holds this chunk's K/V too):
    no mask tensor, no gather; prefix-cache hits and later chunks read their context
    through the block table."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, DIM_PAD)
    offs_t = tl.arange(0, BLOCK_PAD)
    r_ok = rows < n_rows
    d_ok = offs_d < HEAD_DIM
    q_pos = start_pos + rows
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    end = tl.minimum(start_pos + (tile + 1) * BLOCK_M, ctx_len)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], dtype=tl.float32)
    for i in range(0, tl.cdiv(end, BLOCK_SIZE)):
        blk = tl.load(table_ptr + i).to(tl.int64)
        pos = i * BLOCK_SIZE + offs_t
        t_ok = (offs_t < BLOCK_SIZE) & (pos < ctx_len)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + blk * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + blk * stride_vb + offs_t[:, None] * stride_vt + kvh * stride_vh
                    + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        if USE_DOT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        allowed = t_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s * scale, -1e30)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(allowed, tl.exp(s - m_new[:, None]), 0.0)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])
