"""Build a decode worker's node: the KV pool (shared memory, CUDA or plain), the
engine on top of it (with the KV tiers below its pool, if any), the KV receiver and
the node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdserve.engine.core.config import EngineConfig
from pdserve.worker.main import NodeParts, WorkerOptions, kv_keys, pool_array
from pdserve.worker.node_api import Node


def build_decode(engine_cfg: EngineConfig, opts: WorkerOptions,
                 parts: NodeParts) -> tuple[Node, list[Callable[[], Any]]]:
    from decode_node.node import DecodeNode
    from kv_transfer import make_receiver
    from pdserve.common.parallel_layout import ParallelLayout
    from pdserve.engine.runner.model_runner import ModelRunner
    from pdserve.worker.draft_kv import build_receipts
    from pdserve.worker.engine_glue import build_engine
    from pdserve.worker.kv_tiers import attach_tiers

    layout = ModelRunner.layout_for(engine_cfg)
    curve = kv_keys(opts)
    tiers: list[Callable[[], Any]] = []  # flush and close the KV tiers first

    def node(kv_buffer: Any, pool: Any, transport: str, kv_shm: str = "") -> DecodeNode:
        """The engine over `kv_buffer` (None: its own pool), a receiver for `pool` (None:
        the engine's pool) over `transport`, and the node."""
        engine, runner = build_engine(engine_cfg, kv_buffer=kv_buffer, layout=layout, pool_name=kv_shm)
        tiers.extend(attach_tiers(opts.kv_offload, engine, parts.metrics, parts.tier_events, parts.wake))  # the reused prefix's source too
        receiver = make_receiver(runner.layout, pool_array(runner) if pool is None else pool, transport,
                                 host=opts.kv_host, port=opts.kv_port, faults=parts.kv_faults,
                                 curve=curve, parallel=ParallelLayout.of(
                                     engine_cfg.tensor_parallel_size, engine_cfg.pipeline_parallel_size,
                                     runner.layout))
        drafts = build_receipts(engine, parts.metrics, parts.kv_faults, curve, opts.kv_host)
        return DecodeNode(parts.worker_id, engine, runner, receiver, parts.send, parts.metrics, kv_shm, drafts,
                          parts.traces)

    on_cuda = engine_cfg.device.startswith("cuda")
    transport = receiver_transport(opts.kv_transport, on_cuda)
    if transport == "tcp":  # the engine's own pool; on CUDA, frames land through host staging
        plain = node(None, None, "tcp")
        return plain, [*tiers, plain.runner.close]
    num_blocks = engine_cfg.cache.num_blocks or ModelRunner.num_blocks_for_bytes(
        layout, engine_cfg.cache.kv_cache_memory or default_kv_bytes(engine_cfg)
    )
    if on_cuda:
        # The pool lives in one cudaMalloc whose IPC handle same-host prefill workers map.
        from kv_transfer.pool.cuda_ipc import create_cuda_pool
        from kv_transfer.pool.tensor_adapter import tensor_from_array

        cuda_pool = create_cuda_pool(layout, num_blocks, cuda_index(engine_cfg.device))
        on_gpu = node(tensor_from_array(cuda_pool.array, layout.dtype), cuda_pool, transport)
        return on_gpu, [*tiers, on_gpu.runner.close]
    from kv_transfer.pool.shm import create_shm_pool

    shm_pool = create_shm_pool(layout, num_blocks)  # sweeps segments of dead workers first
    try:
        shared = node(shm_pool.array, shm_pool, transport, shm_pool.descriptor.name)
        return shared, [*tiers, shared.runner.close, shm_pool.unlink]
    except BaseException:
        shm_pool.unlink()  # the cleanup list never reaches the caller
        raise


def receiver_transport(kv_transport: str, on_cuda: bool) -> str:
    """The receiver for `--kv-transport`: tcp is plain frames whatever the device (a
    device pool is written through host staging: pods on different hosts); auto (and
    shm on CPU) also offers same-host senders direct writes -- shared memory on CPU,
    CUDA IPC on a GPU -- with tcp for the control messages."""
    if kv_transport == "tcp":
        return "tcp"
    if kv_transport not in ("auto", "shm"):
        raise ValueError(f"unknown --kv-transport {kv_transport!r} (auto, tcp, shm)")
    if on_cuda and kv_transport == "shm":
        raise ValueError("--kv-transport shm keeps KV in host shared memory but the device is "
                         "a GPU: use auto (CUDA IPC with same-host peers) or tcp")
    return "cuda+tcp" if on_cuda else "shm+tcp"


def cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index else 0


def default_kv_bytes(engine_cfg: EngineConfig) -> int:
    """The pool's bytes without --kv-cache-memory: on CUDA what --gpu-memory-utilization of
    the device leaves after the weights (counted from the checkpoint's headers, as the pool
    is made before they load) and activations; on CPU DEFAULT_CPU_KV_BYTES."""
    from pdserve.engine.core.config import DEFAULT_CPU_KV_BYTES

    if not engine_cfg.device.startswith("cuda"):
        return DEFAULT_CPU_KV_BYTES
    from pathlib import Path

    from pdserve.engine.loading.dtype import resolved_config
    from pdserve.engine.loading.loader import load_config, weight_files
    from pdserve.engine.runner.kv_pool import TORCH_DTYPES
    from pdserve.engine.runner.memory_budget import checkpoint_weight_bytes, cuda_kv_budget

    cfg = resolved_config(engine_cfg)
    files = sorted(set(weight_files(Path(cfg.model_dir)).values()))
    weights = checkpoint_weight_bytes(files, TORCH_DTYPES[cfg.dtype].itemsize)
    return cuda_kv_budget(cfg, load_config(cfg.model_dir), weights).kv_bytes
