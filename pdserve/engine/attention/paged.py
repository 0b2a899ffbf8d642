"""Paged attention: one backend interface, and a gather + SDPA implementation for CPU.

Per step the runner flattens all sequences' new tokens into one batch ordered
single-token chunks first (decodes, batched together), then multi-token chunks
(prefill chunks, one SDPA call each). `AttentionMetadata` is built once per
step and shared by every layer.

Pool views handed to a backend are one layer's K and V, each
`[num_blocks, block_size, num_kv_heads, head_dim]`: a tensor, or a quantized
cache (`pdserve.engine.runner.kv_quant`) that a backend writes with `write_kv` and reads with
`read_blocks`, which work on both.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from pdserve.common.kv_layout import NULL_BLOCK
from pdserve.engine.attention.chunk import chunk_causal_attention
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.kv_quant import KVCacheView, read_blocks, write_kv


@dataclass(frozen=True)
class PrefillSeq:
    """One multi-token chunk: flat rows [q_start, q_end) at positions [start_pos, ctx_len)."""

    q_start: int
    q_end: int
    start_pos: int
    ctx_len: int
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] long
    # No mask travels with a chunk: row i attends to positions [0, start_pos + i]
    # (`pdserve.engine.attention.chunk`).


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended together with padding."""

    rows: torch.Tensor | None  # [n] long: their flat rows; None = all rows, in order
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with the null block
    max_ctx_len: int
    # [n, 1, 1, max_ctx_len] additive float mask; None if all lengths are equal
    mask: torch.Tensor | None


@dataclass(frozen=True)
class DecodeBatch:
    """Single-token chunks, flat rows [0, num_seqs), in groups of similar context length.

    Padding every decode to the longest context would make one long sequence (a
    1,500-token prompt among 200-token chats) multiply the KV gathered for all of
    them; each group pads only to its own longest.
    """

    num_seqs: int
    groups: tuple[DecodeGroup, ...]  # empty when built for a flat-decode backend
    # Built only for a backend with `flat_decode` (it reads the pool in place, so it
    # needs no groups, padding masks or gathers): every decode's table, in row order.
    block_tables: torch.Tensor | None = None  # [n, max_blocks] long, padded with the null block
    ctx_lens: torch.Tensor | None = None  # [n] long: keys each decode attends to


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: pool slot of each flat token's new K/V
    decode: DecodeBatch | None
    prefills: tuple[PrefillSeq, ...]
    num_tokens: int


