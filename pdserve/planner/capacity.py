"""Capacity arithmetic for `pdserve plan`: does a model at a context length fit a device?

Torch-free: reads `config.json` through the engine's own parser
(`pdserve.engine.loading.model_config`, so plan and engine agree on every bias and flag) and,
when present, the safetensors headers (for an exact parameter count). The figures:

- for a MoE model (Mixtral, Qwen3-MoE) every expert is counted in the weights, and
  the parameters one token runs through (its top-k experts) are reported beside them;
- weight bytes = parameters x bytes per element of the serving dtype (`auto`, the
  default, resolves as the workers do: `pdserve.engine.loading.dtype`); under weight quantization
  (`--quantization int8|int4`, or an AWQ/GPTQ checkpoint's own) the decoder linears,
  every expert's included, count their quantized bytes with scales and zeros
  (`pdserve.engine.quant.formats`), the embeddings, norms and MoE routers stay in the serving
  dtype, as the engine keeps them; the LM head counts as int8 where the workers' would be
  (`--lm-head-quantization`, `served_lm_head`: a tied head's int8 copy adds to the embedding);
- KV bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes of the
  KV-cache dtype (the serving dtype, or `--kv-cache-dtype fp8|int8`: 1 byte; their
  per-block scales are not counted) -- never the query head count;
- KV per full-length request = that x max-model-len (rounded up to whole blocks);
- KV budget = device memory - weights - overhead (10% of the device by default,
  for activations, graphs, fragmentation and runtime);
- token budget = KV budget // KV bytes per token; max concurrency = KV budget //
  KV per request;
- cost per 1M output tokens = GPU hourly cost / (3,600 x output tokens/s) x 10^6
  (`--gpu-hourly-cost` with `--throughput`);
- per KV tier below the pool (host, disk, remote: `pdserve.planner.tiers`): its bound,
  the bytes of one stored block, and the blocks and prefix tokens it holds.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass
from math import prod
from pathlib import Path
from typing import Any, NamedTuple

from pdserve.common.kv_layout import DTYPE_BYTES
from pdserve.common.lora_checkpoint import ProjectionDims, adapter_bytes
from pdserve.engine.loading.dtype import host_cpu_flags, resolve_dtype
from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError
from pdserve.engine.quant.formats import (
    INT4_GROUP,
    QuantizationError,
    linear_weight_bytes,
    served_lm_head,
    served_quantization,
)
from pdserve.planner.tiers import TIER_NAMES, TierCapacity, format_tier, record_bytes, tier_capacity

DEFAULT_OVERHEAD_FRACTION = 0.10
# `--kv-cache-dtype` values plan takes beyond the serving dtypes: one byte an element.
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "int8")
_KV_BYTES = {**DTYPE_BYTES, "fp8": 1, "fp8_e4m3": 1, "int8": 1}

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class PlanError(ValueError):
    """Bad input to the planner (unreadable config, unknown dtype, bad size)."""


def parse_size(text: str) -> int:
    """Bytes in `text`: `80GiB`, `80Gi`, `80G` (binary), `80GB` (decimal), `512MiB`, `1024`."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise PlanError(f"cannot parse size {text!r} (examples: 80GiB, 80GB, 512MiB, 1024)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    """`128 KiB`, `1 GiB`, `11.05 GiB`: the largest binary unit, exact when possible."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n // size} {unit}" if n % size == 0 else f"{n / size:.2f} {unit}"
    return f"{n} B"


def param_count(cfg: ModelConfig) -> int:
    """Parameters of the engine's Llama-family decoder for this config (the same bias,
    q/k-norm and tied-embedding flags the engine builds its model from)."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    attn = h * q + 2 * h * kv + q * h
    if cfg.attention_bias:  # q/k/v
        attn += q + 2 * kv
    if cfg.o_proj_bias:
        attn += h
    mlp = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h if cfg.mlp_bias else 0)
    norms = 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    sparse = len(cfg.moe.sparse_layers) if cfg.moe else 0
    experts = expert_counts(cfg)
    router = h * cfg.moe.num_experts * sparse if cfg.moe else 0
    return embed + cfg.num_layers * (attn + norms) + (cfg.num_layers - sparse) * mlp + router + experts.total + h


