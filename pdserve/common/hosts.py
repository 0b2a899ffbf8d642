"""Hosts and ports: whether a host reaches beyond this machine (what the CLI, the gateway
and the KV receiver check before they listen, or connect, without authentication), and
free ports to listen on."""

from __future__ import annotations

import contextlib
import ipaddress
import socket

LOOPBACK = "127.0.0.1"


def is_loopback(host: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1, bracketed or not) or `localhost`; any other
    name may resolve off-host."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free right now on `host` (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """`n` distinct TCP ports free right now on `host`: all held open while the OS picks, so
    two calls in a row cannot be handed the same port (as two `free_port()` calls can)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
