"""Refusing an unauthenticated control or KV plane off loopback (docs/security.md).

A gateway whose control plane listens on a non-loopback address, or a worker that
talks to a gateway, or listens for KV, off loopback, must have CURVE keys: without
them anyone who reaches the port can register as a worker and read users' prompts.
`--insecure` says explicitly that this is wanted (a private, trusted network); the
process then warns at every start. On loopback nothing changes: only this host's
users can connect, and `pdserve up` gives its own processes keys anyway.
"""

from __future__ import annotations

import argparse
import logging
from urllib.parse import urlparse

from pdserve.cli.args import UsageError
from pdserve.common.hosts import is_loopback
from pdserve.common.roles import Role

log = logging.getLogger("pdserve.security")

INSECURE_HELP = ("serve the control/KV plane off loopback without CURVE keys: anyone who can reach "
                 "the port can join as a worker and read prompts (warned at every start)")


def add_insecure_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--insecure", action="store_true", help=INSECURE_HELP)


def check_gateway_exposure(args: argparse.Namespace) -> None:
    """Refuse `--control-host` off loopback without CURVE unless `--insecure`."""
    if args.curve_secret_key:
        return
    if not is_loopback(args.control_host) and not args.insecure:
        raise UsageError("--control-host", f"{args.control_host} is not loopback and the control plane "
                         "has no CURVE keys: give --curve-secret-key and --curve-authorized-keys "
                         "(`pdserve keygen DIR`), or --insecure on a trusted network")
    if args.insecure:
        warn_insecure("gateway control plane", args.control_host)


def exposed_worker_addresses(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, host) of each of a worker's control/KV addresses that is off loopback."""
    out = [("--gateway", host) for host in (urlparse(g).hostname or "" for g in args.gateway)
           if not is_loopback(host)]
    if args.role in (Role.DECODE, Role.PREFILL) and not is_loopback(args.kv_host):
        out.append(("--kv-host", args.kv_host))
    return out


def check_worker_exposure(args: argparse.Namespace) -> None:
    """Refuse a worker whose control or KV address is off loopback without CURVE unless
    `--insecure`."""
    if args.curve_key:
        return
    exposed = exposed_worker_addresses(args)
    if exposed and not args.insecure:
        flag, host = exposed[0]
        raise UsageError(flag, f"{host} is not loopback and this worker has no CURVE keys: give "
                         "--curve-key, --curve-server-key and --curve-authorized-keys "
                         "(`pdserve keygen DIR`), or --insecure on a trusted network")
    if args.insecure:
        where = ", ".join(h for _, h in exposed) or "loopback"
        warn_insecure("worker control and KV planes", where)


def check_kv_events_exposure(args: argparse.Namespace) -> None:
    """Refuse a `--kv-events-config` endpoint off loopback unless `--insecure`, CURVE keys
    or not: vLLM's event stream has no CURVE (its consumers speak none), and it carries
    the token ids of users' prompts."""
    config = args.kv_events_config
    exposed = config.exposed if config is not None else []
    if exposed and not args.insecure:
        raise UsageError("--kv-events-config", f"endpoint {exposed[0]} is not loopback and the KV events "
                         "stream has no CURVE (it carries prompts' token ids): use tcp://127.0.0.1:PORT or "
                         "ipc://PATH, or --insecure on a trusted network")
    if exposed:
        log.warning("--insecure: the KV events (prompts' token ids) are published without authentication "
                    "on %s (docs/security.md)", ", ".join(exposed))


def warn_insecure(what: str, where: str) -> None:
    log.warning("--insecure: the %s on %s run without CURVE: any peer that reaches them can pose as a "
                "worker or a gateway and read or answer users' prompts (docs/security.md)", what, where)
