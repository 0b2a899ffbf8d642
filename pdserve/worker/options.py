"""What a worker process is asked to be (`WorkerOptions`), and what a role's node builder
gets (`NodeParts`) and returns (`NodeBuilder`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_transfer.auth import KVCurve
from kv_transfer.faults import FaultConfig
from kv_transfer.tiers import KVOffloadConfig, TierEventLog
from pdserve.common.roles import Role
from pdserve.common.tracing import Tracer
from pdserve.common.transport import CurveClient
from pdserve.engine.core.config import EngineConfig
from pdserve.worker.gateways import GatewayLinks
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import Node
from pdserve.worker.tracing import WorkerTraces
from pdserve.worker.vllm_events.config import KVEventsConfig


@dataclass(frozen=True)
class WorkerOptions:
    role: Role
    gateways: tuple[str, ...]  # tcp://HOST:PORT or dns+tcp://NAME:PORT, one channel per gateway
    worker_id: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    heartbeat_s: float = 0.5
    kv_host: str = "127.0.0.1"
    kv_port: int = 0  # decode: fixed tcp port of the KV receiver (0: ephemeral)
    kv_transport: str = "auto"  # auto | tcp | shm
    curve: CurveClient | None = None
    fault_injection: bool = False  # honour PDSERVE_FAULTS / PDSERVE_KV_FAULTS (tests only)
    kv_curve: KVCurve | None = None  # CURVE on the KV sockets (prefill and decode)
    core_share: str | None = None  # keeps / borrows cores with the other role (pdserve/worker/core_sharing.py)
    cpu_cores: tuple[int, ...] = ()  # the cores this worker is pinned to
    borrow_cores: tuple[int, ...] = ()  # the other worker's cores, run on while it is idle
    thread_policy: str = "fixed"  # adaptive: the thread governor picks 1 or N threads per step
    kv_offload: KVOffloadConfig | None = None  # KV tiers below the pool (every role)
    otlp_traces_endpoint: str | None = None  # None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing
    kv_events: KVEventsConfig | None = None  # vLLM-format KV events (pdserve/worker/vllm_events/)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))


class NodeParts:
    """What a role builder gets: the worker's id, its reply channel and the wake-up of
    the main loop's idle wait, its metrics, the KV faults its sender or receiver
    injects (none unless fault injection is on) and the spans of its traced requests
    (`traces`; inert unless tracing is on), and the log its KV tiers' writer reports
    to (`tier_events`; None unless KV events are on)."""

    def __init__(self, worker_id: str, channel: GatewayLinks, metrics: WorkerMetrics,
                 kv_faults: FaultConfig, tracer: Tracer | None = None,
                 tier_events: TierEventLog | None = None) -> None:
        self.worker_id = worker_id
        self.tier_events = tier_events
        self.send = channel.send
        self.wake = channel.wake  # from any thread: the main loop's idle wait ends now
        self.metrics = metrics
        self.kv_faults = kv_faults
        self.traces = WorkerTraces(tracer, worker_id)  # empty and inert without a tracer


# (engine config, options, parts) -> (node, cleanup callables run after the node closes)
NodeBuilder = Callable[[EngineConfig, WorkerOptions, NodeParts], tuple[Node, list[Callable[[], Any]]]]
