"""The HTTP server behind a worker's `/health` and `/metrics`: a fixed pool of handler
threads, a bounded queue of accepted connections, and a timeout on every read.

`ThreadingHTTPServer` starts one thread per connection and a connection that sends
nothing holds its thread forever, so anyone who reaches the port could start
thousands of threads in the worker. Here at most `threads` connections are served at
once and `queued` more wait; a connection past that is closed at once (and counted),
and a peer that stays silent for `timeout_s` during a read is dropped. Probes and
scrapes are short requests on fresh connections (HTTP/1.0), so a small pool is plenty.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

DEFAULT_THREADS = 4
DEFAULT_QUEUED = 32
DEFAULT_TIMEOUT_S = 5.0


class BoundedHTTPServer(HTTPServer):
    """`HTTPServer` with a bounded handler pool (see the module docstring)."""

    request_queue_size = 128  # listen backlog: a burst is accepted (and refused) quickly

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *,
                 threads: int = DEFAULT_THREADS, queued: int = DEFAULT_QUEUED,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if threads < 1 or queued < 0 or timeout_s <= 0:
            raise ValueError("threads >= 1, queued >= 0 and timeout_s > 0")
        self.read_timeout_s = timeout_s
        self.refused = 0  # connections closed at once because the pool and queue were full
        self._queue: queue.Queue[tuple[Any, Any] | None] = queue.Queue(maxsize=queued + threads)
        super().__init__(address, handler)
        self._threads = [threading.Thread(target=self._serve_queue, name=f"metrics-http-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, socket.socket):
            request.settimeout(self.read_timeout_s)
        try:
            self._queue.put_nowait((request, client_address))
        except queue.Full:
            self.refused += 1
            self.shutdown_request(request)

    def _serve_queue(self) -> None:
        while (item := self._queue.get()) is not None:
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:  # a timeout or a reset peer: that connection only
                pass
            finally:
                self.shutdown_request(request)

    def server_close(self) -> None:
        """After `shutdown()`: nothing is accepted any more, so once the queue is emptied
        (its connections closed, not served) it has room for every thread's stop mark."""
        super().server_close()
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.shutdown_request(item[0])
        for _ in self._threads:
            with contextlib.suppress(queue.Full):
                self._queue.put_nowait(None)
