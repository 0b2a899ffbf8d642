"""A worker's /health and /metrics port under idle connections: a fixed pool of
threads, connections past the queue closed at once, silent peers dropped at the read
timeout, and the port serving again afterwards (real sockets, a real server)."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

from pdserve.worker.metrics import MetricsServer, WorkerMetrics
from pdserve.worker.metrics_http import DEFAULT_QUEUED, DEFAULT_THREADS

IDLE_CONNECTIONS = 300
READ_TIMEOUT_S = 0.5
FLOOD_READ_TIMEOUT_S = 2.0  # long enough that the flood outruns the pool


def _closed_by_server(sock: socket.socket, deadline: float) -> bool:
    """True once the server closes `sock` (EOF or reset) before `deadline`."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_neither_pile_up_threads_nor_lock_the_port_out() -> None:
    server = MetricsServer(WorkerMetrics("decode", "w-test"), "127.0.0.1", 0, lambda: True,
                           read_timeout_s=FLOOD_READ_TIMEOUT_S)
    server.start()
    before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
        # Past the pool and its queue, connections are closed at once; the server's
        # threads did not grow.
        deadline = time.monotonic() + 30
        while server.refused == 0:
            assert time.monotonic() < deadline, "no connection refused past the pool and queue"
            time.sleep(0.01)
        assert threading.active_count() <= before
        # Silent peers are dropped: every connection is closed by the server, those in
        # the pool at the read timeout, those queued when their turn comes.
        rounds = (DEFAULT_QUEUED + DEFAULT_THREADS) // DEFAULT_THREADS + 1
        deadline = time.monotonic() + rounds * FLOOD_READ_TIMEOUT_S + 10
        assert all(_closed_by_server(s, deadline) for s in idle)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5) as r:
            assert r.status == 200 and r.read() == b'{"status":"ok"}'
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            assert b"llm_kv_cache_usage_ratio" in r.read()
    finally:
        for s in idle:
            s.close()
        server.close()


def test_a_slow_request_is_cut_at_the_read_timeout_and_others_are_served() -> None:
    server = MetricsServer(WorkerMetrics("prefill", "w-test"), "127.0.0.1", 0, lambda: True,
                           read_timeout_s=READ_TIMEOUT_S)
    server.start()
    try:
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        slow.sendall(b"GET /metrics HTTP/1.0\r\n")  # and never the end of the headers
        assert _closed_by_server(slow, time.monotonic() + READ_TIMEOUT_S + 10)
        slow.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=5) as r:
            assert r.status == 200
    finally:
        server.close()
