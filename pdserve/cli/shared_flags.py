"""The flags both `pdserve gateway` and `pdserve worker` take, written once: each is a
factory of the dataclass field (a field belongs to one class), used by `GatewayArgs` and
`WorkerArgs` alike, so the two processes can never disagree on a flag's help or default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.cli.args import DOWNLOAD_DIR_HELP, REVISION_HELP, positive_int
from pdserve.cli.argspec import flag


def revision() -> Any:
    return flag(None, REVISION_HELP, up=False)


def download_dir() -> Any:
    return flag(None, DOWNLOAD_DIR_HELP, type=Path, up=False)


def enable_lora() -> Any:
    return flag(False, "serve LoRA adapters on the base model", action="store_true")


def max_loras() -> Any:
    return flag(1, "LoRA adapters resident per worker, so at most this many in one step", type=positive_int)


def max_lora_rank() -> Any:
    return flag(16, "largest LoRA rank served", type=positive_int)


def otlp_traces_endpoint() -> Any:
    return flag(
        None, "OpenTelemetry: export this process's spans to this OTLP collector (vLLM's flag; default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing); protocol, headers, service name and sampler from "
        "the standard OTEL_* variables. Needs pdserve[otel]", metavar="URL",
        up_help="gateway and workers: export OpenTelemetry spans to this OTLP collector (the OTEL_* variables "
        "pass to every process)")