class AttentionBackend(abc.ABC):
    """Writes this step's K/V into the pool and attends through block tables."""

    # True: decodes reach `forward` as one flat batch (`DecodeBatch.block_tables`,
    # `ctx_lens`) instead of padded groups.
    flat_decode: ClassVar[bool] = False
    # False: `forward` does host work per step (pdserve.engine.runner.cuda_graphs captures no graphs over it).
    graph_safe: ClassVar[bool] = True

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCacheView,
        v_cache: KVCacheView,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (RoPE applied) -> attention output [T, H * D].

        Must write k/v at `meta.slot_mapping` of k_cache/v_cache before returning.
        """


def order_chunks(chunks: Sequence[SeqChunk]) -> list[int]:
    """Chunk indices in flat-batch order: single-token chunks first, then the rest."""
    singles = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    multis = [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
    return singles + multis


def _slots(chunk: SeqChunk, block_size: int) -> torch.Tensor:
    pos = torch.arange(chunk.start_pos, chunk.end_pos)
    blocks = torch.tensor(chunk.block_table[: (chunk.end_pos + block_size - 1) // block_size])
    return blocks[pos // block_size] * block_size + pos % block_size


def build_metadata(
    chunks: Sequence[SeqChunk],
    order: Sequence[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    flat_decode: bool = False,
) -> AttentionMetadata:
    """Metadata for chunks laid out in `order` (see `order_chunks`); decodes in
    groups, or flat for a backend whose `flat_decode` is set."""
    ordered = [chunks[i] for i in order]
    num_dec = 0
    while num_dec < len(ordered) and len(ordered[num_dec].token_ids) == 1:
        num_dec += 1
    slot_parts: list[torch.Tensor] = []
    decode = None
    if num_dec:
        dec = ordered[:num_dec]
        dec_slots = [
            c.block_table[c.start_pos // block_size] * block_size + c.start_pos % block_size
            for c in dec
        ]
        slot_parts.append(torch.tensor(dec_slots, dtype=torch.long))
        decode = (_flat_decode_batch(dec, block_size, device) if flat_decode
                  else _decode_batch(dec, block_size, dtype, device))
    prefills = []
    row = num_dec
    for c in ordered[num_dec:]:
        n = len(c.token_ids)
        slot_parts.append(_slots(c, block_size))
        nblk = (c.end_pos + block_size - 1) // block_size
        table = torch.tensor(c.block_table[:nblk], dtype=torch.long, device=device)
        prefills.append(PrefillSeq(row, row + n, c.start_pos, c.end_pos, table))
        row += n
    slot_mapping = (
        torch.cat(slot_parts).to(device) if slot_parts else torch.empty(0, dtype=torch.long)
    )
    return AttentionMetadata(slot_mapping, decode, tuple(prefills), row)


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Boolean "may attend" -> additive float mask (0 / -inf), built once per step
    (decode groups of unequal lengths only: a prefill chunk never builds one)."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill_(~allowed, float("-inf")).to(device)


# A decode group's longest context may be up to this many times its shortest
# before a new group starts; contexts up to SPLIT_MIN_CTX tokens never split (the
# padding is cheaper than another gather + SDPA call per layer).
SPLIT_RATIO = 2
SPLIT_MIN_CTX = 256


def decode_groups(ctx: Sequence[int]) -> list[list[int]]:
    """Indices of `ctx` in groups of similar length (each ascending by length)."""
    order = sorted(range(len(ctx)), key=lambda i: ctx[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (ctx[i] <= SPLIT_MIN_CTX or ctx[i] <= SPLIT_RATIO * ctx[groups[-1][0]]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _decode_group(
    dec: Sequence[SeqChunk], idx: Sequence[int] | None, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> DecodeGroup:
    members = [dec[i] for i in idx] if idx is not None else list(dec)
    ctx = [c.start_pos + 1 for c in members]
    max_ctx = max(ctx)
    max_blocks = (max_ctx + block_size - 1) // block_size
    tables = []
    for c, n in zip(members, ctx, strict=True):
        # Only the blocks covering the context are read (entries past them may be
        # stale); padding points at the null block and is masked out.
        own = c.block_table[: (n + block_size - 1) // block_size]
        tables.append(own + [NULL_BLOCK] * (max_blocks - len(own)))
    mask = None
    if min(ctx) != max_ctx:
        lens = torch.tensor(ctx, dtype=torch.long)
        allowed = (torch.arange(max_ctx)[None, :] < lens[:, None]).view(len(ctx), 1, 1, max_ctx)
        mask = _additive(allowed, dtype, device)
    rows = None if idx is None else torch.tensor(idx, dtype=torch.long, device=device)
    return DecodeGroup(rows, torch.tensor(tables, dtype=torch.long, device=device), max_ctx, mask)


def _decode_batch(
    dec: Sequence[SeqChunk], block_size: int, dtype: torch.dtype, device: torch.device
) -> DecodeBatch:
    groups = decode_groups([c.start_pos + 1 for c in dec])
    if len(groups) == 1:
        return DecodeBatch(len(dec), (_decode_group(dec, None, block_size, dtype, device),))
    return DecodeBatch(
        len(dec), tuple(_decode_group(dec, g, block_size, dtype, device) for g in groups)
    )


def _flat_decode_batch(
    dec: Sequence[SeqChunk], block_size: int, device: torch.device
) -> DecodeBatch:
    ctx = [c.start_pos + 1 for c in dec]
    max_blocks = (max(ctx) + block_size - 1) // block_size
    tables = []
    for c, n in zip(dec, ctx, strict=True):
        own = c.block_table[: (n + block_size - 1) // block_size]
        tables.append(own + [NULL_BLOCK] * (max_blocks - len(own)))
    return DecodeBatch(
        len(dec), (), torch.tensor(tables, dtype=torch.long, device=device),
        torch.tensor(ctx, dtype=torch.long, device=device),
    )


class TorchPagedAttention(AttentionBackend):
    """Gather each sequence's context through its block table, then SDPA.

    Decodes: one SDPA call per group of similar context length. The query heads sharing a KV head
    are laid out as that head's query rows ([B, KVH, G, D]), so GQA needs no
    repeated K/V. Prefill chunks: one causal SDPA call each (GQA via enable_gqa).
    """

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCacheView,
        v_cache: KVCacheView,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k_cache, meta.slot_mapping, k)
        write_kv(v_cache, meta.slot_mapping, v)
        outs = []
        if meta.decode is not None:
            b = meta.decode.num_seqs
            outs.append(self._decode(q[:b], k_cache, v_cache, meta.decode))
        for p in meta.prefills:
            outs.append(self._prefill(q[p.q_start : p.q_end], k, v, k_cache, v_cache, p))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out

    @classmethod
    def _decode(
        cls, q: torch.Tensor, k_cache: KVCacheView, v_cache: KVCacheView, dec: DecodeBatch
    ) -> torch.Tensor:
        if len(dec.groups) == 1 and dec.groups[0].rows is None:
            return cls._decode_group(q, k_cache, v_cache, dec.groups[0])
        b, h, d = q.shape
        out = q.new_empty(b, h * d)
        for g in dec.groups:
            assert g.rows is not None
            out.index_copy_(0, g.rows, cls._decode_group(q.index_select(0, g.rows), k_cache,
                                                         v_cache, g))
        return out

    @staticmethod
    def _decode_group(
        q: torch.Tensor, k_cache: KVCacheView, v_cache: KVCacheView, g: DecodeGroup
    ) -> torch.Tensor:
        b, h, d = q.shape
        kvh = k_cache.shape[2]
        L = g.max_ctx_len
        # index_select on a flat id list is markedly faster than advanced indexing on CPU.
        ids = g.block_tables.view(-1)
        keys = read_blocks(k_cache, ids, q.dtype).view(b, -1, kvh, d)[:, :L].transpose(1, 2)
        vals = read_blocks(v_cache, ids, q.dtype).view(b, -1, kvh, d)[:, :L].transpose(1, 2)
        qg = q.reshape(b, kvh, h // kvh, d)
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=g.mask)
        return out.reshape(b, h * d)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCacheView,
        v_cache: KVCacheView,
        p: PrefillSeq,
    ) -> torch.Tensor:
        n, h, d = q.shape
        kvh = k_cache.shape[2]
        if p.start_pos == 0 and isinstance(k_cache, torch.Tensor):
            # The whole context is this chunk: attend to the fresh k/v directly. (A
            # quantized cache is read back, so a prefix-cache hit equals a miss.)
            keys, vals = k[p.q_start : p.q_end], v[p.q_start : p.q_end]
        else:
            keys = read_blocks(k_cache, p.block_table, q.dtype).view(-1, kvh, d)[: p.ctx_len]
            vals = read_blocks(v_cache, p.block_table, q.dtype).view(-1, kvh, d)[: p.ctx_len]
        # [1, heads, tokens, dim]: 4-D inputs with enable_gqa reach the fused CPU
        # kernel without materialising repeated K/V.
        qh = q.transpose(0, 1).unsqueeze(0)
        keys = keys.transpose(0, 1).unsqueeze(0)
        vals = vals.transpose(0, 1).unsqueeze(0)
        out = chunk_causal_attention(qh, keys, vals, p.start_pos).squeeze(0)
        return out.transpose(0, 1).reshape(n, h * d)
