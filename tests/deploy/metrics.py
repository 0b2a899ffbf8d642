"""The metric names pdserve's processes export, in one place.

deploy/ (HPAs, prometheus-adapter rules, KEDA triggers, the Grafana dashboard)
may use only these. When a metric is renamed in the code, change it here and
the tests point at every manifest that still uses the old name;
`names_defined_in_source` cross-checks this list against the code itself.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_PACKAGES = ("gateway", "prefill_node", "decode_node", "worker", "common", "pdserve", "engine", "kv_transfer")

# Histograms export <name>_bucket, <name>_count and <name>_sum series.
HISTOGRAMS = frozenset(
    {
        "llm_time_to_first_token_seconds",
        "llm_time_per_output_token_seconds",
        "llm_e2e_request_latency_seconds",
        "llm_queue_wait_seconds",
        "llm_request_stage_seconds",
        "llm_kv_transfer_seconds",
    }
)

# Every worker role serves the same WorkerMetrics (pdserve/worker/metrics.py).
_WORKER = frozenset(
    {
        "llm_kv_cache_usage_ratio",
        "llm_current_batch_size",  # running sequences (set on decode/colocated only)
        "llm_waiting_sequences",
        "llm_kv_free_blocks",
        "llm_prefill_tokens_total",
        "llm_decode_tokens_total",
        "llm_prefill_requests_total",
        "llm_worker_requests_total",
        "llm_kv_transfer_bytes_total",
        "llm_kv_transfer_failures_total",
        "llm_preemptions_total",
        "llm_worker_aborts_total",
        "llm_kv_transfer_seconds",
        # Queued prompt tokens (the heartbeat's queued_prefill_tokens; set on
        # prefill/colocated workers, the prefill HPA's signal) and running sequences.
        "llm_prefill_queued_tokens",
        "llm_num_running_seqs",
        "llm_role_flips_total",
        "llm_torch_threads",  # --thread-policy adaptive keeps it current
        "llm_thread_switches_total",  # label: reason
        "llm_core_borrows_total",  # 1P+1D core sharing: widenings onto the other worker's cores
    }
)

# Metrics deploy/ may use before the code defines them (reported as an expected
# failure by the source cross-check, not an error). None at present.
PENDING_METRICS: frozenset[str] = frozenset()

# Per process role, as Prometheus series names (counters with their _total).
EXPORTED_METRICS: dict[str, frozenset[str]] = {
    "gateway": frozenset(
        {
            "llm_time_to_first_token_seconds",
            "llm_time_per_output_token_seconds",
            "llm_e2e_request_latency_seconds",
            "llm_queue_wait_seconds",
            "llm_request_stage_seconds",
            "llm_requests_rejected_total",
            "llm_requests_total",
            "llm_prompt_tokens_total",
            "llm_generation_tokens_total",
            "llm_prompt_cached_tokens_total",
            "llm_queue_depth",  # label: priority
            "llm_requests_in_flight",
            "llm_role_flips_total",  # labels: from_role, to_role
            "llm_planner_desired_workers",  # label: role (--planner)
            "llm_planner_pressure",
            "llm_planner_decisions_total",
        }
    ),
    "prefill": _WORKER,
    "decode": _WORKER,
}


def _series(names: frozenset[str]) -> frozenset[str]:
    out = set(names)
    for h in names & HISTOGRAMS:
        out |= {f"{h}_bucket", f"{h}_count", f"{h}_sum"}
    return frozenset(out)


EXPORTED_METRICS = {role: _series(names) for role, names in EXPORTED_METRICS.items()}
ALL_EXPORTED: frozenset[str] = frozenset().union(*EXPORTED_METRICS.values())
# Series Prometheus itself attaches to every target.
PROMETHEUS_BUILTINS = frozenset({"up"})

_LLM_NAME = re.compile(r"\b(llm_[A-Za-z0-9_]+)")
_BUILTIN = re.compile(r"\b(up)\s*\{")
_STRING_LITERAL_NAME = re.compile(r"""["'](llm_[a-z0-9_]+)["']""")
_SERIES_SUFFIX = re.compile(r"_(total|bucket|count|sum|created)$")


def metric_names_in_promql(expr: str) -> set[str]:
    """Metric names a PromQL expression (or adapter seriesQuery) reads."""
    return set(_LLM_NAME.findall(expr)) | set(_BUILTIN.findall(expr))


def family(series: str) -> str:
    """`llm_x_total` / `llm_h_bucket` -> the name given to prometheus_client."""
    return _SERIES_SUFFIX.sub("", series)


class _DefinedNames(frozenset[str]):
    def __contains__(self, series: object) -> bool:
        return isinstance(series, str) and frozenset.__contains__(self, family(series))


def names_defined_in_source() -> frozenset[str]:
    """Metric families named by string literals in the shipped packages.

    Membership accepts exported series names: `"llm_prefill_tokens_total" in
    names_defined_in_source()` holds when the code defines `llm_prefill_tokens`
    or `llm_prefill_tokens_total` (prometheus_client adds `_total` itself).
    """
    found = set()
    for pkg in SOURCE_PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            found |= {family(n) for n in _STRING_LITERAL_NAME.findall(path.read_text())}
    return _DefinedNames(found)
