"""ModelRunner: owns the weights and the KV pool, and runs one step over SeqChunks.

    runner = ModelRunner(EngineConfig(model_dir=...))
    logits = runner.execute([SeqChunk(prompt, 0, [1, 2], True)])   # [1, vocab] float32

Block ids are bookkeeping done elsewhere (the block manager); the runner only
reads block tables and writes K/V at the slots they imply.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.attention.backend_choice import make_backend
from pdserve.engine.attention.paged import (
    AttentionBackend,
    AttentionMetadata,
    build_metadata,
    order_chunks,
)
from pdserve.engine.core.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.kernels.numerics import numerics
from pdserve.engine.loading.dtype import resolved_config
from pdserve.engine.loading.loader import load_config, load_model_with, weights_fingerprint
from pdserve.engine.loading.model_config import ModelConfig, kv_layout
from pdserve.engine.lora.batch import LoraBatch
from pdserve.engine.lora.registry import LoraRegistry
from pdserve.engine.parallel.plan import TPShard
from pdserve.engine.parallel.shared_pool import head_slice
from pdserve.engine.quant.formats import served_lm_head, served_quantization
from pdserve.engine.runner.cuda_device import bind_device
from pdserve.engine.runner.cuda_graphs import (
    DecodeGraphs,
    StaticDecodeStep,
    capture_or_eager,
    graph_buckets,
    graph_support,
)
from pdserve.engine.runner.kv_pool import TORCH_DTYPES, KVPool
from pdserve.engine.runner.kv_quant import KVCacheView
from pdserve.engine.runner.memory_budget import cuda_kv_budget
from pdserve.engine.runner.step_staging import PinnedStager, stage_metadata
from pdserve.engine.spec.draft_kv import draft_engine_config


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The longest sequence (prompt + output) the runner accepts."""
    limit = model_config.position_limit
    requested = config.scheduler.max_model_len
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's limit of {limit} positions"
        )
    return requested


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] flat, in `order_chunks` order
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    logit_rows: list[int]  # row of each need_logits chunk's last token, in chunk order
    # `logit_rows` on the device, staged with the rest (CUDA); None: built by `logits`
    logit_index: torch.Tensor | None = None
    # The rows that run under LoRA adapters (pdserve.engine.lora); None: all of them the base.
    lora: LoraBatch | None = None


