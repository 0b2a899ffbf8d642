"""Build a decode worker's node: the KV pool (shared memory, CUDA or plain), the
engine on top of it, the KV receiver and the node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from worker.main import NodeParts, WorkerOptions, pool_array
from worker.node_api import Node


def build_decode(engine_cfg: EngineConfig, opts: WorkerOptions,
                 parts: NodeParts) -> tuple[Node, list[Callable[[], Any]]]:
    from decode_node.node import DecodeNode
    from engine.model_runner import ModelRunner
    from kv_transfer.receiver import ZmqReceiver
    from worker.engine_glue import build_engine

    worker_id, send, metrics = parts.worker_id, parts.send, parts.metrics
    cleanup: list[Callable[[], Any]] = []
    layout = ModelRunner.layout_for(engine_cfg)
    num_blocks = engine_cfg.cache.num_blocks or ModelRunner.num_blocks_for_bytes(
        layout, engine_cfg.cache.kv_cache_memory or default_kv_bytes()
    )
    if engine_cfg.device.startswith("cuda"):
        # The pool lives in one cudaMalloc whose IPC handle same-host prefill workers map.
        from kv_transfer.cuda_ipc import create_cuda_pool
        from kv_transfer.tensor_adapter import tensor_from_array

        cuda_pool = create_cuda_pool(layout, num_blocks, cuda_index(engine_cfg.device))
        engine, runner = build_engine(engine_cfg, kv_buffer=tensor_from_array(cuda_pool.array, layout.dtype),
                                      layout=layout)
        receiver = ZmqReceiver(runner.layout, cuda_pool, transport="cuda+tcp", host=opts.kv_host,
                               port=opts.kv_port, faults=parts.kv_faults)
        return DecodeNode(worker_id, engine, runner, receiver, send, metrics, ""), cleanup
    if opts.kv_transport == "tcp":
        engine, runner = build_engine(engine_cfg, layout=layout)
        receiver = ZmqReceiver(runner.layout, pool_array(runner), transport="tcp", host=opts.kv_host,
                               port=opts.kv_port, faults=parts.kv_faults)
        return DecodeNode(worker_id, engine, runner, receiver, send, metrics, ""), cleanup
    from kv_transfer.shm_pool import create_shm_pool

    shm_pool = create_shm_pool(layout, num_blocks)  # sweeps segments of dead workers first
    cleanup.append(shm_pool.unlink)
    try:
        engine, runner = build_engine(engine_cfg, kv_buffer=shm_pool.array, layout=layout)
        receiver = ZmqReceiver(runner.layout, shm_pool, transport="shm+tcp", host=opts.kv_host,
                               port=opts.kv_port, faults=parts.kv_faults)
    except BaseException:
        shm_pool.unlink()  # the cleanup list never reaches the caller
        raise
    return DecodeNode(worker_id, engine, runner, receiver, send, metrics, shm_pool.descriptor.name), cleanup


def cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index else 0


def default_kv_bytes() -> int:
    from engine.config import DEFAULT_CPU_KV_BYTES

    return DEFAULT_CPU_KV_BYTES
