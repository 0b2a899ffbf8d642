"""`pdserve gateway`: the OpenAI-compatible HTTP front plus the workers' control plane.

Loads the tokenizer only (never torch). Binds the ZeroMQ control socket for
workers on `--control-host:--control-port` (a free port when 0) and prints
`pdserve control plane on tcp://HOST:PORT` before serving, so launchers can
start workers against it.
"""

from __future__ import annotations

import argparse
import json
import logging

from pdserve.cli.args import (
    UsageError,
    check_listen,
    check_max_model_len,
    check_model,
    model_dir,
)
from pdserve.cli.curve_options import add_insecure_arg, check_gateway_exposure
from pdserve.cli.gateway_args import GatewayArgs
from pdserve.cli.gateway_options import (
    check_served_names,
    check_tool_flags,
    gateway_settings,
    sampling_defaults,
)
from pdserve.cli.lora_args import check_lora_args, gateway_lora_config
from pdserve.common import envs
from pdserve.common.logs import configure_logging

log = logging.getLogger("pdserve.gateway")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("gateway", help="run the HTTP gateway and worker registry")
    GatewayArgs.add_to(ap)
    add_insecure_arg(ap)
    ap.set_defaults(func=run)


def check_args(args: argparse.Namespace) -> int:
    """What parsing alone cannot see; returns the max model length to serve
    (`--max-model-len`, else the model's own limit, as the workers resolve it)."""
    if bool(args.curve_secret_key) != bool(args.curve_authorized_keys):
        flag = "--curve-authorized-keys" if args.curve_secret_key else "--curve-secret-key"
        raise UsageError(flag, "--curve-secret-key and --curve-authorized-keys go together")
    check_gateway_exposure(args)
    check_tool_flags(args)
    check_lora_args(args)
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
    from pdserve.common.hosts import free_port
    from pdserve.common.tracing import make_tracer
    from pdserve.common.transport import CurveServer

    max_model_len = check_args(args)
    if args.api_key:
        log.warning(json.dumps({"event": "api_key_on_command_line", "note": "--api-key is visible to every "
                                "user of this host in the process list; use --api-key-file or PDSERVE_API_KEYS"}))
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
        lora=gateway_lora_config(args),
    )
    print(f"pdserve control plane on tcp://{args.control_host}:{control_port}", flush=True)
    return run_gateway(config, cluster, Tokenizer.from_model_dir(model), tracer)
