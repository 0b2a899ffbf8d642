"""`pdserve gateway`: the OpenAI-compatible HTTP front plus the workers' control plane.

Loads the tokenizer only (never torch). Binds the ZeroMQ control socket for
workers on `--control-host:--control-port` (a free port when 0) and prints
`pdserve control plane on tcp://HOST:PORT` before serving, so launchers can
start workers against it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import envs
from common.logs import configure_logging
from pdserve.cli.gateway_options import add_gateway_options, gateway_settings


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("gateway", help="run the HTTP gateway and worker registry")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default=None, help="model dir for the tokenizer (default: built-in)")
    ap.add_argument("--served-model-name", default=None, help="model id (default: the dir name)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    ap.add_argument("--control-host", default="127.0.0.1", help="address workers connect to")
    ap.add_argument("--control-port", type=int, default=0, help="0: a free port")
    ap.add_argument("--heartbeat-timeout", type=float, default=3.0,
                    help="seconds of silence before a worker is removed")
    ap.add_argument("--stall-timeout", type=float, default=30.0,
                    help="seconds a heartbeating worker may hold work without an engine step before "
                         "it is marked stalled and its requests recovered (0: off)")
    ap.add_argument("--max-recoveries", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=None, help="per-request deadline (s)")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--max-in-flight", type=int, default=256, help="requests inside the backend at once")
    ap.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
    add_gateway_options(ap)
    ap.add_argument("--curve-secret-key", default=None,
                    help="CURVE: the gateway's secret certificate (encrypts the control plane)")
    ap.add_argument("--curve-authorized-keys", default=None,
                    help="CURVE: directory of worker public certificates allowed to connect")
    ap.set_defaults(func=run)


def model_max_len(model_dir: Path) -> int:
    with open(model_dir / "config.json") as f:
        cfg = json.load(f)
    return int(cfg.get("max_position_embeddings", 2048))


def run(args: argparse.Namespace) -> int:
    configure_logging(envs.log_level())
    from common.transport import CurveServer, free_port
    from gateway.cluster import ClusterBackend, ClusterConfig
    from gateway.config import GatewayConfig
    from gateway.server import run_gateway
    from gateway.tokenizer import Tokenizer

    if bool(args.curve_secret_key) != bool(args.curve_authorized_keys):
        raise SystemExit("--curve-secret-key and --curve-authorized-keys go together")
    curve = CurveServer(args.curve_secret_key, args.curve_authorized_keys) if args.curve_secret_key else None

    if args.model is None:
        from pdserve.default_model import default_model_dir

        model_dir = Path(default_model_dir())
    else:
        model_dir = Path(args.model)
    control_port = args.control_port or free_port(args.control_host)
    try:
        cluster = ClusterBackend(ClusterConfig(
            control_host=args.control_host, control_port=control_port,
            heartbeat_timeout_s=args.heartbeat_timeout, stall_timeout_s=args.stall_timeout,
            max_recoveries=args.max_recoveries, curve=curve, seed_key=envs.gateway_seed_key(),
        ))
    except ValueError as e:
        raise SystemExit(f"pdserve gateway: {e}") from None
    try:
        settings = gateway_settings(args)
    except ValueError as e:
        raise SystemExit(f"pdserve gateway: {e}") from None
    config = GatewayConfig(
        host=args.host,
        port=args.port,
        model_name=args.served_model_name or model_dir.name,
        model_dir=str(model_dir),
        max_model_len=args.max_model_len or model_max_len(model_dir),
        **settings,
        drain_timeout_s=args.drain_timeout,
        request_timeout_s=args.request_timeout,
    )
    print(f"pdserve control plane on tcp://{args.control_host}:{control_port}", flush=True)
    return run_gateway(config, cluster, Tokenizer.from_model_dir(model_dir))