class ModelRunner:
    """Runs the model on a batch of SeqChunks over a paged KV pool.

    Pool size: `kv_buffer` when given (shape `layout.pool_shape(n)` in the pool
    dtype, or raw bytes; on the runner's device; the caller owns its memory), else
    `cache.num_blocks`, else `cache.kv_cache_memory` bytes (default: CPU
    DEFAULT_CPU_KV_BYTES, CUDA what `gpu_memory_utilization` of the device's total memory
    leaves after the weights and activations, `pdserve.engine.runner.memory_budget`) divided by the bytes of one block across all layers. `num_blocks`
    counts the null block.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_buffer: torch.Tensor | np.ndarray | None = None,
        backend: AttentionBackend | None = None,
        layout: KVLayout | None = None,
        shard: TPShard | None = None,
    ) -> None:
        """`shard`: this process is one tensor-parallel rank (`pdserve.engine.parallel`): it loads
        that slice of the weights and attends over its KV heads of the (full-layout) pool."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        config = resolved_config(config)  # `auto` -> the dtype this host serves in
        self.config = config
        self.device = torch.device(config.device)
        bind_device(self.device)  # Triton, graph capture and bare events use the current device
        self.dtype = TORCH_DTYPES[config.dtype]
        self.block_size = config.cache.block_size
        max_len = resolve_max_model_len(config, load_config(config.model_dir))
        self.model_config, self.model = load_model_with(
            config.model_dir, self.dtype, self.device, max_positions=max_len,
            quantization=config.quantization, shard=shard,
            lm_head_quantization=config.lm_head_quantization,
        )
        self.max_model_len = max_len
        # A caller that sized the pool with `layout_for(config)` passes that layout, so
        # the weights are fingerprinted once even where no cache file can be written.
        weights = layout.weights if layout is not None else weights_fingerprint(config.model_dir).digest
        self.quantization = served_quantization(config.quantization, self.model_config.prequant)
        self.lm_head_quantization = served_lm_head(config.lm_head_quantization, self.quantization)
        self.layout: KVLayout = self._with_draft(kv_layout(
            self.model_config, self.block_size, config.dtype, weights, config.kv_cache_dtype,
            self.quantization, self.lm_head_quantization,
            numerics(self.device.type, config.dtype, self.quantization, self.lm_head_quantization)), config)
        if layout is not None and layout != self.layout:
            raise ValueError(f"layout {layout} does not belong to this config ({self.layout})")
        if kv_buffer is not None:
            self.pool = KVPool(self.layout, buffer=kv_buffer)
            if self.pool.device.type != self.device.type:
                raise ValueError(f"kv buffer is on {self.pool.device}, the model on {self.device}")
        else:
            self.pool = KVPool(self.layout, self._num_blocks_from_budget(), device=self.device)
        self.num_blocks = self.pool.num_blocks
        self._kv_layers = self.pool.all_layer_views()
        if shard is not None:
            h = shard.kv_heads
            self._kv_layers = [(head_slice(k, h), head_slice(v, h)) for k, v in self._kv_layers]
            if shard.layers is not None:  # a pipeline stage: its layers' views only
                self._kv_layers = self._kv_layers[shard.layers.start:shard.layers.stop]
        # The in-place kernels read whole, contiguous pool views; a tensor-parallel rank's
        # head slice of the shared pool is strided, so it keeps the gather path.
        plain_kv = not self.layout.quantized and (shard is None or all(
            isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
            and k.is_contiguous() and v.is_contiguous() for k, v in self._kv_layers))
        self.backend = backend or make_backend(config.attention_backend, self.dtype, self.device,
                                               plain_kv=plain_kv, head_dim=self.layout.head_dim,
                                               quantized_kv=self.layout.quantized)
        self._stager = PinnedStager(self.device) if self.device.type == "cuda" else None
        self._graphs = self._capture_graphs(sharded=shard is not None)
        self.loras = self._lora_registry(shard)

    def _lora_registry(self, shard: TPShard | None) -> LoraRegistry | None:
        if self.config.lora is None:
            return None
        if shard is not None or self.model_config.moe is not None:
            raise ValueError("--enable-lora serves dense models on one rank only (no tensor or "
                             "pipeline parallel, no MoE)")
        return LoraRegistry(self.config.lora, self.model_config, self.dtype, self.device)

    def _capture_graphs(self, sharded: bool) -> DecodeGraphs | None:
        """Decode graphs per `pdserve.engine.runner.cuda_graphs` where this runner allows them; asked for
        explicitly (`cuda_graphs=True`) where it does not, a ValueError saying why."""
        why_not = graph_support(self.config.cuda_graphs, self.device, self.backend,
                                self.layout.quantized, sharded, self.model_config.moe is not None)
        if why_not is not None:
            if self.config.cuda_graphs:
                raise ValueError(f"--cuda-graphs: no decode graphs with {why_not}")
            return None
        buckets = graph_buckets(self.config.scheduler.max_num_seqs)
        step = StaticDecodeStep(self.model, self._kv_layers, self.backend, self.device,
                                buckets[-1], self.max_model_len, self.block_size)
        return capture_or_eager(step, buckets, required=bool(self.config.cuda_graphs))

    @property
    def kv_layers(self) -> list[tuple[KVCacheView, KVCacheView]]:
        """(K, V) pool views of the layers this runner computes, each [blocks, slot, heads, dim]."""
        return self._kv_layers

    def close(self) -> None:
        """Release what the runner started (a tensor-parallel rank 0 stops its followers)."""

    @classmethod
    def layout_for(cls, config: EngineConfig) -> KVLayout:
        """The KV layout this config's runner will use; reads config.json and the weights
        fingerprint (hashing the weights only when no cached fingerprint is current), with
        the dtype resolved as the runner resolves it."""
        config = resolved_config(config)
        model_config = load_config(config.model_dir)
        scheme = served_quantization(config.quantization, model_config.prequant)
        lm_head = served_lm_head(config.lm_head_quantization, scheme)
        return cls._with_draft(kv_layout(model_config, config.cache.block_size, config.dtype,
                                    weights_fingerprint(config.model_dir).digest, config.kv_cache_dtype,
                                    scheme, lm_head, numerics(torch.device(config.device).type, config.dtype,
                                                              scheme, lm_head)),
                          config)

    @classmethod
    def _with_draft(cls, layout: KVLayout, config: EngineConfig) -> KVLayout:
        """`layout` with the draft's identity when `config` ships draft KV (draft_kv=prefill)."""
        spec = config.speculative
        if spec is None or not spec.ships_draft_kv or spec.model is None:
            return layout
        draft = cls.layout_for(draft_engine_config(config, spec.model, 2))
        return replace(layout, draft=draft.compat_hash)

    @staticmethod
    def num_blocks_for_bytes(layout: KVLayout, budget_bytes: int) -> int:
        """Blocks (including the null block) that fit in `budget_bytes`."""
        return budget_bytes // (layout.block_bytes_per_layer * layout.num_layers)

    def _num_blocks_from_budget(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        budget = cache.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":  # the weights are loaded: what they took is exact
                weights = torch.cuda.memory_allocated(self.device)
                budget = cuda_kv_budget(self.config, self.model_config, weights).kv_bytes
            else:
                budget = DEFAULT_CPU_KV_BYTES
        n = self.num_blocks_for_bytes(self.layout, budget)
        if n < 2:
            raise ValueError(f"KV cache budget of {budget} bytes holds fewer than 2 blocks")
        return n

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[SeqChunk],
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Compute one step; float32 logits [sum of chunks' num_logits, vocab] in chunk order
        (one row per chunk with need_logits, plus one per draft token).

        `layer_hook(i)` is called once layer i's K/V for all chunks is in the pool.
        On CUDA the writes are queued on the current stream when the hook runs;
        work the hook enqueues on that stream is ordered after them.
        """
        if not chunks:
            return torch.empty(0, self.model_config.vocab_size, dtype=torch.float32)
        self._check(chunks)
        if (self._graphs is not None and layer_hook is None
                and not any(c.prompt_logits or c.lora_id for c in chunks)):
            replayed = self._graphs.run(chunks)  # None: not a step a graph covers
            if replayed is not None:
                return replayed
        step = self.step_inputs(chunks)
        hidden = self.model(step.input_ids, step.positions, step.meta, self._kv_layers, self.backend, layer_hook,
                            lora=step.lora)
        return self.logits(hidden, step.logit_rows, step.logit_index)

    def step_inputs(self, chunks: Sequence[SeqChunk]) -> StepInputs:
        """Flat token ids, positions and attention metadata of checked `chunks`."""
        order = order_chunks(chunks)
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        last_row: dict[int, int] = {}
        for i in order:
            c = chunks[i]
            ids.extend(c.token_ids)
            positions.append(torch.arange(c.start_pos, c.end_pos))
            last_row[i] = len(ids) - 1
        # On CUDA everything is built on the host and crosses in one pinned copy.
        host = torch.device("cpu") if self._stager is not None else self.device
        meta = build_metadata(chunks, order, self.block_size, self.dtype, host,
                              self.backend.flat_decode)
        input_ids = torch.tensor(ids, dtype=torch.long, device=host)
        pos = torch.cat(positions).to(host)
        rows = [r for i, c in enumerate(chunks) for r in range(last_row[i] - c.num_logits + 1, last_row[i] + 1)]
        index = None
        if self._stager is not None:
            staged = stage_metadata(input_ids, pos, meta, self._stager,
                                    torch.tensor(rows, dtype=torch.long) if rows else None)
            input_ids, pos, meta, index = staged
        return StepInputs(input_ids, pos, meta, rows, index, self._lora_batch(chunks, order))

    def _lora_batch(self, chunks: Sequence[SeqChunk], order: Sequence[int]) -> LoraBatch | None:
        """The step's adapter rows, each adapter made resident; None for a base-only step."""
        fps = {c.lora_id for c in chunks if c.lora_id}
        if not fps:
            return None
        if self.loras is None:
            raise ValueError("a chunk runs under a LoRA adapter, but LoRA is not enabled")
        stack = self.loras.stack(fps)
        runs = [(chunks[i].lora_id, chunks[i].num_tokens) for i in order]
        return LoraBatch.build(runs, stack, self.device)

    def logits(self, hidden: torch.Tensor, rows: list[int], index: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Float32 logits of the final-norm `hidden` at `rows` (`index`: the same rows as
        a device tensor already staged, else built here)."""
        if not rows:
            return torch.empty(
                0, self.model_config.vocab_size, dtype=torch.float32, device=self.device
            )
        if index is None:
            index = torch.tensor(rows, dtype=torch.long, device=self.device)
        sel = hidden[index]
        return self.model.compute_logits(sel).float()

    def _check(self, chunks: Sequence[SeqChunk]) -> None:
        bs = self.block_size
        for c in chunks:
            if not c.token_ids:
                raise ValueError("a SeqChunk must carry at least one token")
            if not 0 <= c.num_draft_tokens < len(c.token_ids):
                raise ValueError(f"{c.num_draft_tokens} draft tokens in a chunk of {len(c.token_ids)}")
            if c.prompt_logits and c.num_draft_tokens:
                raise ValueError("a prompt_logits chunk carries no drafts")
            if c.start_pos < 0 or c.end_pos > self.max_model_len:
                raise ValueError(
                    f"chunk covers positions [{c.start_pos}, {c.end_pos}) beyond max_model_len {self.max_model_len}"
                )
            needed = (c.end_pos + bs - 1) // bs
            if len(c.block_table) < needed:
                raise ValueError(f"block table has {len(c.block_table)} blocks, {needed} needed")
            table = c.block_table[:needed]
            if min(table) < 0 or max(table) >= self.num_blocks:
                raise ValueError(f"block id out of range [0, {self.num_blocks}) in block table")
