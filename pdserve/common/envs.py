"""The one place pdserve reads environment variables.

Every variable pdserve understands is declared in `ENV_VARS` with its default and
meaning; code elsewhere calls the typed accessors below (or `get(name)`), never
`os.environ`. Values are read at call time, not import time, so tests can set
a variable with `monkeypatch.setenv` and child processes inherit it naturally.

To add a variable: add an `EnvVar` to `ENV_VARS` and, if it needs parsing, an
accessor function next to the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "PDSERVE_HOME",
            "~/.cache/pdserve",
            "Root of pdserve's own files; the default model lives in <home>/models.",
        ),
        EnvVar(
            "PDSERVE_BUILTIN_WEIGHTS",
            "trained",
            "Which weights the built-in pdserve-tiny-llama serves: trained (the model trained on "
            "the story corpus) or random (the random-weight checkpoint the plumbing tests use).",
        ),
        EnvVar(
            "PDSERVE_LOG_LEVEL",
            "INFO",
            "Log level name for every pdserve process (DEBUG, INFO, WARNING, ERROR).",
        ),
        EnvVar(
            "PDSERVE_FAULTS",
            "",
            "Worker fault-injection spec for reliability tests; read only with --enable-fault-injection.",
        ),
        EnvVar(
            "PDSERVE_API_KEYS",
            "",
            "Gateway API keys, comma-separated; added to --api-key and --api-key-file.",
        ),
        EnvVar(
            "PDSERVE_ADMIN_TOKEN",
            "",
            "Gateway admin bearer token (live role flips); used when --admin-token is not given.",
        ),
        EnvVar(
            "PDSERVE_GATEWAY_SEED_KEY",
            "",
            "Test hook: hex key (1-64 bytes) of the seeds the gateway gives unseeded requests, "
            "so a test can reproduce a sampled run; empty: a random key per gateway process.",
        ),
        EnvVar(
            "PDSERVE_KV_FAULTS",
            "",
            "KV-transfer fault spec (`key=value,...`, see kv_transfer.faults); read only with --enable-fault-injection.",
        ),
        EnvVar(
            "PDSERVE_NATIVE_KERNELS",
            "1",
            "0: bf16 runs the torch paths (gather + SDPA decode attention, unfused RMSNorm) even "
            "where the native CPU kernels (pdserve/engine/kernels/_cpu_kernels.c) are built.",
        ),
        EnvVar(
            "PDSERVE_BF16_GEMV",
            "1",
            "0: bf16 CPU linears with few rows (decode) run F.linear instead of the native bf16 GEMV "
            "(pdserve/engine/kernels/_bf16_gemv.c); for A/B timing.",
        ),
        EnvVar(
            "PDSERVE_CPU_FEATURES",
            "",
            "Run as on a CPU with fewer features (pdserve/engine/kernels/cpu_features.py, docs/determinism.md): a level "
            "(portable, avx2, avx512, avx512_bf16, amx) and/or features to drop (-amx, -avx512_bf16, ...), "
            "comma-separated; e.g. -amx runs the AMD EPYC paths on an AMX machine. Empty: this CPU as it is.",
        ),
        EnvVar(
            "PDSERVE_DISABLED_KERNELS",
            "",
            "Kernels of pdserve/engine/kernels/table.py no layer may pick, comma-separated names "
            "(e.g. bf16_amx,int4_gemm_amx); the next kernel in the table takes their rows.",
        ),
        EnvVar(
            "ONEDNN_MAX_CPU_ISA",
            "",
            "oneDNN's own ISA cap (read by torch's oneDNN, not by pdserve's kernels); bench/invariance.py "
            "reports it, as AVX512_CORE_BF16 makes aten's bf16 matmul run as on a CPU without AMX.",
        ),
        EnvVar("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "",
               "OTLP traces endpoint when --otlp-traces-endpoint is not given; empty: tracing off."),
        EnvVar("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc",
               "OTLP traces protocol: grpc (vLLM's default) or http/protobuf."),
        EnvVar("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "",
               "Headers on every OTLP export, `key=value,...` (values URL-encoded), e.g. an API key."),
        EnvVar("OTEL_SERVICE_NAME", "pdserve",
               "service.name prefix of pdserve's spans; each process adds its role (pdserve-gateway, ...)."),
        EnvVar("OTEL_TRACES_SAMPLER", "parentbased_always_on",
               "always_on | always_off | traceidratio | parentbased_always_on | parentbased_always_off | "
               "parentbased_traceidratio (the gateway decides; workers follow the traceparent)."),
        EnvVar("OTEL_TRACES_SAMPLER_ARG", "", "The ratio (0..1) of the traceidratio samplers (default 1)."),
        EnvVar("HF_TOKEN", "", "Hugging Face token for `--model org/name` downloads of gated or private repos."),
        EnvVar("HF_HUB_OFFLINE", "", "1: resolve `--model org/name` from the local Hugging Face cache only."),
        EnvVar("HF_HUB_CACHE", "", "The Hugging Face hub cache (default: <HF_HOME>/hub)."),
        EnvVar("HF_HOME", "~/.cache/huggingface", "Root of Hugging Face's files; the hub cache is <HF_HOME>/hub."),
    )
}


def get(name: str) -> str | None:
    """The value of a declared variable, or its default when unset or empty.

    Raises KeyError for an undeclared name, so a typo cannot silently read nothing.
    """
    var = ENV_VARS[name]
    value = os.environ.get(name)
    return value if value else var.default


def home() -> Path:
    """`PDSERVE_HOME`, expanded and absolute (default `~/.cache/pdserve`)."""
    value = get("PDSERVE_HOME")
    assert value is not None  # declared with a default
    return Path(value).expanduser().resolve()


BUILTIN_WEIGHTS = ("trained", "random")


def builtin_weights() -> str:
    """`PDSERVE_BUILTIN_WEIGHTS`: "trained" (default) or "random"; ValueError otherwise."""
    value = get("PDSERVE_BUILTIN_WEIGHTS")
    if value not in BUILTIN_WEIGHTS:
        raise ValueError(f"PDSERVE_BUILTIN_WEIGHTS must be one of {', '.join(BUILTIN_WEIGHTS)}, got {value!r}")
    return value


def log_level() -> str:
    """`PDSERVE_LOG_LEVEL`, upper-cased (default INFO)."""
    return (get("PDSERVE_LOG_LEVEL") or "INFO").upper()


def faults() -> str:
    """`PDSERVE_FAULTS`: the raw fault-injection spec; empty string when off."""
    return get("PDSERVE_FAULTS") or ""


def kv_faults() -> str:
    """`PDSERVE_KV_FAULTS`: the raw KV-transfer fault spec; empty string when off."""
    return get("PDSERVE_KV_FAULTS") or ""


def gateway_seed_key() -> bytes | None:
    """`PDSERVE_GATEWAY_SEED_KEY` as bytes; None when unset. ValueError when not hex."""
    value = get("PDSERVE_GATEWAY_SEED_KEY")
    if not value:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError("PDSERVE_GATEWAY_SEED_KEY must be hex") from None


def api_keys() -> tuple[str, ...]:
    """`PDSERVE_API_KEYS`: the gateway API keys it lists (comma-separated, blanks dropped)."""
    return tuple(k.strip() for k in (get("PDSERVE_API_KEYS") or "").split(",") if k.strip())


def admin_token() -> str | None:
    """`PDSERVE_ADMIN_TOKEN`: the gateway's admin bearer token, None when unset."""
    return (get("PDSERVE_ADMIN_TOKEN") or "").strip() or None


