"""Every `pdserve gateway` flag, once: the gateway parses them, `pdserve up` offers those
marked `up` and passes its gateway child a `GatewayArgs` as its command line. A flag left
unset (None) keeps `gateway/config.py`'s default, so those defaults live in one place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.cli import shared_flags
from pdserve.cli.args import (
    MODEL_HELP,
    non_negative_float,
    non_negative_int,
    port_or_zero,
    positive_float,
    positive_int,
)
from pdserve.cli.args import host as host_name  # the field `host` shadows the name in the class
from pdserve.cli.argspec import ArgGroup, flag
from pdserve.cli.lora_args import lora_module

# gateway/kv_router.py: ROUTERS (kept out of this module's imports: parsing loads no zmq)
ROUTERS = ("kv-aware", "least-loaded", "round-robin")
AUTH, ADMISSION = "authentication", "admission (503 + Retry-After beyond these)"
TOOLS, ROLES = "tool calling (vLLM's flags)", "live role flips and the P:D planner"
LIMITS = "request size limits (400/413 beyond these)"
CONNECTIONS = "client connections (slow and stalled clients)"


def _limit() -> Any:
    return flag(None, type=int, metavar="N", up=False, group=LIMITS)


def _queue(kind: str, prio: str) -> Any:
    return flag(None, f"{prio} class only", type=non_negative_int if kind == "depth" else non_negative_float,
                up=False, group=ADMISSION)


@dataclass(frozen=True)
class GatewayArgs(ArgGroup):
    host: str = flag("127.0.0.1", type=host_name)
    port: int = flag(8000, "0: a free one (the `listening` log event names it)", type=port_or_zero, up=False)
    model: str | None = flag(None, MODEL_HELP + " (for the tokenizer)", up=False)  # `up` passes its directory
    revision: str | None = shared_flags.revision()
    download_dir: Path | None = shared_flags.download_dir()
    served_model_name: tuple[str, ...] | None = flag(
        None, "model name(s) requests may use; the first is reported in responses (default: the dir name)",
        nargs="+", metavar="NAME", up_help="gateway: model name(s) requests may use; the first is reported")
    generation_config: str = flag(
        "auto", "sampling defaults: auto (the model's generation_config.json), vllm (none), or a directory "
        "holding a generation_config.json", metavar="auto|vllm|DIR", up_help="gateway: sampling defaults from "
        "the model's generation_config.json (auto), none (vllm) or a directory's")
    max_model_len: int | None = flag(None, "default: the model's limit", type=positive_int)
    control_host: str = flag("127.0.0.1", "address workers connect to", type=host_name, up=False)
    control_port: int = flag(0, "0: a free port", type=port_or_zero, up=False)
    heartbeat_timeout: float = flag(3.0, "seconds of silence before a worker is removed", type=positive_float,
                                    up=False)
    stall_timeout: float = flag(
        30.0, "seconds a heartbeating worker may hold work without an engine step before it is marked stalled "
        "and its requests recovered (0: off)", type=non_negative_float,
        up_help="gateway: seconds a worker may hold work without an engine step (0: off)")
    max_recoveries: int = flag(3, type=non_negative_int)
    router: str = flag("kv-aware", "how a prompt's worker is picked: kv-aware (least uncached prompt tokens + "
                       "queued tokens, from the workers' prefix-cache events), least-loaded, round-robin",
                       choices=ROUTERS, up_help="gateway: how a prompt's worker is picked")
    local_prefill_threshold: int = flag(
        0, "a request whose uncached prompt part on the decode worker is at most this many tokens is "
        "prefilled there (no KV transfer), up to 4x that when every prefill worker has 4x its uncached tokens "
        "queued; 0: off", type=non_negative_int, metavar="TOKENS", up_help="gateway: prefill on the decode "
        "worker when at most this many prompt tokens are uncached")
    request_timeout: float | None = flag(None, "per-request deadline (s) from arrival, over the whole response",
                                          type=positive_float, up_help="gateway: per-request deadline (s)")
    drain_timeout: float = flag(30.0, type=positive_float, up=False)
    max_in_flight: int = flag(256, "requests inside the backend at once", type=positive_int,
                              up_help="gateway: requests inside the backend at once")
    api_key: tuple[str, ...] = flag((), "require this API key (repeatable); visible to every user of the host in "
                                    "the process list: prefer --api-key-file or PDSERVE_API_KEYS", action="append",
                                    up_help="gateway: require this API key (repeatable)")
    api_key_file: tuple[str, ...] = flag(
        (), "file of API keys, one per line, '#' comments; with --api-key and PDSERVE_API_KEYS", action="append",
        metavar="FILE", group=AUTH, up_help="gateway: file of API keys, one per line, '#' comments")
    metrics_protected: bool = flag(False, "require the API key on /metrics too", action="store_true", up=False,
                                   group=AUTH)
    max_queue_depth: int | None = flag(None, "waiting requests per priority class", type=non_negative_int,
                                       group=ADMISSION, up_help="gateway: waiting requests per priority class")
    max_queue_wait: float | None = flag(None, "longest wait for a slot (s), per class", type=non_negative_float,
                                        group=ADMISSION, up_help="gateway: longest wait for a slot (s)")
    max_connections: int | None = flag(None, "open client connections; past it: 503 and close (default 4096)",
                                       type=positive_int, group=CONNECTIONS)
    header_timeout: float | None = flag(
        None, "seconds for a complete request head, from connecting or from the previous response (also the "
        "keep-alive idle limit; default 10)", type=positive_float, group=CONNECTIONS)
    body_timeout: float | None = flag(None, "seconds for the whole request body; past it: 408 (default 30)",
                                      type=positive_float, group=CONNECTIONS)
    idle_write_timeout: float | None = flag(
        None, "seconds a response may stay undrained (the client stopped reading) before the connection is cut "
        "and the request aborted (default 30)", type=positive_float, group=CONNECTIONS)
    tokenizer_threads: int | None = flag(None, "threads rendering chat templates and tokenizing, off the event "
                                         "loop (default 2)", type=positive_int, up=False, group=CONNECTIONS)
    allow_special_tokens_in_content: bool = flag(
        False, "tokenize special-token strings inside message content as control tokens (default: as text, so "
        "a user cannot forge a system or assistant turn)", action="store_true", up=False, group=CONNECTIONS)
    max_queue_depth_interactive: int | None = _queue("depth", "interactive")
    max_queue_wait_interactive: float | None = _queue("wait", "interactive")
    max_queue_depth_batch: int | None = _queue("depth", "batch")
    max_queue_wait_batch: float | None = _queue("wait", "batch")
    batch_aging: float | None = flag(None, "seconds after which a waiting batch request counts as interactive "
                                     "(0: never)", type=non_negative_float, up=False, group=ADMISSION)
    retry_after: int | None = flag(None, "Retry-After seconds on 503s", type=non_negative_int, up=False,
                                   group=ADMISSION)
    enable_auto_tool_choice: bool = flag(
        False, 'tool_choice "auto": find tool calls in the output (needs --tool-call-parser)', action="store_true",
        group=TOOLS, up_help='gateway: tool_choice "auto" (needs --tool-call-parser)')
    tool_call_parser: str | None = flag(
        None, "the model's tool-call format: hermes (<tool_call>, Qwen) or llama3_json", group=TOOLS,
        choices=("hermes", "llama3_json"), up_help="gateway: the model's tool-call format")
    admin_token: str | None = flag(None, "bearer token of POST /admin/workers/{id}/role (live role flip); default "
                                   "PDSERVE_ADMIN_TOKEN; without one the admin API is off", metavar="TOKEN",
                                   up=False, group=ROLES)
    planner: str = flag("off", "P:D planner: flip moves workers between prefill and decode, replicas only "
                        "publishes llm_planner_desired_workers{role} for the HPA/KEDA objects",
                        choices=("off", "flip", "replicas"), up=False, group=ROLES)
    slo: str = flag("ttft=2,itl=0.1", "the planner's targets: p90 time to first token and time per output token",
                    metavar="ttft=S,itl=S", up=False, group=ROLES)
    planner_dwell: float = flag(20.0, "a flip must be wanted this long without a break", type=non_negative_float,
                                metavar="SECONDS", up=False, group=ROLES)
    planner_margin: float = flag(0.2, "a flip must improve the worse SLO pressure by more than this fraction",
                                 type=non_negative_float, up=False, group=ROLES)
    planner_interval: float = flag(2.0, type=positive_float, metavar="SECONDS", up=False, group=ROLES)
    max_body_bytes: int | None = _limit()
    max_header_bytes: int | None = _limit()
    max_messages: int | None = _limit()
    max_prompt_tokens: int | None = _limit()
    max_n: int | None = _limit()
    max_tokens_limit: int | None = _limit()  # RequestLimits.max_tokens: a cap, not the default
    max_stop: int | None = _limit()
    max_stop_len: int | None = _limit()
    max_logprobs: int | None = _limit()
    max_stop_token_ids: int | None = _limit()
    max_user_len: int | None = _limit()
    max_prompt_chars: int | None = _limit()
    default_max_tokens: int | None = flag(None, "completions without max_tokens", type=positive_int, up=False,
                                          group=LIMITS)
    responses_store_size: int | None = flag(
        None, "stored /v1/responses kept for previous_response_id, least recently used evicted first "
        "(default 1024; 0: store nothing)", type=non_negative_int, metavar="N", up=False, group=LIMITS)
    enable_lora: bool = shared_flags.enable_lora()
    max_loras: int = shared_flags.max_loras()
    max_lora_rank: int = shared_flags.max_lora_rank()
    lora_modules: tuple[tuple[str, str], ...] = flag(
        (), 'PEFT adapters served from the start; a request selects one with "model": NAME', nargs="+",
        type=lora_module, metavar="NAME=PATH", render=lambda m: f"{m[0]}={m[1]}")
    lora_dir: str | None = flag(None, "POST /v1/load_lora_adapter only loads adapters under this directory",
                                metavar="DIR")
    otlp_traces_endpoint: str | None = shared_flags.otlp_traces_endpoint()
    curve_secret_key: str | None = flag(None, "CURVE: the gateway's secret certificate (encrypts the control "
                                        "plane)", up=False)
    curve_authorized_keys: str | None = flag(None, "CURVE: directory of worker public certificates allowed to "
                                             "connect", up=False)
