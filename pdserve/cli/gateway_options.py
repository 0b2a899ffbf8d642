"""The mapping of `pdserve gateway`'s flags (pdserve/cli/gateway_args.py) for authentication,
admission and request size limits onto `gateway.config` (imported lazily: parsing stays light).

A flag left unset keeps the config dataclass's default, so defaults live in one
place (`gateway/config.py`).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from pdserve.cli.args import UsageError
from pdserve.common import envs
from pdserve.common.generation_config import (
    GenerationConfigError,
    SamplingDefaults,
    read_generation_config,
)

log = logging.getLogger("pdserve.gateway")

PRIORITIES = ("interactive", "batch")


def read_key_file(path: str) -> list[str]:
    """Keys from `path`: one per line; blank lines and `#` comments skipped."""
    keys = []
    for line in Path(path).read_text().splitlines():
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key, every --api-key-file and PDSERVE_API_KEYS, deduplicated in order."""
    keys: list[str] = list(args.api_key)
    for path in args.api_key_file:
        try:
            file_keys = read_key_file(path)
        except OSError as e:
            raise UsageError("--api-key-file", f"{path}: {e.strerror or e}") from None
        if not file_keys:
            raise UsageError("--api-key-file", f"{path}: no keys in it")
        keys += file_keys
    keys += envs.api_keys()
    return tuple(dict.fromkeys(keys))


def request_limits(args: argparse.Namespace) -> Any:
    """The limits set by flags named as `RequestLimits`'s fields (--max-tokens-limit: `max_tokens`,
    a cap, not the default); the others keep the dataclass's defaults."""
    from gateway.config import RequestLimits

    flags = {f.name: f.name for f in fields(RequestLimits)} | {"max_tokens": "max_tokens_limit"}
    return RequestLimits(**{k: getattr(args, a) for k, a in flags.items() if getattr(args, a) is not None})


def connection_limits(args: argparse.Namespace) -> Any:
    """--max-connections and the client read/write timeouts -> `ConnectionLimits` (unset: its defaults)."""
    from gateway.config import ConnectionLimits

    flags = {"max_connections": "max_connections", "header_timeout_s": "header_timeout",
             "body_timeout_s": "body_timeout", "idle_write_timeout_s": "idle_write_timeout"}
    return ConnectionLimits(**{k: getattr(args, a) for k, a in flags.items() if getattr(args, a) is not None})


def admission_config(args: argparse.Namespace) -> Any:
    from gateway.config import AdmissionConfig, QueueLimits

    base = AdmissionConfig()
    queues: dict[str, Any] = {}
    for prio in PRIORITIES:
        default: QueueLimits = getattr(base, prio)
        depth = getattr(args, f"max_queue_depth_{prio}")
        wait = getattr(args, f"max_queue_wait_{prio}")
        queues[prio] = QueueLimits(
            max_depth=next(
                v for v in (depth, args.max_queue_depth, default.max_depth) if v is not None
            ),
            max_wait_s=next(
                v for v in (wait, args.max_queue_wait, default.max_wait_s) if v is not None
            ),
        )
    extra: dict[str, Any] = {}
    if args.batch_aging is not None:
        extra["batch_aging_s"] = args.batch_aging or None
    if args.retry_after is not None:
        extra["retry_after_s"] = args.retry_after
    return AdmissionConfig(max_in_flight=args.max_in_flight, **queues, **extra)


def gateway_settings(args: argparse.Namespace) -> dict[str, Any]:
    """`GatewayConfig` keyword arguments from these flags."""
    from gateway.config import GatewayConfig

    out: dict[str, Any] = {
        "admission": admission_config(args),
        "limits": request_limits(args),
        "connections": connection_limits(args),
        "special_tokens_in_content": args.allow_special_tokens_in_content,
        "api_keys": api_keys(args),
        "metrics_protected": args.metrics_protected,
    }
    out["admin_token"] = args.admin_token or envs.admin_token()
    if out["admin_token"] is not None and len(out["admin_token"]) < 16:
        raise UsageError("--admin-token", "must be at least 16 characters (or PDSERVE_ADMIN_TOKEN)")
    out["planner"] = planner_settings(args)
    if args.tokenizer_threads is not None:
        out["tokenizer_threads"] = args.tokenizer_threads
    if args.default_max_tokens is not None:
        out["default_max_tokens"] = args.default_max_tokens
    if args.tokenizer_threads is not None:
        out["tokenizer_threads"] = args.tokenizer_threads
    if args.responses_store_size is not None:
        out["responses_store_size"] = args.responses_store_size
    if args.enable_auto_tool_choice:
        out["tool_call_parser"] = args.tool_call_parser
    assert set(out) <= {f.name for f in fields(GatewayConfig)}
    return out


def planner_settings(args: argparse.Namespace) -> Any:
    """--planner and its knobs -> `PlannerSettings` (None when off); bad --slo: UsageError."""
    from gateway.planner import PlannerConfig, PlannerSettings
    from pdserve.common.slo import parse_slo

    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        raise UsageError("--slo", str(e)) from None
    if args.planner == "off":
        return None
    config = PlannerConfig(slo, dwell_s=args.planner_dwell, cooldown_s=max(args.planner_dwell, 10.0),
                           margin=args.planner_margin)
    return PlannerSettings(config, mode=args.planner, interval_s=args.planner_interval)


def check_tool_flags(args: argparse.Namespace) -> None:
    """`--enable-auto-tool-choice` needs the format to parse (vLLM's rule)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UsageError("--enable-auto-tool-choice", "needs --tool-call-parser hermes|llama3_json")


def check_served_names(names: list[str] | None) -> None:
    """`--served-model-name`: distinct, non-empty names."""
    names = names or []
    if any(not n.strip() for n in names) or len(set(names)) != len(names):
        raise UsageError("--served-model-name", f"expected distinct non-empty names, got {names!r}")


def sampling_defaults(mode: str, model_dir: Path) -> SamplingDefaults:
    """`--generation-config`: `auto` reads the model's generation_config.json, `vllm` sets no
    defaults, anything else is a directory holding one. A bad value or file: UsageError."""
    if mode == "vllm":
        return SamplingDefaults()
    source = model_dir if mode == "auto" else Path(mode)
    if not source.is_dir():
        raise UsageError("--generation-config", f"expected auto, vllm or a directory, got {mode!r}")
    try:
        defaults = read_generation_config(source).defaults
    except GenerationConfigError as e:
        raise UsageError("--generation-config", str(e)) from None
    if defaults.as_dict():
        log.info(json.dumps({"event": "sampling_defaults", "source": str(source), **defaults.as_dict(),
                             "note": "from generation_config.json; --generation-config vllm ignores them"}))
    return defaults