def native_kernels() -> bool:
    """`PDSERVE_NATIVE_KERNELS`: False when set to 0 (default on)."""
    return get("PDSERVE_NATIVE_KERNELS") != "0"


def bf16_gemv() -> bool:
    """`PDSERVE_BF16_GEMV`: False when set to 0 (default on)."""
    return get("PDSERVE_BF16_GEMV") != "0"


def cpu_features() -> str:
    """`PDSERVE_CPU_FEATURES`: the raw feature-mask spec (pdserve/engine/kernels/cpu_features.py parses it); empty: none."""
    return (get("PDSERVE_CPU_FEATURES") or "").strip()


def disabled_kernels() -> frozenset[str]:
    """`PDSERVE_DISABLED_KERNELS`: the kernel names it lists (comma-separated, blanks dropped)."""
    return frozenset(k.strip() for k in (get("PDSERVE_DISABLED_KERNELS") or "").split(",") if k.strip())


def onednn_max_cpu_isa() -> str:
    """`ONEDNN_MAX_CPU_ISA` as set (empty: oneDNN uses every ISA the CPU has)."""
    return get("ONEDNN_MAX_CPU_ISA") or ""


def hf_token() -> str | None:
    """`HF_TOKEN`, or None when unset (huggingface_hub then uses a saved login, if any)."""
    return get("HF_TOKEN") or None


def hf_offline() -> bool:
    """`HF_HUB_OFFLINE` is set to a true value (1, true, yes, on)."""
    return (get("HF_HUB_OFFLINE") or "").strip().lower() in ("1", "true", "yes", "on")


def hf_cache_dir() -> Path:
    """`HF_HUB_CACHE`, else `<HF_HOME>/hub`: where `--model org/name` snapshots live."""
    cache = get("HF_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    return Path(get("HF_HOME") or "~/.cache/huggingface").expanduser() / "hub"


def otlp_traces_endpoint() -> str | None:
    """`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, None when unset (tracing off)."""
    return (get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or "").strip() or None


def otlp_traces_protocol() -> str:
    """`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, lower-cased (default grpc)."""
    return (get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or "grpc").strip().lower()


def otlp_traces_headers() -> tuple[tuple[str, str], ...]:
    """`OTEL_EXPORTER_OTLP_TRACES_HEADERS` as (key, value) pairs (values URL-decoded);
    ValueError on an entry without `=`."""
    from urllib.parse import unquote

    pairs = []
    for item in (get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_HEADERS: {item.strip()[:40]!r} is not key=value")
        pairs.append((key.strip().lower(), unquote(value.strip())))
    return tuple(pairs)


def otel_service_name() -> str:
    """`OTEL_SERVICE_NAME` (default pdserve): the prefix of each process's service.name."""
    return (get("OTEL_SERVICE_NAME") or "pdserve").strip()


def otel_traces_sampler() -> tuple[str, str | None]:
    """`OTEL_TRACES_SAMPLER` (lower-cased) and `OTEL_TRACES_SAMPLER_ARG` (None when unset)."""
    name = (get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    return name, (get("OTEL_TRACES_SAMPLER_ARG") or "").strip() or None
