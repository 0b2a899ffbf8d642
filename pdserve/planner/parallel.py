"""`pdserve plan --devices N`: the smallest tensor x pipeline parallel layout that holds
the weights plus the working KV (`--concurrency` full-length requests, default 1).

Per device, for TP t and PP p (t x p devices; TP inside a node, PP across nodes):

- weights = all weights / (t x p) (split evenly; the engine's replicated embedding
  and LM head add vocab x hidden x bytes per extra rank, `replicated_bytes`); under
  weight quantization "all weights" are the quantized bytes `pdserve.planner.capacity` counts
  (codes, scales and zeros split with their channels);
- KV bytes per token = 2 x (layers / p, rounded up) x KV heads per rank x head_dim x
  KV bytes, where a rank holds KV heads / t of them, or one when t exceeds the KV heads
  (replicated);
- KV budget = device memory - overhead - weights; max concurrency = budget // KV of
  one full-length request on that device.

Layouts are tried by device count, then fewer pipeline stages (a collective inside a
node is cheaper than a stage boundary); a TP size must split the heads as the engine
does (`pdserve.engine.parallel.plan.check_tp`) and, under int4/AWQ/GPTQ, give each rank whole
quantization groups (`check_tp_quant`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.parallel.plan import ParallelLayoutError, check_tp, check_tp_quant
from pdserve.planner.capacity import CapacityPlan, format_bytes


@dataclass(frozen=True)
class ParallelPlan:
    tensor_parallel: int
    pipeline_parallel: int
    weight_bytes_per_device: int
    replicated_bytes: int  # embedding + LM head every rank holds in full (not in the line above)
    kv_heads_per_device: int
    kv_bytes_per_token_per_device: int
    kv_budget_bytes_per_device: int
    max_concurrency: int
    concurrency: int

    @property
    def devices(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "devices": self.devices}


def layout_plan(plan: CapacityPlan, cfg: ModelConfig, tp: int, pp: int, concurrency: int) -> ParallelPlan:
    """The per-device figures of one layout (see the module docstring)."""
    n = tp * pp
    weights = -(-plan.weight_bytes // n)
    heads = max(1, cfg.num_kv_heads // tp)
    layers = -(-cfg.num_layers // pp)
    per_token = 2 * layers * heads * cfg.head_dim * plan.kv_bytes_per_element
    request_tokens = plan.kv_bytes_per_request // plan.kv_bytes_per_token
    budget = max(0, plan.device_memory - plan.overhead_bytes - weights)
    embed = cfg.vocab_size * cfg.hidden_size * plan.bytes_per_element * (1 if cfg.tie_word_embeddings else 2)
    extra = embed - -(-embed // n)  # a full copy beyond its even share
    return ParallelPlan(tp, pp, weights, extra, heads, per_token, budget, budget // (request_tokens * per_token),
                        concurrency)


def recommend(plan: CapacityPlan, cfg: ModelConfig, max_devices: int, devices_per_node: int = 8,
              concurrency: int = 1) -> ParallelPlan | None:
    """The smallest layout of at most `max_devices` holding `concurrency` full requests;
    None if none does."""
    layouts = []
    for tp in range(1, min(max_devices, devices_per_node) + 1):
        try:
            check_tp(cfg, tp)
            check_tp_quant(cfg, tp, plan.quantization)
        except ParallelLayoutError:
            continue
        layouts += [(tp * pp, pp, tp) for pp in range(1, min(cfg.num_layers, max_devices // tp) + 1)]
    for _, pp, tp in sorted(layouts):
        candidate = layout_plan(plan, cfg, tp, pp, concurrency)
        if candidate.max_concurrency >= concurrency:
            return candidate
    return None


def format_parallel(p: ParallelPlan | None, max_devices: int, concurrency: int) -> str:
    if p is None:
        return f"{'parallel layout:':<22}none of up to {max_devices} devices holds {concurrency} full requests"
    rows = [
        ("parallel layout", f"tensor parallel {p.tensor_parallel} x pipeline parallel {p.pipeline_parallel} "
         f"({p.devices} devices)"),
        ("weights per device", f"{format_bytes(p.weight_bytes_per_device)} (+ {format_bytes(p.replicated_bytes)} "
         "replicated embedding/LM head)"),
        ("KV per device", f"{format_bytes(p.kv_budget_bytes_per_device)} budget, "
         f"{format_bytes(p.kv_bytes_per_token_per_device)} per token ({p.kv_heads_per_device} KV heads)"),
        ("max concurrency", f"{p.max_concurrency:,} full requests (asked for {p.concurrency})"),
    ]
    return "\n".join(f"{label + ':':<22}{value}" for label, value in rows)
