"""Whether a host reaches beyond this machine: what the CLI, the gateway and the KV
receiver check before they listen, or connect, without authentication."""

from __future__ import annotations

import ipaddress


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
