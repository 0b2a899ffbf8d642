"""Build a prefill worker's node: engine, KV sender and node."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from pdserve.engine.core.config import EngineConfig
from pdserve.worker.main import NodeParts, WorkerOptions, kv_keys, pool_array
from pdserve.worker.node_api import Node


def prefill_engine_config(engine_cfg: EngineConfig) -> EngineConfig:
    """A prefill worker's engine config: no decode graphs (it never runs a decode step, so
    capturing them would only cost start-up time and graph-pool memory), and speculation
    only to run the draft whose KV it ships (draft_kv=prefill)."""
    if engine_cfg.cuda_graphs:
        logging.getLogger(__name__).info("--cuda-graphs ignored: a prefill worker runs no decode steps")
    spec = engine_cfg.speculative
    return dataclasses.replace(engine_cfg, cuda_graphs=False,
                               speculative=spec if spec is not None and spec.ships_draft_kv else None)


def build_prefill(engine_cfg: EngineConfig, opts: WorkerOptions,
                  parts: NodeParts) -> tuple[Node, list[Callable[[], Any]]]:
    from kv_transfer import make_sender
    from pdserve.common.parallel_layout import ParallelLayout
    from pdserve.worker.draft_kv import build_shipper
    from pdserve.worker.engine_glue import build_engine
    from pdserve.worker.kv_tiers import attach_tiers
    from prefill_node.node import PrefillNode

    engine, runner = build_engine(prefill_engine_config(engine_cfg))
    tiers = attach_tiers(opts.kv_offload, engine, parts.metrics, parts.tier_events, parts.wake)
    sender = make_sender(runner.layout, pool_array(runner), faults=parts.kv_faults,
                         curve=kv_keys(opts), parallel=ParallelLayout.of(
                             engine_cfg.tensor_parallel_size, engine_cfg.pipeline_parallel_size, runner.layout))
    drafts = build_shipper(engine, parts.metrics, parts.kv_faults, kv_keys(opts))
    node = PrefillNode(parts.worker_id, engine, runner, sender, parts.send, parts.metrics,
                       direct=opts.kv_transport != "tcp", drafts=drafts, traces=parts.traces)
    return node, [*tiers, runner.close]
