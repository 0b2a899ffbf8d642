"""FlashInfer paged attention (optional: used on CUDA when `flashinfer` is installed and chosen).

Our pool views are `[num_blocks, block_size, num_kv_heads, head_dim]`: FlashInfer's "NHD"
paged layout, with one block as one page, read in place. FlashInfer does not take padded
block tables; it takes a CSR page list per batch (`paged_kv_index`):

    indptr        [n + 1] int32: sequence i's pages are indices[indptr[i]:indptr[i + 1]]
    indices       [sum of pages] int32: block ids, each sequence's in table order
    last_page_len [n] int32: tokens in each sequence's last page, 1 .. block_size

Decodes run `BatchDecodeWithPagedKVCacheWrapper`; prefill chunks (whole prompts,
prefix-cache hits, later chunks of a chunked prefill) run one
`BatchPrefillWithPagedKVCacheWrapper` call over all of them, causal with the query rows
aligned to the end of each context (row i of a chunk at position start_pos + i), which
is FlashInfer's convention. Both share one workspace buffer allocated at construction.

Planning (`plan`) happens once per step, on the first layer's call, from host copies of
the step's tables (one device -> host read per step, not per layer); every layer then
only runs. That host work is why decode graphs are not captured over this backend
(`graph_safe` is False): steps run eagerly.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

import torch

from pdserve.common.kv_layout import NULL_BLOCK
from pdserve.engine.attention.paged import AttentionBackend, AttentionMetadata, PrefillSeq
from pdserve.engine.runner.kv_quant import KVCacheView, write_plain_kv

WORKSPACE_BYTES = 128 << 20  # FlashInfer's documented default float workspace


def flashinfer_available() -> bool:
    """Whether flashinfer is importable here."""
    return importlib.util.find_spec("flashinfer") is not None


class PagedKVIndex(NamedTuple):
    """FlashInfer's CSR description of a batch's pages (int32, on the tables' device)."""

    indptr: torch.Tensor  # [n + 1]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [n]


def paged_kv_index(block_tables: torch.Tensor, ctx_lens: torch.Tensor, block_size: int
                   ) -> PagedKVIndex:
    """Padded block tables `[n, max_blocks]` and context lengths `[n]` -> FlashInfer's page
    list. Only the ceil(ctx / block_size) leading entries of a row are read: what lies past
    them is padding (the null block) or stale."""
    if block_tables.dim() != 2 or ctx_lens.dim() != 1 or len(ctx_lens) != len(block_tables):
        raise ValueError(f"block tables {tuple(block_tables.shape)} and context lengths "
                         f"{tuple(ctx_lens.shape)} do not describe one batch")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lens = ctx_lens.to(torch.int64)
    if len(lens) and int(lens.min()) < 1:
        raise ValueError("every sequence attends to at least one token (a context length < 1)")
    pages = (lens + block_size - 1) // block_size
    if len(pages) and int(pages.max()) > block_tables.shape[1]:
        raise ValueError(f"a context of {int(lens.max())} tokens needs {int(pages.max())} blocks; "
                         f"the tables hold {block_tables.shape[1]}")
    zero = torch.zeros(1, dtype=torch.int64, device=block_tables.device)
    indptr = torch.cat([zero, pages.cumsum(0)]).to(torch.int32)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < pages[:, None]
    indices = block_tables[used].to(torch.int32)  # row-major: each sequence's pages in order
    last = (lens - (pages - 1) * block_size).to(torch.int32)
    return PagedKVIndex(indptr, indices, last)


def prefill_index(prefills: Sequence[PrefillSeq], block_size: int
                  ) -> tuple[torch.Tensor, PagedKVIndex]:
    """qo_indptr `[m + 1]` (rows relative to the first chunk's) and the page list of the
    prefill chunks, from their own tables (on the host)."""
    if not prefills:
        raise ValueError("no prefill chunks")
    width = max(len(p.block_table) for p in prefills)
    tables = torch.full((len(prefills), width), NULL_BLOCK, dtype=torch.long)
    for i, p in enumerate(prefills):
        tables[i, :len(p.block_table)] = p.block_table.cpu()
    lens = torch.tensor([p.ctx_len for p in prefills], dtype=torch.long)
    first = prefills[0].q_start
    qo = torch.tensor([0] + [p.q_end - first for p in prefills], dtype=torch.int32)
    return qo, paged_kv_index(tables, lens, block_size)


class FlashInferAttention(AttentionBackend):
    """Decode and prefill attention through FlashInfer's paged wrappers."""

    flat_decode = True  # decodes arrive as one flat batch of tables and lengths
    graph_safe: ClassVar[bool] = False  # plan() runs host code every step

    def __init__(self, device: torch.device, workspace_bytes: int = WORKSPACE_BYTES) -> None:
        import flashinfer  # deferred: flashinfer is optional

        self._fi: Any = flashinfer
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode: Any = None
        self._prefill: Any = None
        self._planned: AttentionMetadata | None = None  # held: its id cannot be reused

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: KVCacheView,
        v_cache: KVCacheView,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = write_plain_kv("FlashInferAttention", k_cache, v_cache, meta.slot_mapping, k, v)
        if self._planned is not meta:
            self._plan(meta, q, k_cache)
        outs = []
        b = meta.decode.num_seqs if meta.decode is not None else 0
        if b:
            outs.append(self._decode.run(q[:b].contiguous(), (k_cache, v_cache)))
        if meta.prefills:
            outs.append(self._prefill.run(q[b:meta.num_tokens].contiguous(), (k_cache, v_cache)))
        h, d = q.shape[1], q.shape[2]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.reshape(meta.num_tokens, h * d)

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        h, d = q.shape[1], q.shape[2]
        block_size, kvh = k_cache.shape[1], k_cache.shape[2]
        if h % kvh:
            raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
        # Heads, head dim and page size go positionally: the keyword names differ between
        # the two wrappers (`head_dim` / `head_dim_qk`) and across FlashInfer releases.
        dims = (h, kvh, d, block_size)
        dtypes = {"q_data_type": q.dtype, "kv_data_type": k_cache.dtype}
        dec = meta.decode
        if dec is not None and dec.num_seqs:
            if dec.block_tables is None or dec.ctx_lens is None:
                raise ValueError("FlashInferAttention needs flat decode metadata "
                                 "(build_metadata(..., flat_decode=True))")
            if self._decode is None:
                self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=h // kvh >= 4)
            idx = paged_kv_index(dec.block_tables.cpu(), dec.ctx_lens.cpu(), block_size)
            self._decode.plan(idx.indptr, idx.indices.to(q.device), idx.last_page_len, *dims,
                              pos_encoding_mode="NONE", **dtypes)
        if meta.prefills:
            if self._prefill is None:
                self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
            qo, idx = prefill_index(meta.prefills, block_size)
            self._prefill.plan(qo, idx.indptr, idx.indices.to(q.device), idx.last_page_len,
                               *dims, causal=True, **dtypes)
        self._planned = meta
