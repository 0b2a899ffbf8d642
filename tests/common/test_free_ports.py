"""`free_ports(n)`: n ports picked while all are held, so none repeats (two `free_port()`
calls in a row may be handed the same one: a gateway's HTTP and control ports once were)."""

from __future__ import annotations

import socket

from pdserve.common.hosts import free_ports


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    for p in ports[:4]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))
