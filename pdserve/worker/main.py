"""Build and run one worker process of any role: the role's node comes from a builder
that the caller (the CLI) picks, so this package never imports a node package.

`WorkerOptions`, `NodeParts` and `NodeBuilder` are in pdserve/worker/options.py; they are
re-exported here for the node packages' builders."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from kv_transfer.auth import CurveKeys, load_keys
from kv_transfer.tiers import TierEventLog
from pdserve.common.roles import Role
from pdserve.common.tracing import make_tracer
from pdserve.common.transport import new_worker_id
from pdserve.engine.core.config import EngineConfig
from pdserve.worker.core_sharing import share_cores
from pdserve.worker.cpu_cores import apply_grant
from pdserve.worker.faults import injected_faults
from pdserve.worker.gateways import GatewayLinks
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import Node
from pdserve.worker.options import NodeBuilder, NodeParts, WorkerOptions
from pdserve.worker.role_switch import RoleSwitcher
from pdserve.worker.runtime import RuntimeConfig, WorkerRuntime
from pdserve.worker.thread_policy import GovernedNode, governed_grant, governor_for

__all__ = ["NodeBuilder", "NodeParts", "WorkerOptions", "build_colocated", "kv_keys", "pool_array",
           "run_worker"]

log = logging.getLogger(__name__)


def run_worker(engine_cfg: EngineConfig, opts: WorkerOptions, build: NodeBuilder,
               flip_builders: Mapping[Role, NodeBuilder] | None = None) -> int:
    """Serve as `opts.role` (its node from `build`); with `flip_builders` (role -> builder)
    the worker can also switch live to any of those roles (pdserve/worker/role_switch.py)."""
    worker_id = opts.worker_id or new_worker_id(opts.role)
    channel = GatewayLinks(opts.gateways, worker_id, opts.curve)
    rt_cfg = RuntimeConfig(opts.gateways, worker_id, opts.metrics_host, opts.metrics_port, opts.heartbeat_s,
                           curve=opts.curve, kv_events=opts.kv_events)
    faults = injected_faults(opts.fault_injection)
    tracer = make_tracer(opts.otlp_traces_endpoint, opts.role, worker_id)
    # What the tiers' writer stored and evicted, for the KV events; kept across role flips.
    tier_events = TierEventLog() if opts.kv_events is not None and opts.kv_events.enabled else None

    def parts_for(role: Role) -> NodeParts:
        metrics = WorkerMetrics(role, worker_id)
        metrics.torch_threads.set(engine_cfg.num_threads or 0)  # a governed node keeps it current
        return NodeParts(worker_id, channel, metrics, faults.kv, tracer, tier_events)

    governor = governor_for(engine_cfg.num_threads or 1) if opts.thread_policy == "adaptive" else None

    def governed(node: Node, metrics: WorkerMetrics) -> Node:
        assert governor is not None
        return GovernedNode(node, governor, metrics)

    switcher = RoleSwitcher(engine_cfg, opts, {**(flip_builders or {}), opts.role: build}, parts_for,
                            governed if governor is not None else None)
    node = switcher.build(opts.role)
    assert switcher.metrics is not None
    runtime = WorkerRuntime(rt_cfg, channel, switcher.metrics, faults.worker,
                            switcher if flip_builders else None, tier_events)
    if opts.core_share:
        node = share_cores(node, opts.core_share, opts.cpu_cores, opts.borrow_cores,
                           governed_grant(governor) if governor is not None else apply_grant,
                           switcher.metrics.core_borrows.inc)
    try:
        return runtime.run(node)
    finally:
        switcher.close()
        if tracer is not None:
            tracer.shutdown()  # exports the spans still queued
        log.debug("cleanup done")


def build_colocated(engine_cfg: EngineConfig, opts: WorkerOptions,
                    parts: NodeParts) -> tuple[Node, list[Callable[[], Any]]]:
    from pdserve.worker.colocated import ColocatedNode
    from pdserve.worker.engine_glue import build_engine
    from pdserve.worker.kv_tiers import attach_tiers

    engine, runner = build_engine(engine_cfg)
    tiers = attach_tiers(opts.kv_offload, engine, parts.metrics, parts.tier_events, parts.wake)
    node = ColocatedNode(parts.worker_id, engine, runner, parts.send, parts.metrics, parts.traces)
    return node, [*tiers, runner.close]


def kv_keys(opts: WorkerOptions) -> CurveKeys | None:
    """The loaded KV-plane keys, or None when the KV sockets run without CURVE."""
    return load_keys(opts.kv_curve) if opts.kv_curve is not None else None


def pool_array(runner: Any) -> Any:
    """The runner's KV pool as an array for the transfer layer (numpy on CPU, the
    tensor itself on GPU; bfloat16 as raw 16-bit patterns)."""
    from kv_transfer.pool.tensor_adapter import pool_array as adapt

    return adapt(runner.pool.kv)