class ExpertCounts(NamedTuple):
    """Expert weights of a MoE model (zeros for a dense one): all experts of every
    routed layer, and the top-k of them one token runs through."""

    total: int
    active: int


def expert_counts(cfg: ModelConfig) -> ExpertCounts:
    if cfg.moe is None:
        return ExpertCounts(0, 0)
    per_expert = 3 * cfg.hidden_size * cfg.moe.expert_intermediate_size  # gate, up, down
    layers = len(cfg.moe.sparse_layers)
    return ExpertCounts(per_expert * cfg.moe.num_experts * layers, per_expert * cfg.moe.top_k * layers)


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every decoder linear weight: what weight quantization applies to."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    attn, mlp = [(q, h), (kv, h), (kv, h), (h, q)], [(inter, h), (inter, h), (h, inter)]
    # A MoE layer's MLP is its experts' (each quantized like a dense MLP); its router is not listed.
    sparse: set[int] = set()
    experts: list[tuple[int, int]] = []
    if cfg.moe is not None:
        sparse, e_inter = set(cfg.moe.sparse_layers), cfg.moe.expert_intermediate_size
        experts = [(e_inter, h), (e_inter, h), (h, e_inter)] * cfg.moe.num_experts
    return [s for i in range(cfg.num_layers) for s in attn + (experts if i in sparse else mlp)]


def weight_bytes(cfg: ModelConfig, params: int, scheme: str, compute_bytes: int, lm_head: str = "none") -> int:
    """Bytes of `params` parameters served under `scheme`: decoder linears quantized, the
    LM head as `lm_head` says (none | int8), everything else (embeddings, norms, biases) in
    the compute dtype."""
    shapes = linear_shapes(cfg)
    group = INT4_GROUP
    if cfg.prequant is not None:
        group = cfg.prequant.group_size
    linear = sum(linear_weight_bytes(n, k, scheme, compute_bytes, group) for n, k in shapes)
    rest = params - sum(n * k for n, k in shapes)
    head = 0
    if lm_head == "int8":  # a tied head's int8 copy is extra; an untied head's float weight goes
        head = linear_weight_bytes(cfg.vocab_size, cfg.hidden_size, "int8", compute_bytes)
        rest -= 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return linear + head + rest * compute_bytes


