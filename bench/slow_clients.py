"""Slow and stalled clients against a real gateway and worker: how long the gateway takes
to shed them, what they cost it (RSS), and /health latency while they are attached,
against /health latency measured just before in the same run.

    python -m bench.slow_clients [--slow-headers 2000] [--slow-bodies 2000] [--stalled 50]
        [--read-timeout 5] [--idle-write-timeout 5] [--output-json out.json]

Phases: baseline /health (200 calls); N connections dribbling header lines and N
dribbling a body, one byte a second each (all must be closed within the read timeout
+ 5 s; /health p99 meanwhile: target < 50 ms); then `--stalled` streams whose client
never reads (cut after the idle-write timeout: the worker's KV must return to idle and
a normal request be served; 0 skips the phase). /health is timed from a process of its
own (`health_probe`), never from the event loop that also runs the thousands of
attackers, whose own delays would otherwise be counted as the gateway's. Traffic
goes to 127.0.0.1 only; the processes are killed on exit. Not in CI: the tests
(tests/gateway/test_connections.py, tests/e2e/test_stalled_clients.py) cover the same
behaviour at small scale.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import multiprocessing
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.client import served_model
from bench.harness import machine_line, parser, percentile, verdict
from tests.e2e.cluster import Cluster, metric_value
from tests.e2e.cluster import http as http_call

MIB = 1 << 20


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def health_probe(url: str, n: int) -> list[float]:
    """In its own process: `n` back-to-back GET /health on fresh connections, each timed
    from connect to the server's close (blocking sockets: nothing else shares the clock)."""
    host, port = url.split("//")[1].split(":")
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            while s.recv(65536):
                pass
        out.append(time.perf_counter() - t0)
    return out


def probe_pool() -> cf.ProcessPoolExecutor:
    return cf.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


async def dribbler(port: int, head: bytes, drip: bytes, closed: list[float], t0: float,
                   lived: list[float] | None = None) -> None:
    """Open, send `head`, then `drip` once a second until the gateway closes the connection;
    `closed` gets the close time since `t0`, `lived` how long the connection was open."""
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        closed.append(-1.0)
        return
    opened = time.monotonic()
    w.write(head)
    try:
        while True:
            try:
                data = await asyncio.wait_for(r.read(65536), 1.0)
                if not data:
                    break
            except asyncio.TimeoutError:
                w.write(drip)
                await w.drain()
    except (ConnectionError, OSError):
        pass
    closed.append(time.monotonic() - t0)
    if lived is not None:
        lived.append(time.monotonic() - opened)
    w.close()


async def slow_phase(c: Cluster, n_headers: int, n_bodies: int, pid: int,
                     probe: cf.ProcessPoolExecutor) -> dict[str, Any]:
    t0 = time.monotonic()
    closed: list[float] = []
    lived: list[float] = []
    head_h = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    head_b = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000\r\n\r\n{")
    tasks = [asyncio.create_task(dribbler(c.port, head_h, b"X-a: b\r\n", closed, t0, lived)) for _ in range(n_headers)]
    tasks += [asyncio.create_task(dribbler(c.port, head_b, b" ", closed, t0, lived)) for _ in range(n_bodies)]
    await asyncio.sleep(1.0)
    peak = rss_bytes(pid)
    # Timed in the probe's process while this loop keeps every dribbler going.
    during = await asyncio.get_running_loop().run_in_executor(probe, health_probe, c.url, 200)
    peak = max(peak, rss_bytes(pid))
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return {"connections": n_headers + n_bodies, "failed_to_connect": sum(1 for t in closed if t < 0),
            # From the first connect (opening 4,000 on one loop takes seconds), and each one's
            # own life, connect to close: the timeouts bound the second.
            "all_closed_after_s": max(closed), "longest_open_s": max(lived, default=0.0),
            "peak_rss_mib": peak / MIB,
            "health_p50_ms": percentile(during, 0.5) * 1e3, "health_p99_ms": percentile(during, 0.99) * 1e3}


def never_reading(port: int, model: str, i: int) -> socket.socket:
    """A greedy chat stream with big chunks (8 choices, 20 top logprobs each) whose client
    has a tiny receive window and never reads: the gateway's output backs up within seconds."""
    return unread_post(port, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": f"stall {i}"}], "max_tokens": 1500, "n": 8,
        "logprobs": True, "top_logprobs": 20, "temperature": 0, "ignore_eos": True, "stream": True})


