"""CUDA graphs for decode steps at bucketed batch sizes.

A decode step launches a few hundred small kernels whose launch cost, at batch 1, is
as long as the step's arithmetic. Each bucket (1, 2, 4 ... 64 sequences) is captured
once after a warm-up, over static device buffers; a step of n decodes fills the first
`bucket >= n` rows (the rest padding), copies them in with one non_blocking copy and
replays the bucket's graph. Steps above the largest bucket, steps with a prefill chunk
or draft tokens, and layer hooks run eagerly.

Static buffers, one flat int64 device tensor laid out by `DecodeBufferLayout`:

    ids [B] | positions [B] | slots [B] | ctx_lens [B] | block_tables [B, max_blocks]

Padding rows decode token 0 at position 0 into slot 0 of the null block (which every
padded table entry already points at and no sequence owns), with context length 1, so
they touch no one's KV. Block tables are padded to the blocks of `max_model_len`: the
Triton decode kernel's launch grid depends only on the table width, never on the data.

The model must be graph-safe on this path: no host syncs, no data-dependent shapes.
Graphs are captured only over a `flat_decode` backend (Triton), an unquantized pool,
a dense model and a single rank (`graph_support`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from pdserve.common.kv_layout import NULL_BLOCK
from pdserve.engine.attention.paged import AttentionBackend, AttentionMetadata, DecodeBatch
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.cuda_device import stream_event
from pdserve.engine.runner.kv_quant import KVCacheView

log = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def graph_buckets(max_num_seqs: int, buckets: Sequence[int] = DECODE_BUCKETS) -> tuple[int, ...]:
    """The buckets worth capturing: all up to the first that holds `max_num_seqs`."""
    out = []
    for b in sorted(buckets):
        out.append(b)
        if b >= max_num_seqs:
            break
    return tuple(out)


def pick_bucket(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `batch` decodes; None above the largest (run eagerly)."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    return None


def graphable(chunks: Sequence[SeqChunk]) -> bool:
    """Whether a step is plain decodes: one token each, no drafts."""
    return bool(chunks) and all(len(c.token_ids) == 1 and c.num_draft_tokens == 0 for c in chunks)


class DecodeBufferLayout(NamedTuple):
    """Offsets of the static buffers in the flat int64 tensor."""

    max_batch: int
    max_blocks: int

    @property
    def size(self) -> int:
        return self.max_batch * (4 + self.max_blocks)

    def views(self, flat: torch.Tensor, batch: int) -> DecodeViews:
        """The first `batch` rows of each buffer, as views of `flat`."""
        b, mb = self.max_batch, self.max_blocks
        tables = flat[4 * b:4 * b + b * mb].view(b, mb)
        return DecodeViews(flat[:batch], flat[b:b + batch], flat[2 * b:2 * b + batch],
                           flat[3 * b:3 * b + batch], tables[:batch])


class DecodeViews(NamedTuple):
    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [batch]
    ctx_lens: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # [batch, max_blocks], row stride max_blocks


def fill_decode_inputs(flat: torch.Tensor, layout: DecodeBufferLayout, chunks: Sequence[SeqChunk],
                       bucket: int, block_size: int) -> None:
    """Write decodes `chunks` and padding up to `bucket` rows into the host buffer `flat`."""
    n = len(chunks)
    if n > bucket or bucket > layout.max_batch:
        raise ValueError(f"{n} decodes do not fit bucket {bucket} (buffers hold {layout.max_batch})")
    v = layout.views(flat, bucket)
    ids, pos, slots, lens = ([c.token_ids[0] for c in chunks], [c.start_pos for c in chunks], [], [])
    v.block_tables.fill_(NULL_BLOCK)
    for i, c in enumerate(chunks):
        ctx = c.start_pos + 1
        own = c.block_table[:(ctx + block_size - 1) // block_size]
        if len(own) > layout.max_blocks:
            raise ValueError(f"a context of {ctx} tokens exceeds the {layout.max_blocks} blocks captured")
        slots.append(own[c.start_pos // block_size] * block_size + c.start_pos % block_size)
        lens.append(ctx)
        v.block_tables[i, :len(own)] = torch.tensor(own, dtype=torch.long)
    pad = bucket - n
    v.input_ids.copy_(torch.tensor(ids + [0] * pad, dtype=torch.long))
    v.positions.copy_(torch.tensor(pos + [0] * pad, dtype=torch.long))
    v.slot_mapping.copy_(torch.tensor(slots + [NULL_BLOCK * block_size] * pad, dtype=torch.long))
    v.ctx_lens.copy_(torch.tensor(lens + [1] * pad, dtype=torch.long))


class StaticDecodeStep:
    """The static buffers of decode steps and the model run over their first `bucket`
    rows: what a graph captures (device-agnostic, so it runs eagerly on CPU too)."""

    def __init__(self, model: Any, kv_layers: list[tuple[KVCacheView, KVCacheView]],
                 backend: AttentionBackend, device: torch.device, max_batch: int,
                 max_model_len: int, block_size: int) -> None:
        self._model = model
        self._kv_layers = kv_layers
        self._backend = backend
        self.block_size = block_size
        self.layout = DecodeBufferLayout(max_batch, -(-max_model_len // block_size))
        self._cuda = device.type == "cuda"
        self._host = torch.zeros(self.layout.size, dtype=torch.long, pin_memory=self._cuda)
        self.buffers = torch.zeros(self.layout.size, dtype=torch.long, device=device)
        self._copied: torch.cuda.Event | None = None

    def load(self, chunks: Sequence[SeqChunk], bucket: int) -> None:
        """Fill the buffers' first `bucket` rows with `chunks` and padding: one copy."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy out of the host buffer is done
        fill_decode_inputs(self._host, self.layout, chunks, bucket, self.block_size)
        self.buffers.copy_(self._host, non_blocking=self._cuda)
        if self._cuda:
            self._copied = stream_event(self.buffers.device)

    def forward(self, bucket: int) -> torch.Tensor:
        """Float32 logits [bucket, vocab] of the buffers' first `bucket` rows."""
        v = self.layout.views(self.buffers, bucket)
        meta = AttentionMetadata(v.slot_mapping, DecodeBatch(bucket, (), v.block_tables, v.ctx_lens),
                                 (), bucket)
        hidden = self._model(v.input_ids, v.positions, meta, self._kv_layers, self._backend, None)
        return self._model.compute_logits(hidden).float()