def read_model_config(model_dir: Path) -> ModelConfig:
    """The engine's own reading of `config.json`: a model the engine cannot serve is a PlanError."""
    try:
        return ModelConfig.from_hf_dir(model_dir)
    except ModelConfigError as e:
        raise PlanError(str(e)) from e


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def safetensors_param_count(model_dir: Path) -> int | None:
    """Exact parameter count from the safetensors headers, or None without weights."""
    files = _safetensors_files(model_dir)
    if not files:
        return None
    total = 0
    for f in files:
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, struct.error, ValueError) as e:
            raise PlanError(f"unreadable safetensors header in {f}: {e}") from e
        total += sum(prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


@dataclass(frozen=True)
class CapacityPlan:
    model_dir: str
    architecture: str
    dtype: str  # resolved: never "auto"
    device: str
    bytes_per_element: int
    quantization: str  # weight scheme: none | int8 | int4 | awq | gptq
    kv_cache_dtype: str  # resolved: the serving dtype, fp8 or int8
    kv_bytes_per_element: int
    param_count: int
    param_source: str  # "safetensors headers" | "config shapes"
    expert_param_count: int  # routed experts' weights, all of them (0: dense model)
    active_param_count: int  # parameters one token runs through (all of them when dense)
    weight_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    max_model_len: int
    block_size: int
    kv_bytes_per_request: int
    device_memory: int
    overhead_fraction: float
    overhead_bytes: int
    kv_budget_bytes: int
    token_budget: int
    max_concurrency: int
    concurrency: int | None
    concurrency_kv_bytes: int | None
    fits: bool | None
    gpu_hourly_cost: float | None = None
    throughput: float | None = None  # output tokens/s the cost is stated at
    cost_per_million_tokens: float | None = None
    lm_head_quantization: str = "none"  # none | int8 (`served_lm_head`)
    # --enable-lora: max_loras resident adapters of max_lora_rank on all 7 projections,
    # counted twice (the registry's stacked copy of the step's set, pdserve/engine/lora/batch.py;
    # at bf16 each block of it padded to at most 32 rank columns).
    lora_bytes: int = 0
    tiers: tuple[TierCapacity, ...] = ()  # the KV tiers asked about, host, disk, remote order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_plan(
    model_dir: str | Path,
    device_memory: int,
    max_model_len: int,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    cpu_flags: frozenset[str] | None = None,
    concurrency: int | None = None,
    overhead_fraction: float = DEFAULT_OVERHEAD_FRACTION,
    block_size: int = 16,
    quantization: str = "none",
    lm_head_quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    gpu_hourly_cost: float | None = None,
    throughput: float | None = None,
    max_loras: int = 0,
    max_lora_rank: int = 16,
    tier_bytes: dict[str, int] | None = None,
) -> CapacityPlan:
    """The capacity figures for one model on one device (see the module docstring).

    `dtype` resolves against the checkpoint, `device` and `cpu_flags` (None: this
    host's) exactly as a worker started with the same flags resolves it; `quantization`
    as a worker's `--quantization` (an AWQ/GPTQ checkpoint plans as stored), and
    `lm_head_quantization` as its `--lm-head-quantization`. `tier_bytes`: the bound of
    each KV tier to account (host, disk, remote -> bytes)."""
    d = Path(model_dir)
    cfg = read_model_config(d)
    try:
        flags = host_cpu_flags() if cpu_flags is None else cpu_flags
        dt = resolve_dtype(dtype, cfg.torch_dtype, device, flags)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if max_model_len < 1 or block_size < 1 or device_memory < 1:
        raise PlanError("device memory, max-model-len and block size must be positive")
    try:
        scheme = served_quantization(quantization, cfg.prequant)
        head = served_lm_head(lm_head_quantization, scheme)
    except QuantizationError as e:
        raise PlanError(str(e)) from e
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise PlanError(f"unknown KV-cache dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    if (gpu_hourly_cost is None) != (throughput is None):
        raise PlanError("a cost line needs both the GPU hourly cost and the throughput it is stated at")
    # A quantized checkpoint's headers hold packed tensors, not parameters.
    exact = safetensors_param_count(d) if cfg.prequant is None else None
    params = exact if exact is not None else param_count(cfg)
    experts = expert_counts(cfg)
    kv_dt = dt if kv_cache_dtype == "auto" else kv_cache_dtype
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * _KV_BYTES[kv_dt]
    w_bytes = weight_bytes(cfg, params, scheme, DTYPE_BYTES[dt], head)
    request_tokens = -(-max_model_len // block_size) * block_size  # whole blocks
    per_request = request_tokens * kv_per_token
    overhead = int(device_memory * overhead_fraction)
    dims = ProjectionDims(cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.num_layers)
    stack_align = 32 if dt == "bfloat16" else 1  # a bf16 stack pads each block, at most to 32 (lora/batch.py)
    lora = max_loras * (adapter_bytes(dims, max_lora_rank, DTYPE_BYTES[dt])
                        + adapter_bytes(dims, max_lora_rank, DTYPE_BYTES[dt], stack_align))
    budget = max(0, device_memory - overhead - w_bytes - lora)
    conc_bytes = None if concurrency is None else concurrency * per_request
    unknown = sorted(set(tier_bytes or {}) - set(TIER_NAMES))
    if unknown or any(v <= 0 for v in (tier_bytes or {}).values()):
        raise PlanError(f"KV tiers are {', '.join(TIER_NAMES)}, each with a positive size; got {tier_bytes}")
    block_record = record_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, _KV_BYTES[kv_dt], block_size,
                                quantized=kv_dt in ("fp8", "fp8_e4m3", "int8"))
    pool_tokens = budget // kv_per_token
    tiers = tuple(tier_capacity(name, (tier_bytes or {})[name], block_record, block_size, pool_tokens)
                  for name in TIER_NAMES if name in (tier_bytes or {}))
    cost = None
    if gpu_hourly_cost is not None and throughput is not None:
        if gpu_hourly_cost < 0 or throughput <= 0:
            raise PlanError("the GPU hourly cost must be >= 0 and the throughput > 0")
        cost = gpu_hourly_cost / (3600 * throughput) * 1e6
    return CapacityPlan(
        model_dir=str(d),
        architecture=cfg.architecture,
        dtype=dt,
        device=device,
        bytes_per_element=DTYPE_BYTES[dt],
        quantization=scheme,
        lm_head_quantization=head,
        kv_cache_dtype=kv_dt,
        kv_bytes_per_element=_KV_BYTES[kv_dt],
        param_count=params,
        param_source="safetensors headers" if exact is not None else "config shapes",
        expert_param_count=experts.total,
        active_param_count=params - experts.total + experts.active,
        weight_bytes=w_bytes,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        kv_bytes_per_token=kv_per_token,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_bytes_per_request=per_request,
        device_memory=device_memory,
        overhead_fraction=overhead_fraction,
        overhead_bytes=overhead,
        kv_budget_bytes=budget,
        token_budget=pool_tokens,
        max_concurrency=budget // per_request,
        concurrency=concurrency,
        concurrency_kv_bytes=conc_bytes,
        fits=None if conc_bytes is None else conc_bytes <= budget,
        gpu_hourly_cost=gpu_hourly_cost,
        throughput=throughput,
        cost_per_million_tokens=cost,
        lora_bytes=lora,
        tiers=tiers,
    )


def _b(n: int) -> str:
    return f"{n:,} bytes ({format_bytes(n)})"


def format_plan(p: CapacityPlan) -> str:
    """The human-readable report `pdserve plan` prints."""
    rows = [
        ("model", f"{p.model_dir} ({p.architecture})"),
        ("dtype", f"{p.dtype} ({p.bytes_per_element} bytes per element) on {p.device}"),
        ("parameters", f"{p.param_count:,} (from {p.param_source})"),
        ("quantization", f"{p.quantization} (decoder linears; embeddings in {p.dtype}, LM head in "
         f"{p.dtype if p.lm_head_quantization == 'none' else p.lm_head_quantization})"
         if p.quantization != "none" or p.lm_head_quantization != "none" else "none"),
        *([("expert parameters", f"{p.expert_param_count:,} (all experts); {p.active_param_count:,}"
            " parameters active per token")] if p.expert_param_count else []),
        ("weight bytes", _b(p.weight_bytes)),
        (
            "KV bytes per token",
            f"{_b(p.kv_bytes_per_token)} = 2 x {p.num_layers} layers x {p.num_kv_heads} KV heads"
            f" x {p.head_dim} head_dim x {p.kv_bytes_per_element} bytes ({p.kv_cache_dtype})",
        ),
        ("KV per request", f"{_b(p.kv_bytes_per_request)} at max-model-len {p.max_model_len:,}"),
        ("device memory", _b(p.device_memory)),
        (
            f"overhead ({p.overhead_fraction:.0%})",
            f"{_b(p.overhead_bytes)}: activations, graphs, fragmentation, runtime",
        ),
        *([("LoRA adapters", _b(p.lora_bytes))] if p.lora_bytes else []),
        ("KV budget", f"{_b(p.kv_budget_bytes)} = device - weights - overhead"
         + (" - LoRA adapters" if p.lora_bytes else "")),
        ("token budget", f"{p.token_budget:,} tokens"),
        ("max concurrency", f"{p.max_concurrency:,} requests at {p.max_model_len:,} tokens"),
        *(format_tier(t, _b(t.bytes)) for t in p.tiers),
    ]
    if p.concurrency is not None and p.concurrency_kv_bytes is not None:
        verdict = "fits" if p.fits else "does NOT fit"
        rows.append(
            (
                f"concurrency {p.concurrency}",
                f"{verdict}: needs {_b(p.concurrency_kv_bytes)} of KV"
                f" against a {format_bytes(p.kv_budget_bytes)} budget",
            )
        )
    if p.cost_per_million_tokens is not None and p.gpu_hourly_cost is not None and p.throughput is not None:
        rows.append(("cost", f"${p.cost_per_million_tokens:.2f} per 1M output tokens at "
                     f"{p.throughput:,.0f} tok/s and ${p.gpu_hourly_cost:.2f}/h"))
    return "\n".join(f"{label + ':':<22}{value}" for label, value in rows)