def unread_post(port: int, path: str, payload: dict[str, Any]) -> socket.socket:
    """POST `payload` to 127.0.0.1:`port``path` from a socket with a 4 KiB receive buffer that
    is never read: a big stream backs up in the gateway's writes within seconds."""
    body = json.dumps(payload)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    return s


def stalled_phase(c: Cluster, n: int) -> dict[str, Any]:
    """`n` streams never read. With --max-in-flight 8 they are admitted 8 at a time; those
    left waiting past --max-queue-wait get a 503 they never read either. Done when the
    gateway holds none of them (nothing in flight or queued) and the worker's KV is idle."""
    model = served_model(c.url)

    def gateway_metric(name: str) -> float:
        return metric_value(str(http_call("GET", f"{c.url}/metrics")[1]), name)

    def busy() -> bool:
        return any(w["running_seqs"] > 0 for w in c.worker_list())

    rejected0 = gateway_metric("llm_requests_rejected_total")
    cut0 = gateway_metric("llm_connections_dropped_total")
    t0 = time.monotonic()
    socks = [never_reading(c.port, model, i) for i in range(n)]
    try:
        c._wait(busy, "the stalled streams decoding", 120)
        c._wait(lambda: gateway_metric("llm_requests_in_flight") == 0 and gateway_metric("llm_queue_depth") == 0,
                "the gateway holding none of them", 600)
        released_s = time.monotonic() - t0
        c.wait_idle(timeout=120)
        idle_s = time.monotonic() - t0
        status, out = http_call("POST", f"{c.url}/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4})
    finally:
        for s in socks:
            s.close()
    return {"streams": n, "cut": gateway_metric("llm_connections_dropped_total") - cut0,
            "refused_after_queue_wait": gateway_metric("llm_requests_rejected_total") - rejected0,
            "all_released_after_s": released_s, "kv_idle_after_s": idle_s, "normal_request_status": status}


def main() -> None:
    ap = parser(__doc__, model_help=None)
    ap.add_argument("--slow-headers", type=int, default=2000)
    ap.add_argument("--slow-bodies", type=int, default=2000)
    ap.add_argument("--stalled", type=int, default=50)
    ap.add_argument("--read-timeout", type=float, default=5.0)
    ap.add_argument("--idle-write-timeout", type=float, default=5.0)
    args = ap.parse_args()
    c = Cluster(Path(tempfile.mkdtemp(prefix="pdserve-slow-clients-")))
    try:
        c.start_gateway("--header-timeout", str(args.read_timeout), "--body-timeout", str(args.read_timeout),
                        "--idle-write-timeout", str(args.idle_write_timeout), "--max-in-flight", "8", wait=False)
        c.add_worker("worker")
        c.wait_gateway()
        c.wait_roles(colocated=1)
        assert c.gateway is not None
        pid = c.gateway.popen.pid
        with probe_pool() as probe:
            probe.submit(health_probe, c.url, 5).result()  # the process is up before anything is timed
            base = probe.submit(health_probe, c.url, 200).result()
            rss0 = rss_bytes(pid)
            print(f"baseline done; {args.slow_headers} + {args.slow_bodies} slow connections ...", file=sys.stderr)
            slow = asyncio.run(slow_phase(c, args.slow_headers, args.slow_bodies, pid, probe))
        rss1 = rss_bytes(pid)
        print(f"slow phase: {slow}; {args.stalled} stalled streams ...", file=sys.stderr)
        stalled = stalled_phase(c, args.stalled) if args.stalled else {}
        result = {
            "baseline": {"health_p50_ms": percentile(base, 0.5) * 1e3, "health_p99_ms": percentile(base, 0.99) * 1e3,
                         "rss_mib": rss0 / MIB},
            "slow": {**slow, "rss_after_mib": rss1 / MIB, "read_timeout_s": args.read_timeout,
                     "health_p99_ratio": slow["health_p99_ms"] / max(percentile(base, 0.99) * 1e3, 1e-3)},
            "stalled": {**stalled, "idle_write_timeout_s": args.idle_write_timeout},
        }
        print(json.dumps(result, indent=2))
        print(machine_line())
        print(verdict("/health p99 during the slow connections (ms)", [slow["health_p99_ms"]], "< 50 ms",
                      lambda ms: ms < 50, fmt="{:.1f}"))
        print(verdict("longest slow connection, connect to close (s)", [slow["longest_open_s"]],
                      f"<= read timeout + 5 = {args.read_timeout + 5:g} s",
                      lambda s: s <= args.read_timeout + 5, fmt="{:.1f}"))
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(result, indent=2))
    finally:
        c.stop()


if __name__ == "__main__":
    main()
