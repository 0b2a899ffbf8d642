"""A worker's Prometheus metrics and its small HTTP server (`/health`, `/metrics`).

Each worker owns one `CollectorRegistry` (no process-global registry), served
on a loopback port by a small fixed pool of threads with read timeouts
(pdserve/worker/metrics_http.py). The same gauges travel in heartbeats
so the gateway can re-export the fleet.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pdserve.common.roles import Role
from pdserve.engine.lora.config import LoraStats
from pdserve.worker.metrics_http import DEFAULT_TIMEOUT_S, BoundedHTTPServer
from pdserve.worker.node_api import NodeLoad


class WorkerMetrics:
    def __init__(self, role: Role, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"role": role, "worker": worker_id}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(**labels)  # type: ignore[no-any-return]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(**labels)  # type: ignore[no-any-return]

        self.kv_usage = gauge("llm_kv_cache_usage_ratio", "KV cache blocks in use (0-1)")
        self.batch_size = gauge("llm_current_batch_size", "Sequences in the running batch")
        self.waiting = gauge("llm_waiting_sequences", "Sequences waiting to be scheduled")
        self.free_blocks = gauge("llm_kv_free_blocks", "Free KV blocks")
        self.queued_prefill_tokens = gauge("llm_prefill_queued_tokens", "Prompt tokens waiting to be prefilled")
        self.running_seqs = gauge("llm_num_running_seqs", "Sequences the engine is running")
        self.prefill_tokens = counter("llm_prefill_tokens", "Prompt tokens computed")
        self.decode_tokens = counter("llm_decode_tokens", "Output tokens generated")
        self.prefill_requests = counter("llm_prefill_requests", "Prefill computations run")
        self.requests = counter("llm_worker_requests", "Requests accepted by this worker")
        # By transport (pdserve.common.transport.transport_kind): shm, cuda_ipc, tcp or ipc.
        self._transfer_bytes = Counter("llm_kv_transfer_bytes", "KV bytes transferred", [*names, "transport"],
                                       registry=r)
        self._labels = labels
        self.labels = dict(labels)  # role and worker, for collectors that join the registry
        self.transfer_failures = counter("llm_kv_transfer_failures", "Failed KV transfers")
        self.preemptions = counter("llm_preemptions", "Sequences preempted for recompute")
        self.aborts = counter("llm_worker_aborts", "Requests aborted on this worker")
        self.blocks_reused = counter(
            "llm_kv_blocks_reused", "Prompt blocks a decode worker already held, so not shipped")
        self.local_prefills = counter(
            "llm_decode_local_prefills", "Requests a decode worker prefilled itself (no KV transfer)")
        self.reservations_refused = counter(
            "llm_decode_reservations_refused", "Decode reservations refused to keep running streams' room")
        self.transfer_seconds = Histogram(
            "llm_kv_transfer_seconds",
            "KV transfer latency",
            names,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        ).labels(**labels)
        self._info = Gauge("llm_worker_info", "What this worker serves: weight quantization, KV-cache "
                           "and compute dtype, LM head quantization (value 1)",
                           [*names, "quantization", "kv_cache_dtype", "dtype", "lm_head_quantization"],
                           registry=r)
        # Speculative decoding, vLLM's spec_decode_* counters.
        self.spec_drafts = counter("llm_spec_decode_num_drafts", "Sequence steps verified with draft tokens")
        self.spec_draft_tokens = counter("llm_spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted_tokens = counter("llm_spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_draft_prefill_tokens = counter(
            "llm_spec_draft_prefill_tokens", "Prompt tokens the draft model prefilled on this worker")
        self.draft_kv_used_blocks = gauge("llm_spec_draft_kv_used_blocks", "Draft-model KV blocks in use")
        self._spec_per_pos = Counter("llm_spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position", [*names, "position"],
                                     registry=r)
        self._last_preemptions = 0
        self._role = role
        self.torch_threads = gauge("llm_torch_threads", "torch intra-op threads the engine steps run with")
        self._thread_switches = Counter(
            "llm_thread_switches", "Thread-count changes the governor made (--thread-policy adaptive), "
            "by reason: contention, probe_won, recovered", [*names, "reason"], registry=r)
        self.core_borrows = counter("llm_core_borrows", "Times this worker widened onto the other worker's idle "
                                    "cores (one prefill and one decode worker sharing cores, pdserve up)")
        self.role_flips = counter("llm_role_flips", "Live role flips this worker made (its role label is the new role)")
        self._lora_info = Gauge("llm_lora_requests_info", "LoRA adapters of running and waiting sequences "
                                "(vLLM's vllm:lora_requests_info; value: the time it was set)",
                                [*names, "running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        self.lora_loads = gauge("llm_lora_adapter_reads", "LoRA adapters read from disk by this worker")
        self.lora_evictions = gauge("llm_lora_adapter_evictions", "LoRA adapters evicted from a tier")
        self._lora_key: tuple[str, str, str] | None = None

    def set_info(self, quantization: str, kv_cache_dtype: str, dtype: str, lm_head: str = "none") -> None:
        """Once, when the node's engine exists: `llm_worker_info{quantization=...} 1`."""
        self._info.clear()
        self._info.labels(**self._labels, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                          dtype=dtype, lm_head_quantization=lm_head).set(1)

    def add_transfer_bytes(self, transport: str, num_bytes: int) -> None:
        self._transfer_bytes.labels(**self._labels, transport=transport or "unknown").inc(num_bytes)

    def count_thread_switch(self, reason: str) -> None:
        self._thread_switches.labels(**self._labels, reason=reason).inc()

    def add_accepted_at(self, position: int, count: int) -> None:
        self._spec_per_pos.labels(**self._labels, position=str(position)).inc(count)

    def set_preemptions(self, total: int) -> None:
        if total > self._last_preemptions:
            self.preemptions.inc(total - self._last_preemptions)
            self._last_preemptions = total

    def set_lora(self, s: LoraStats) -> None:
        """The adapters of running and waiting sequences (one sample, re-set on change)."""
        key = (",".join(s.running), ",".join(s.waiting), str(s.max_loras))
        if key != self._lora_key:
            self._lora_info.clear()
            self._lora_info.labels(**self._labels, running_lora_adapters=key[0], waiting_lora_adapters=key[1],
                                   max_lora=key[2]).set(time.time())
            self._lora_key = key
        self.lora_loads.set(s.loads)
        self.lora_evictions.set(s.evictions)

    def set_load(self, load: NodeLoad) -> None:
        self.free_blocks.set(load.free_blocks)
        self.kv_usage.set((load.total_blocks - load.free_blocks) / max(load.total_blocks, 1))
        self.waiting.set(load.waiting_seqs)
        self.running_seqs.set(load.running_seqs)
        if self._role != Role.DECODE:
            self.queued_prefill_tokens.set(load.queued_prefill_tokens)
        if self._role != Role.PREFILL:
            self.batch_size.set(load.running_seqs)

    def gauges(self) -> dict[str, float]:
        """Values carried in heartbeats for the gateway to re-export."""
        prefill = {} if self._role == Role.DECODE else {
            "llm_prefill_queued_tokens": float(self.queued_prefill_tokens._value.get()),
        }
        return prefill | {
            "llm_kv_cache_usage_ratio": float(self.kv_usage._value.get()),
            "llm_current_batch_size": float(self.batch_size._value.get()),
            "llm_num_running_seqs": float(self.running_seqs._value.get()),
            "llm_prefill_tokens_count": float(self.prefill_tokens._value.get()),
            "llm_decode_tokens_count": float(self.decode_tokens._value.get()),
            "llm_prefill_requests_count": float(self.prefill_requests._value.get()),
        } | ({} if self._role == Role.PREFILL else {
            "llm_spec_decode_num_drafts_count": float(self.spec_drafts._value.get()),
            "llm_spec_decode_num_draft_tokens_count": float(self.spec_draft_tokens._value.get()),
            "llm_spec_decode_num_accepted_tokens_count": float(self.spec_accepted_tokens._value.get()),
        })

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """`GET /health` and `GET /metrics` on (host, port); port 0 picks a free one."""

    def __init__(self, metrics: WorkerMetrics, host: str, port: int, health: Any,
                 read_timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.metrics = metrics  # replaced whole when the worker switches roles
        outer, outer_health = self, health

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.startswith("/metrics"):
                    body, ctype, code = outer.metrics.render(), CONTENT_TYPE_LATEST, 200
                elif self.path.startswith("/health"):
                    ok = bool(outer_health())
                    body = b'{"status":"ok"}' if ok else b'{"status":"stopping"}'
                    ctype, code = "application/json", 200 if ok else 503
                else:
                    body, ctype, code = b"not found", "text/plain", 404
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self._server = BoundedHTTPServer((host, port), Handler, timeout_s=read_timeout_s)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def refused(self) -> int:
        """Connections closed unserved because every handler thread and queue slot was taken."""
        return self._server.refused

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
