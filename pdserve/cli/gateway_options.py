"""`pdserve gateway` flags for authentication, admission and request size limits,
and their mapping onto `gateway.config` (imported lazily: parsing stays light).

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

from pdserve.common import envs
from pdserve.common.generation_config import GenerationConfigError, SamplingDefaults, read_generation_config
from pdserve.cli.args import (
    UsageError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

log = logging.getLogger("pdserve.gateway")

# RequestLimits field -> flag (`max_tokens` is a cap, not the default: hence its name).
LIMIT_FLAGS = {
    "max_body_bytes": "--max-body-bytes",
    "max_header_bytes": "--max-header-bytes",
    "max_messages": "--max-messages",
    "max_prompt_tokens": "--max-prompt-tokens",
    "max_n": "--max-n",
    "max_tokens": "--max-tokens-limit",
    "max_stop": "--max-stop",
    "max_stop_len": "--max-stop-len",
    "max_logprobs": "--max-logprobs",
    "max_stop_token_ids": "--max-stop-token-ids",
    "max_user_len": "--max-user-len",
    "max_prompt_chars": "--max-prompt-chars",
}
# ConnectionLimits field -> flag.
CONNECTION_FLAGS = {
    "max_connections": ("--max-connections", "open client connections; past it: 503 and close"),
    "header_timeout_s": ("--header-timeout", "seconds for a complete request head, from connecting or "
                         "from the previous response (also the keep-alive idle limit)"),
    "body_timeout_s": ("--body-timeout", "seconds for the whole request body; past it: 408"),
    "idle_write_timeout_s": ("--idle-write-timeout", "seconds a response may stay undrained (the client "
                             "stopped reading) before the connection is cut and the request aborted"),
}
# `pdserve up` forwards these gateway flags when given (flag -> type).
UP_FORWARDED = {
    "--max-in-flight": positive_int,
    "--request-timeout": positive_float,
    "--max-queue-depth": non_negative_int,
    "--max-queue-wait": non_negative_float,
    "--max-connections": positive_int,
    "--header-timeout": positive_float,
    "--body-timeout": positive_float,
    "--idle-write-timeout": positive_float,
}
PRIORITIES = ("interactive", "batch")


def add_gateway_options(ap: argparse.ArgumentParser) -> None:
    auth = ap.add_argument_group("authentication")
    auth.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                      help="file of API keys, one per line, '#' comments; with --api-key and "
                      "PDSERVE_API_KEYS")
    auth.add_argument(
        "--metrics-protected", action="store_true", help="require the API key on /metrics too"
    )
    conn = ap.add_argument_group("client connections (slow and stalled clients)")
    for name, (flag, text) in CONNECTION_FLAGS.items():
        kind = positive_int if name == "max_connections" else positive_float
        conn.add_argument(flag, type=kind, default=None, dest=f"conn_{name}", help=text)
    conn.add_argument("--tokenizer-threads", type=positive_int, default=None,
                      help="threads rendering chat templates and tokenizing, off the event loop (default 2)")
    conn.add_argument("--allow-special-tokens-in-content", action="store_true",
                      help="tokenize special-token strings inside message content as control tokens "
                      "(default: as text, so a user cannot forge a system or assistant turn)")
    adm = ap.add_argument_group("admission (503 + Retry-After beyond these)")
    adm.add_argument(
        "--max-queue-depth", type=non_negative_int, default=None, help="waiting requests per priority class"
    )
    adm.add_argument(
        "--max-queue-wait", type=non_negative_float, default=None, help="longest wait for a slot (s), per class"
    )
    for prio in PRIORITIES:
        adm.add_argument(
            f"--max-queue-depth-{prio}", type=non_negative_int, default=None, help=f"{prio} class only"
        )
        adm.add_argument(
            f"--max-queue-wait-{prio}", type=non_negative_float, default=None, help=f"{prio} class only"
        )
    adm.add_argument("--batch-aging", type=non_negative_float, default=None,
                     help="seconds after which a waiting batch request counts as interactive (0: never)")
    adm.add_argument("--retry-after", type=non_negative_int, default=None, help="Retry-After seconds on 503s")
    tools = ap.add_argument_group("tool calling (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": find tool calls in the output (needs --tool-call-parser)')
    tools.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                       help="the model's tool-call format: hermes (<tool_call>, Qwen) or llama3_json")
    roles = ap.add_argument_group("live role flips and the P:D planner")
    roles.add_argument("--admin-token", default=None, metavar="TOKEN",
                       help="bearer token of POST /admin/workers/{id}/role (live role flip); default "
                       "PDSERVE_ADMIN_TOKEN; without one the admin API is off")
    roles.add_argument("--planner", choices=("off", "flip", "replicas"), default="off",
                       help="P:D planner: flip moves workers between prefill and decode, replicas only "
                       "publishes llm_planner_desired_workers{role} for the HPA/KEDA objects")
    roles.add_argument("--slo", default="ttft=2,itl=0.1", metavar="ttft=S,itl=S",
                       help="the planner's targets: p90 time to first token and time per output token")
    roles.add_argument("--planner-dwell", type=non_negative_float, default=20.0, metavar="SECONDS",
                       help="a flip must be wanted this long without a break")
    roles.add_argument("--planner-margin", type=non_negative_float, default=0.2,
                       help="a flip must improve the worse SLO pressure by more than this fraction")
    roles.add_argument("--planner-interval", type=positive_float, default=2.0, metavar="SECONDS")
    lim = ap.add_argument_group("request size limits (400/413 beyond these)")
    for name, flag in LIMIT_FLAGS.items():
        lim.add_argument(flag, type=int, default=None, dest=f"limit_{name}", metavar="N")
    lim.add_argument(
        "--default-max-tokens", type=positive_int, default=None, help="completions without max_tokens"
    )


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


def _set(args: argparse.Namespace, pairs: dict[str, str]) -> dict[str, Any]:
    return {
        field: getattr(args, attr)
        for field, attr in pairs.items()
        if getattr(args, attr) is not None
    }


def request_limits(args: argparse.Namespace) -> Any:
    from gateway.config import RequestLimits

    return RequestLimits(**_set(args, {f: f"limit_{f}" for f in LIMIT_FLAGS}))


def connection_limits(args: argparse.Namespace) -> Any:
    from gateway.config import ConnectionLimits

    return ConnectionLimits(**_set(args, {f: f"conn_{f}" for f in CONNECTION_FLAGS}))


def add_up_gateway_options(ap: argparse.ArgumentParser) -> None:
    """`pdserve up`'s copies of the gateway's admission and timeout flags."""
    group = ap.add_argument_group("gateway admission and timeouts (see `pdserve gateway --help`)")
    for flag, kind in UP_FORWARDED.items():
        group.add_argument(flag, type=kind, default=None, dest=f"gw_{flag[2:].replace('-', '_')}")


def up_gateway_flags(args: argparse.Namespace) -> list[str]:
    """The `add_up_gateway_options` flags given to `up`, for the gateway's command line."""
    out: list[str] = []
    for flag in UP_FORWARDED:
        value = getattr(args, f"gw_{flag[2:].replace('-', '_')}")
        if value is not None:
            out += [flag, str(value)]
    return out


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
    if args.enable_auto_tool_choice:
        out["tool_call_parser"] = args.tool_call_parser
    assert set(out) <= {f.name for f in fields(GatewayConfig)}
    return out


def planner_settings(args: argparse.Namespace) -> Any:
    """--planner and its knobs -> `PlannerSettings` (None when off); bad --slo: UsageError."""
    from pdserve.common.slo import parse_slo
    from gateway.planner import PlannerConfig, PlannerSettings

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
