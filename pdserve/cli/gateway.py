"""`pdserve gateway`: the OpenAI-compatible HTTP front plus the workers' control plane.

Loads the tokenizer only (never torch). Binds the ZeroMQ control socket for
workers on `--control-host:--control-port` (a free port when 0) and prints
`pdserve control plane on tcp://HOST:PORT` before serving, so launchers can
start workers against it.
"""

from __future__ import annotations

import argparse

from pdserve.cli.args import (
    UsageError,
    add_model_arg,
    check_listen,
    check_max_model_len,
    check_model,
    host,
    model_dir,
    non_negative_float,
    non_negative_int,
    port_or_zero,
    positive_float,
    positive_int,
)
from pdserve.cli.gateway_options import (
    add_gateway_options,
    check_served_names,
    check_tool_flags,
    gateway_settings,
    sampling_defaults,
)
from pdserve.common import envs
from pdserve.common.logs import configure_logging

# gateway/kv_router.py: ROUTERS (kept out of this module's imports: parsing loads no zmq)
ROUTERS = ("kv-aware", "least-loaded", "round-robin")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("gateway", help="run the HTTP gateway and worker registry")
    ap.add_argument("--host", type=host, default="127.0.0.1")
    ap.add_argument("--port", type=port_or_zero, default=8000,
                    help="0: a free one (the `listening` log event names it)")
    add_model_arg(ap, " (for the tokenizer)")
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="model name(s) requests may use; the first is reported in responses "
                         "(default: the dir name)")
    ap.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                    help="sampling defaults: auto (the model's generation_config.json), vllm (none), "
                         "or a directory holding a generation_config.json")
    ap.add_argument("--max-model-len", type=positive_int, default=None, help="default: the model's limit")
    ap.add_argument("--control-host", type=host, default="127.0.0.1", help="address workers connect to")
    ap.add_argument("--control-port", type=port_or_zero, default=0, help="0: a free port")
    ap.add_argument("--heartbeat-timeout", type=positive_float, default=3.0,
                    help="seconds of silence before a worker is removed")
    ap.add_argument("--stall-timeout", type=non_negative_float, default=30.0,
                    help="seconds a heartbeating worker may hold work without an engine step before "
                         "it is marked stalled and its requests recovered (0: off)")
    ap.add_argument("--max-recoveries", type=non_negative_int, default=3)
    ap.add_argument("--router", choices=ROUTERS, default="kv-aware",
                    help="how a prompt's worker is picked: kv-aware (least uncached prompt tokens + queued "
                         "tokens, from the workers' prefix-cache events), least-loaded, round-robin")
    ap.add_argument("--local-prefill-threshold", type=non_negative_int, default=0, metavar="TOKENS",
                    help="a request whose uncached prompt part on the decode worker is at most this many "
                         "tokens is prefilled there (no KV transfer), up to 4x that when every prefill "
                         "worker has 4x its uncached tokens queued; 0: off")
    ap.add_argument("--request-timeout", type=positive_float, default=None, help="per-request deadline (s)")
    ap.add_argument("--drain-timeout", type=positive_float, default=30.0)
    ap.add_argument("--max-in-flight", type=positive_int, default=256, help="requests inside the backend at once")
    ap.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="OpenTelemetry: export this process's spans to this OTLP collector (vLLM's flag; "
                    "default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing); protocol, headers, "
                    "service name and sampler from the standard OTEL_* variables. Needs pdserve[otel]")
    add_gateway_options(ap)
    ap.add_argument("--curve-secret-key", default=None,
                    help="CURVE: the gateway's secret certificate (encrypts the control plane)")
    ap.add_argument("--curve-authorized-keys", default=None,
                    help="CURVE: directory of worker public certificates allowed to connect")
    ap.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> int:
    """What parsing alone cannot see; returns the max model length to serve
    (`--max-model-len`, else the model's own limit, as the workers resolve it)."""
    if bool(args.curve_secret_key) != bool(args.curve_authorized_keys):
        flag = "--curve-authorized-keys" if args.curve_secret_key else "--curve-secret-key"
        raise UsageError(flag, "--curve-secret-key and --curve-authorized-keys go together")
    check_tool_flags(args)
    max_model_len = check_max_model_len(args.max_model_len, check_model(args.model))
    check_served_names(args.served_model_name)
    if args.port:
        check_listen("--port", args.host, args.port)
    if args.control_port:
        check_listen("--control-port", args.control_host, args.control_port)
    return max_model_len


def run(args: argparse.Namespace) -> int:
    configure_logging(envs.log_level())
    from gateway.cluster import ClusterBackend, ClusterConfig
    from gateway.config import GatewayConfig
    from gateway.server import run_gateway
    from gateway.tokenizer import Tokenizer
    from pdserve.common.tracing import make_tracer
    from pdserve.common.transport import CurveServer, free_port

    max_model_len = check_args(args)
    defaults = sampling_defaults(args.generation_config, model_dir(args.model))
    try:
        settings = gateway_settings(args)
    except ValueError as e:
        raise SystemExit(f"pdserve gateway: {e}") from None
    curve = CurveServer(args.curve_secret_key, args.curve_authorized_keys) if args.curve_secret_key else None
    model = model_dir(args.model)
    control_port = args.control_port or free_port(args.control_host)
    try:
        tracer = make_tracer(args.otlp_traces_endpoint, "gateway")
        cluster = ClusterBackend(ClusterConfig(
            control_host=args.control_host, control_port=control_port,
            heartbeat_timeout_s=args.heartbeat_timeout, stall_timeout_s=args.stall_timeout,
            max_recoveries=args.max_recoveries, curve=curve, seed_key=envs.gateway_seed_key(),
            router=args.router, local_prefill_threshold=args.local_prefill_threshold,
        ), tracer)
    except ValueError as e:
        raise SystemExit(f"pdserve gateway: {e}") from None
    names = args.served_model_name or [getattr(args, "repo_id", None) or model.name]
    config = GatewayConfig(
        host=args.host,
        port=args.port,
        model_name=names[0],
        model_aliases=tuple(names[1:]),
        model_dir=str(model),
        max_model_len=max_model_len,
        **settings,
        sampling_defaults=defaults,
        drain_timeout_s=args.drain_timeout,
        request_timeout_s=args.request_timeout,
    )
    print(f"pdserve control plane on tcp://{args.control_host}:{control_port}", flush=True)
    return run_gateway(config, cluster, Tokenizer.from_model_dir(model), tracer)
