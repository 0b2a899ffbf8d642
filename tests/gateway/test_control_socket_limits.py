"""The gateway's control ROUTER caps what a peer may make it buffer: `MAXMSGSIZE` at
the codec's own limit (the socket drops the connection at the frame's size header,
before the bytes are in memory; tests/e2e/test_cluster_auth.py shows the drop and the
flat RSS) and a handshake deadline."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq

from gateway.control_plane import ClusterConfig, ControlPlane
from pdserve.common import protocol
from pdserve.common.transport import HANDSHAKE_IVL_MS


class _NoEvents:
    def deliver(self, sender: str, wid: str, event: Any) -> None:
        raise AssertionError("no worker talks to this control plane")

    def lost(self, w: Any) -> None:
        pass


def test_control_router_caps_message_size_and_handshake_time() -> None:
    async def go() -> tuple[int, int]:
        plane = ControlPlane(ClusterConfig(), _NoEvents())
        await plane.start()
        try:
            sock = plane._sock
            assert sock is not None
            return int(sock.getsockopt(zmq.MAXMSGSIZE)), int(sock.getsockopt(zmq.HANDSHAKE_IVL))
        finally:
            await plane.close()

    max_size, handshake = asyncio.run(go())
    assert max_size == protocol.MAX_MESSAGE_BYTES
    assert handshake == HANDSHAKE_IVL_MS
