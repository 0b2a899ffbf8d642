"""Build a prefill worker's node: engine, KV sender and node."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from worker.main import NodeParts, WorkerOptions, kv_keys, pool_array
from worker.node_api import Node


def build_prefill(engine_cfg: EngineConfig, opts: WorkerOptions,
                  parts: NodeParts) -> tuple[Node, list[Callable[[], Any]]]:
    from common.parallel_layout import ParallelLayout
    from kv_transfer import make_sender
    from prefill_node.node import PrefillNode
    from worker.engine_glue import build_engine

    engine, runner = build_engine(engine_cfg)
    sender = make_sender(runner.layout, pool_array(runner), faults=parts.kv_faults,
                         curve=kv_keys(opts), parallel=ParallelLayout.of(
                             engine_cfg.tensor_parallel_size, engine_cfg.pipeline_parallel_size, runner.layout))
    node = PrefillNode(parts.worker_id, engine, runner, sender, parts.send, parts.metrics,
                       direct=opts.kv_transport != "tcp")
    return node, [runner.close]
