"""TPRunner: rank 0 of a tensor- or pipeline-parallel group, a ModelRunner the engine
drives as usual (pipeline stages: `pdserve.engine.parallel.pipeline`).

    runner = make_runner(EngineConfig(model_dir=..., tensor_parallel_size=2))

The engine (one block manager, one scheduler) lives on rank 0 alone. Each step rank 0
broadcasts the step's chunks (`pdserve.engine.parallel.steps`), then every rank runs the same
forward over its slice; the row-parallel projections are summed by one all-reduce per
attention block and one per MLP block. Every rank ends with the full hidden state;
rank 0 computes the logits (replicated LM head) and samples.

On CPU the group's KV pool is one shared-memory segment in the full layout
(`pdserve.engine.parallel.shared_pool`); copy-on-write block copies on rank 0 therefore
cover every rank's heads, and the KV transfer layer reads and writes the pool as
it would a single-process worker's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from pdserve.common.kv_layout import KVLayout
from pdserve.engine.attention.paged import AttentionBackend
from pdserve.engine.core.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.loading.dtype import resolved_config
from pdserve.engine.loading.loader import load_config
from pdserve.engine.parallel.comm import TPGroup, leader_store, reduce_group
from pdserve.engine.parallel.devices import GLOO, group_devices
from pdserve.engine.parallel.pipeline import PipeEvent, leader_step, stage_links
from pdserve.engine.parallel.plan import check_tp_quant, rank_shard
from pdserve.engine.parallel.ranks import RankArgs, RankWatch, exit_process, start_followers
from pdserve.engine.parallel.shared_pool import SharedSegment, create_segment
from pdserve.engine.parallel.steps import encode_step, encode_stop
from pdserve.engine.quant.formats import served_quantization
from pdserve.engine.runner.model_runner import ModelRunner

# Rendezvous and collective timeout: loading a follower's slice must finish within it.
GROUP_TIMEOUT_S = 600.0


def make_runner(config: EngineConfig, kv_buffer: torch.Tensor | np.ndarray | None = None,
                layout: KVLayout | None = None, pool_name: str = "") -> ModelRunner:
    """A ModelRunner, or rank 0 of a tensor-parallel group when the config asks for one.

    `pool_name`: the /dev/shm segment holding `kv_buffer` (tensor parallel only: the
    follower ranks map it)."""
    if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
        return ModelRunner(config, kv_buffer=kv_buffer, layout=layout)
    return TPRunner(config, kv_buffer=kv_buffer, layout=layout, pool_name=pool_name)


class TPRunner(ModelRunner):
    """Rank 0: spawns the follower ranks, then runs as a ModelRunner over its slice."""

    def __init__(
        self,
        config: EngineConfig,
        kv_buffer: torch.Tensor | np.ndarray | None = None,
        backend: AttentionBackend | None = None,
        layout: KVLayout | None = None,
        pool_name: str = "",
        on_rank_death: Callable[[int, int | None], None] = exit_process,
    ) -> None:
        config = resolved_config(config)
        size = config.tensor_parallel_size * config.pipeline_parallel_size
        full = load_config(config.model_dir)
        shard = rank_shard(full, config.tensor_parallel_size, config.pipeline_parallel_size, 0)  # checks first
        check_tp_quant(full, config.tensor_parallel_size, served_quantization(config.quantization, full.prequant))
        devices = group_devices(config.device, size, torch.cuda.device_count() if torch.cuda.is_available() else 0)
        if devices.backend != GLOO:
            # The devices and NCCL are chosen (`pdserve.engine.parallel.devices`, `comm`); the ranks'
            # own KV pools, their block copies and the KV handoff from them are not.
            raise ValueError(f"tensor and pipeline parallel on {config.device} ({devices.backend} over "
                             f"{', '.join(devices.devices)}) is not served yet: the KV pool is shared "
                             "CPU memory; run the group on cpu")
        layout = layout or ModelRunner.layout_for(config)
        if layout.quantized and config.tensor_parallel_size > 1:
            raise ValueError("tensor parallel with a quantized KV cache (--kv-cache-dtype) is not supported yet")
        self._segment: SharedSegment | None = None
        if kv_buffer is None:
            nbytes = _pool_bytes(config, layout)
            self._segment = create_segment(nbytes)
            kv_buffer, pool_name = self._segment.tensor, self._segment.name
        elif not pool_name:
            raise ValueError("a tensor-parallel runner over an external KV buffer needs its shared-memory name")
        nbytes = _buffer_bytes(kv_buffer)
        store = leader_store(size, GROUP_TIMEOUT_S)
        args = [RankArgs(config, layout, r, size, store.port, pool_name, nbytes, GROUP_TIMEOUT_S)
                for r in range(1, size)]
        try:
            self._procs = start_followers(args)
        except BaseException:  # no follower to abandon, but the segment is ours
            if self._segment is not None:
                self._segment.unlink()
            raise
        self._on_rank_death = on_rank_death
        self._watch = RankWatch(self._procs, on_rank_death)
        try:
            super().__init__(config, kv_buffer=kv_buffer, backend=backend, layout=layout, shard=shard)
            self.group = TPGroup(store, 0, size, GROUP_TIMEOUT_S)
            tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
            reduce = reduce_group(store, self.group, tp, pp, GROUP_TIMEOUT_S)
            if reduce is not None:  # tensor parallel: sum the row-parallel partials
                self.model.reduce = reduce.all_reduce
            self.group.barrier()
        except BaseException:
            self._abandon()
            raise
        if self._segment is not None:
            self._segment.unlink()  # every rank has mapped it
        self._store = store
        self._closed = False
        self._links = None if shard.layers is None else stage_links(0, tp, pp, shard.layers)
        # Called with rank 0's pipeline progress (`pdserve.engine.parallel.pipeline.PipeEvent`).
        self.on_pipe_event: PipeEvent | None = None

    @torch.inference_mode()
    def execute(self, chunks: Sequence[SeqChunk],
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor:
        """`ModelRunner.execute` on every rank: checked here, broadcast, then run."""
        if chunks:
            self._check(chunks)  # bad input never reaches the followers
        try:
            if not chunks:
                return super().execute(chunks, layer_hook)
            self.group.broadcast_longs(encode_step(chunks))
            if self._links is not None:
                return leader_step(self, self.group, chunks, self._links, layer_hook, self.on_pipe_event)
            return super().execute(chunks, layer_hook)
        except RuntimeError:  # a collective failed: the group is broken for good
            self._group_failed()
            raise

    def close(self) -> None:
        """Stop the followers and wait for them."""
        if self._closed:
            return
        self._closed = True
        self._watch.stop()
        if any(not p.is_alive() for p in self._procs):
            return  # a broken group: nobody would hear the stop
        self.group.broadcast_longs(encode_stop())
        for proc in self._procs:
            proc.join(GROUP_TIMEOUT_S)

    def _group_failed(self) -> None:
        """Report the first dead follower (or rank 0's own failure) once."""
        self._watch.stop()
        for rank, proc in enumerate(self._procs, start=1):
            proc.join(1.0)
            if proc.exitcode is not None:
                self._on_rank_death(rank, proc.exitcode)
                return
        self._on_rank_death(0, None)

    def _abandon(self) -> None:
        """Construction failed: stop the followers without a word on the group."""
        self._watch.stop()
        for proc in self._procs:
            proc.kill()
            proc.join(5.0)
        if self._segment is not None:
            self._segment.unlink()

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the follower ranks (1..size-1)."""
        return [int(p.pid) for p in self._procs]


def _pool_bytes(config: EngineConfig, layout: KVLayout) -> int:
    block = layout.block_bytes_per_layer * layout.num_layers
    blocks = config.cache.num_blocks or ModelRunner.num_blocks_for_bytes(
        layout, config.cache.kv_cache_memory or DEFAULT_CPU_KV_BYTES)
    if blocks < 2:
        raise ValueError("the KV cache budget holds fewer than 2 blocks")
    return blocks * block


def _buffer_bytes(buffer: Any) -> int:
    if isinstance(buffer, np.ndarray):
        return int(buffer.nbytes)
    return int(buffer.numel() * buffer.element_size())
