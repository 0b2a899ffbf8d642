"""Build and run one worker process of any role (prefill, decode, colocated)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from decode_node.engine_glue import build_engine
from decode_node.runtime import Node, RuntimeConfig, WorkerRuntime
from decode_node.worker_metrics import WorkerMetrics
from engine.config import EngineConfig
from pdserve.gateways import GatewayLinks
from pdserve.transport import CurveClient, new_worker_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # prefill | decode | colocated
    gateways: tuple[str, ...]  # tcp://HOST:PORT or dns+tcp://NAME:PORT, one channel per gateway
    worker_id: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    heartbeat_s: float = 0.5
    kv_host: str = "127.0.0.1"
    kv_port: int = 0  # decode: fixed tcp port of the KV receiver (0: ephemeral)
    kv_transport: str = "auto"  # auto | tcp | shm
    curve: CurveClient | None = None


def run_worker(engine_cfg: EngineConfig, opts: WorkerOptions) -> int:
    worker_id = opts.worker_id or new_worker_id(opts.role)
    metrics = WorkerMetrics(opts.role, worker_id)
    channel = GatewayLinks(opts.gateways, worker_id, opts.curve)
    rt_cfg = RuntimeConfig(opts.gateways, worker_id, opts.metrics_host, opts.metrics_port, opts.heartbeat_s,
                           curve=opts.curve)  # fmt: skip
    runtime = WorkerRuntime(rt_cfg, channel, metrics)
    node, cleanup = build_node(engine_cfg, opts, worker_id, channel, metrics)
    try:
        return runtime.run(node)
    finally:
        for fn in cleanup:
            fn()
        log.debug("cleanup done")


def build_node(engine_cfg: EngineConfig, opts: WorkerOptions, worker_id: str, channel: GatewayLinks,
               metrics: WorkerMetrics) -> tuple[Node, list[Any]]:  # fmt: skip
    send = channel.send
    if opts.role == "colocated":
        from decode_node.colocated import ColocatedNode

        engine, runner = build_engine(engine_cfg)
        return ColocatedNode(worker_id, engine, runner, send, metrics), []
    if opts.role == "prefill":
        from kv_transfer.links import ZmqLinkFactory
        from kv_transfer.sender import Sender
        from prefill_node.node import PrefillNode

        engine, runner = build_engine(engine_cfg)
        sender = Sender(runner.layout, pool_array(runner), links=ZmqLinkFactory())
        return PrefillNode(worker_id, engine, runner, sender, send, metrics), []
    from decode_node.node import DecodeNode
    from engine.model_runner import ModelRunner
    from kv_transfer.receiver import ZmqReceiver

    cleanup: list[Any] = []
    layout = ModelRunner.layout_for(engine_cfg)
    num_blocks = engine_cfg.cache.num_blocks or ModelRunner.num_blocks_for_bytes(
        layout, engine_cfg.cache.kv_cache_memory or default_kv_bytes()
    )
    if engine_cfg.device.startswith("cuda"):
        # The pool lives in one cudaMalloc whose IPC handle same-host prefill workers map.
        from kv_transfer.cuda_ipc import create_cuda_pool
        from kv_transfer.tensor_adapter import tensor_from_array

        cuda_pool = create_cuda_pool(layout, num_blocks, cuda_index(engine_cfg.device))
        engine, runner = build_engine(engine_cfg, kv_buffer=tensor_from_array(cuda_pool.array, layout.dtype))
        receiver = ZmqReceiver(runner.layout, cuda_pool, transport="cuda+tcp", host=opts.kv_host,
                               port=opts.kv_port)
        return DecodeNode(worker_id, engine, runner, receiver, send, metrics, ""), cleanup
    if opts.kv_transport == "tcp":
        engine, runner = build_engine(engine_cfg)
        receiver = ZmqReceiver(runner.layout, pool_array(runner), transport="tcp", host=opts.kv_host,
                               port=opts.kv_port)
        return DecodeNode(worker_id, engine, runner, receiver, send, metrics, ""), cleanup
    from kv_transfer.shm_pool import create_shm_pool

    shm_pool = create_shm_pool(layout, num_blocks)  # sweeps segments of dead workers first
    cleanup.append(shm_pool.unlink)
    try:
        engine, runner = build_engine(engine_cfg, kv_buffer=shm_pool.array)
        receiver = ZmqReceiver(runner.layout, shm_pool, transport="shm+tcp", host=opts.kv_host,
                               port=opts.kv_port)
    except BaseException:
        shm_pool.unlink()  # the cleanup list never reaches the caller
        raise
    return DecodeNode(worker_id, engine, runner, receiver, send, metrics, shm_pool.descriptor.name), cleanup


def cuda_index(device: str) -> int:
    _, _, index = device.partition(":")
    return int(index) if index else 0


def pool_array(runner: Any) -> Any:
    """The runner's KV pool as an array for the transfer layer (numpy on CPU, the
    tensor itself on GPU; bfloat16 as raw 16-bit patterns)."""
    from kv_transfer.tensor_adapter import pool_array as adapt

    return adapt(runner.pool.kv)


def default_kv_bytes() -> int:
    from engine.config import DEFAULT_CPU_KV_BYTES

    return DEFAULT_CPU_KV_BYTES
