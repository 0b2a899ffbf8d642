"""Clients that open streams and never read, against a real gateway and real P/D workers:
the idle-write timeout cuts them, their requests are aborted on every worker (KV back to
idle), and a normal request is then served, with every slot of `--max-in-flight` free."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from bench.client import served_model
from bench.slow_clients import never_reading
from tests.e2e.cluster import Cluster, metric_value
from tests.e2e.cluster import http as http_call

IDLE_WRITE_S = 2.0


def test_streams_never_read_are_cut_and_free_their_kv(log_dir: Path) -> None:
    c = Cluster(log_dir)
    sockets: list[socket.socket] = []
    try:
        c.start_gateway("--max-in-flight", "2", "--idle-write-timeout", str(IDLE_WRITE_S), wait=False)
        c.add_worker("prefill")
        c.add_worker("decode")
        c.wait_gateway()
        workers = c.wait_roles(prefill=1, decode=1)
        model = served_model(c.url)
        sockets += [never_reading(c.port, model, i) for i in range(3)]

        def busy() -> bool:
            return any(w["free_blocks"] < w["total_blocks"] for w in c.worker_list() if w["role"] == "decode")

        def cut() -> float:
            return metric_value(str(http_call("GET", f"{c.url}/metrics")[1]), "llm_connections_dropped_total")

        c._wait(busy, "the stalled streams decoding", 60)
        t0 = time.monotonic()
        c._wait(lambda: cut() == 3, "all three streams cut", 120)
        idle = c.wait_idle(timeout=60)  # every stream aborted, its KV freed
        assert all(w["free_blocks"] == w["total_blocks"] for w in idle)
        print(f"KV idle {time.monotonic() - t0:.1f}s after the streams were seen decoding")
        status, out = http_call("POST", f"{c.url}/v1/completions",
                                {"model": model, "prompt": "after the stall", "max_tokens": 4}, timeout=30)
        assert status == 200 and out["usage"]["completion_tokens"] == 4, out
        assert 'llm_connections_dropped_total{reason="write_stall"} 3.0' in str(http_call("GET", f"{c.url}/metrics")[1])
        assert len(workers) == 2 and all(w.alive() for w in c.workers)
    finally:
        for s in sockets:
            s.close()
        c.stop()
