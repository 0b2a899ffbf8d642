"""A real Redis for tests: Debian's `redis-server` on a free loopback port, no
persistence, bounded with an LRU policy; stopped (and waited for) on exit."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.common.hosts import free_port


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.skip("needs Debian's redis-server (apt-get install -y redis-server; .ci/run installs it)")
    return found


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        return s.recv(16).startswith(b"+PONG")
    return False


@contextlib.contextmanager
def redis_server(workdir: Path, maxmemory: str = "64mb") -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """(redis://127.0.0.1:PORT/0, the server process)."""
    port = free_port()
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