def requested_rows(out: torch.Tensor, chunks: Sequence[SeqChunk]) -> torch.Tensor:
    """A copy of the need_logits rows of a padded decode step's logits `out` (a copy: the
    next replay overwrites a graph's output buffer)."""
    rows = [i for i, c in enumerate(chunks) if c.need_logits]
    return out[:len(chunks)].clone() if len(rows) == len(chunks) else out[rows].clone()


class DecodeGraphs:
    """Captured decode graphs of one runner, replayed by `run`."""

    def __init__(self, step: StaticDecodeStep, buckets: Sequence[int]) -> None:
        self.step = step
        self.buckets = tuple(sorted(buckets))
        if self.buckets[-1] > step.layout.max_batch:
            raise ValueError(f"bucket {self.buckets[-1]} exceeds the {step.layout.max_batch} rows buffered")
        device = step.buffers.device
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():  # as the eager step runs (ModelRunner.execute)
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its pool
                self._graphs[b] = self._capture(b, pool, device)
        torch.cuda.synchronize(device)
        log.info("captured CUDA graphs for decode batches %s", ", ".join(map(str, self.buckets)))

    def _capture(self, bucket: int, pool: Any, device: torch.device
                 ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.step.load([], bucket)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: Triton compiles, the allocator settles
            self.step.forward(bucket)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.step.forward(bucket)
        return graph, out

    def run(self, chunks: Sequence[SeqChunk]) -> torch.Tensor | None:
        """Float32 logits of a plain decode step's need_logits rows by graph replay; None
        when the step is not one a graph covers (the caller runs it eagerly)."""
        bucket = pick_bucket(len(chunks), self.buckets) if graphable(chunks) else None
        if bucket is None:
            return None
        self.step.load(chunks, bucket)
        graph, out = self._graphs[bucket]
        graph.replay()
        return requested_rows(out, chunks)


def capture_or_eager(step: StaticDecodeStep, buckets: Sequence[int], required: bool
                     ) -> DecodeGraphs | None:
    """`DecodeGraphs` over `step`; where capture fails (a CUDA error, a host sync in the
    model) and graphs were not asked for explicitly (`required`, `--cuda-graphs`), None
    and an error in the log: the worker serves eagerly rather than not at all."""
    try:
        return DecodeGraphs(step, buckets)
    except RuntimeError as e:
        if required:
            raise
        log.error("decode CUDA graphs could not be captured, serving eagerly (--no-cuda-graphs "
                  "silences this): %s", e)
        return None


def graph_support(enabled: bool | None, device: torch.device, backend: AttentionBackend,
                  quantized_kv: bool, sharded: bool, moe: bool) -> str | None:
    """Why decode graphs cannot be captured here (None: they can); `enabled` False is the
    flag turning them off."""
    if enabled is False:
        return "--no-cuda-graphs"
    if device.type != "cuda":
        return f"the device is {device.type}"
    if not backend.flat_decode:
        return f"{type(backend).__name__} has no flat decode (Triton is missing)"
    if not backend.graph_safe:
        return f"{type(backend).__name__} (it plans each step on the host)"
    if quantized_kv:
        return "a quantized KV cache"
    if sharded:
        return "tensor or pipeline parallel ranks"
    if moe:
        return "a mixture-of-experts model (its routing syncs with the host)"
    return None
