"""Attack soak: normal traffic beside every client attack issue 36 names, and a kill -9
of a decode worker midway, against a real `pdserve up` this script starts itself.

    python -m bench.soak_attack --minutes 10 [--decode 2] [--concurrency 4]
        [--kill-at-minute M] [--output-json out.json]

For `--minutes` (the kill at half time unless `--kill-at-minute`), alongside
`--concurrency` clients of normal streamed completions (greedy and seeded, 24 tokens):

* stalled readers: `--stalled` streams whose client never reads, re-opened every 20 s
  (the gateway cuts them after its idle-write timeout, 5 s here);
* slow clients: `--slow` connections dribbling header lines and as many dribbling a
  body, one byte a second, re-opened as the gateway closes them (read timeouts 5 s);
* pathological regexes: 2 clients sending `(a{N}){1000}` with a fresh N each (every one
  a real compile, off the workers' step loops);
* ~1 MiB prompts (just under the body limit: refused by the length pre-check) and
  130,000 `stop_token_ids` (refused by the 64 cap), one client each, back to back.

Printed: normal requests and their errors by kind (target 0), attack requests by
status, whether every worker's KV is idle at the end (free blocks back to total, read
from the admin-token-protected GET /v1/workers), and the gateway's RSS after the
warm-up and at the end (target: within 50 MiB). Traffic goes to 127.0.0.1 only; `up`
runs in its own process group, SIGTERMed (then killed) on exit. Not in CI.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.client import served_model
from bench.harness import background, machine_line, parser, write_json
from bench.slow_clients import MIB, dribbler, rss_bytes, unread_post
from pdserve.common.hosts import free_port
from pdserve.loadgen.launch import stop_group
from tests.e2e import peers
from tests.e2e.cluster import ROOT, http

RSS_BOUND_MIB = 50.0
STALLED_REOPEN_S = 20.0
NORMAL_TOKENS = 24
UP_FLAGS = ["--num-blocks", "512", "--threads", "1", "--dtype", "float32", "--header-timeout", "5",
            "--body-timeout", "5", "--idle-write-timeout", "5"]


class Up:
    """`pdserve up` in its own session; `url` once it printed its ready line."""

    def __init__(self, decode: int, log: Path, admin_token: str) -> None:
        self.port, self.decode = free_port(), decode
        env = {**os.environ, "PDSERVE_ADMIN_TOKEN": admin_token, "OMP_NUM_THREADS": "1",
               "PDSERVE_LOG_LEVEL": "WARNING"}
        self.headers = {"Authorization": f"Bearer {admin_token}"}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "up", "--port", str(self.port), "--decode", str(decode),
                 *UP_FLAGS], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=out, start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode()
        if not line.startswith("pdserve ready at "):
            raise RuntimeError(f"pdserve up did not start: {line!r}; see {log}")
        self.url = f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[dict[str, Any]]:
        status, body = http("GET", f"{self.url}/v1/workers", headers=self.headers, timeout=10)
        return list(body["data"]) if status == 200 else []

    def gateway_pid(self) -> int:
        return next(pid for pid in peers.children(self.proc.pid) if "gateway" in peers.cmdline(pid))

    def stop(self) -> None:
        stop_group(self.proc, grace_s=60.0)


def normal_request(url: str, model: str, i: int) -> str:
    """One normal streamed completion: "" when it ended well, else what went wrong."""
    body: dict[str, Any] = {"model": model, "prompt": f"Story {i}: once upon a time", "max_tokens": NORMAL_TOKENS,
                            "stream": True, "ignore_eos": True}
    body.update({"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": i})
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [line[6:].strip() for line in r if line.startswith(b"data: ")]
    except urllib.error.HTTPError as e:
        return f"http {e.code}"
    except OSError as e:
        return type(e).__name__
    if not events or events[-1] != b"[DONE]":
        return "no [DONE]"
    if any(b'"error"' in e for e in events[:-1]):
        return "error event"
    return ""


class Load:
    """The normal clients and every attacker, until `stop` is set."""

    def __init__(self, up: Up, model: str, args: Any) -> None:
        self.up, self.model, self.args = up, model, args
        self.stop = threading.Event()
        self.normal = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.attacks: collections.Counter[str] = collections.Counter()
        self.messages: dict[str, str] = {}  # the first error message of each attack outcome
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._regex_n = itertools.count(150)

    def targets(self) -> list[Callable[[], None]]:
        """What the load's threads run, one each."""
        return [self._normal] * self.args.concurrency + [self._regex] * 2 + [
            self._big_prompt, self._stop_ids, self._stalled, self._slow]

    def _count(self, counter: collections.Counter[str], key: str) -> None:
        with self._lock:
            counter[key] += 1

    def _normal(self) -> None:
        while not self.stop.is_set():
            err = normal_request(self.up.url, self.model, next(self._ids))
            with self._lock:
                self.normal += 1
                if err:
                    self.errors[err] += 1

    def _post(self, kind: str, body: dict[str, Any]) -> None:
        status, out = http("POST", f"{self.up.url}/v1/completions", {"model": self.model, **body}, timeout=120)
        error = out.get("error", {}) if isinstance(out, dict) and status != 200 else {}
        key = f"{kind} {status}" + (f" {error.get('code')}" if error.get("code") else "")
        self._count(self.attacks, key)
        with self._lock:
            self.messages.setdefault(key, str(error.get("message", ""))[:160])

    def _regex(self) -> None:
        while not self.stop.is_set():
            self._post("regex", {"prompt": "attack", "max_tokens": 8,
                                 "structured_outputs": {"regex": f"(a{{{next(self._regex_n)}}}){{1000}}"}})

    def _big_prompt(self) -> None:
        prompt = "word " * 208_000  # ~1 MiB, just under the body limit
        while not self.stop.is_set():
            self._post("1MiB-prompt", {"prompt": prompt, "max_tokens": 4})

    def _stop_ids(self) -> None:
        while not self.stop.is_set():
            self._post("130k-stop_token_ids", {"prompt": "hi", "max_tokens": 4, "stop_token_ids": list(range(130_000))})

    def _stalled(self) -> None:
        while not self.stop.is_set():
            socks: list[socket.socket] = []
            with contextlib.suppress(OSError):
                socks = [never_reading(self.up.port, self.model, i) for i in range(self.args.stalled)]
            self._count(self.attacks, f"stalled-stream x{len(socks)}")
            self.stop.wait(STALLED_REOPEN_S)
            for s in socks:
                s.close()

    def _slow(self) -> None:
        asyncio.run(self._slow_clients())

    async def _slow_clients(self) -> None:
        head_h = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        head_b = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{")

        async def keep(head: bytes, drip: bytes, kind: str) -> None:
            while not self.stop.is_set():
                closed: list[float] = []
                await dribbler(self.up.port, head, drip, closed, time.monotonic())
                self._count(self.attacks, f"{kind} closed")

        await asyncio.gather(*(keep(head_h, b"X-a: b\r\n", "slow-header") for _ in range(self.args.slow)),
                             *(keep(head_b, b" ", "slow-body") for _ in range(self.args.slow)))


def never_reading(port: int, model: str, i: int) -> socket.socket:
    """A stream whose client never reads: ~1 MB of SSE (2 choices, 300 tokens, 20 top
    logprobs each) against a 4 KiB receive buffer, so the gateway's writes stall."""
    return unread_post(port, "/v1/completions", {"model": model, "prompt": f"stall {i}", "max_tokens": 300,
                                                 "n": 2, "logprobs": 20, "ignore_eos": True, "stream": True})


def kill_a_decode_worker(up: Up) -> int:
    pid = int(next(w["pid"] for w in up.workers() if w["role"] == "decode"))
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_idle(up: Up, timeout_s: float) -> tuple[bool, list[dict[str, Any]]]:
    """Until every worker (the replacement included) reports all KV free, nothing running."""
    deadline, workers = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        workers = up.workers()
        if len(workers) >= 1 + up.decode and all(
                w["free_blocks"] == w["total_blocks"] and w["running_seqs"] == 0 for w in workers):
            return True, workers
        time.sleep(0.5)
    return False, workers


def main() -> None:
    ap = parser(__doc__, model_help=None)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--stalled", type=int, default=4)
    ap.add_argument("--slow", type=int, default=100, help="slow-header connections, and as many slow-body ones")
    ap.add_argument("--kill-at-minute", type=float, default=None)
    args = ap.parse_args()
    kill_at = args.minutes / 2 if args.kill_at_minute is None else args.kill_at_minute
    log = Path(f"/tmp/pdserve-soak-attack-{os.getpid()}.log")
    up = Up(args.decode, log, secrets.token_hex(16))
    try:
        model = served_model(up.url)
        for i in range(4):  # warm-up, then the RSS the end is compared with
            normal_request(up.url, model, -1 - i)
        gateway = up.gateway_pid()
        rss0 = rss_bytes(gateway)
        t0 = time.monotonic()
        killed = 0
        load = Load(up, model, args)
        with background(load.targets(), load.stop, join_s=180):
            while time.monotonic() - t0 < args.minutes * 60:
                if not killed and time.monotonic() - t0 >= kill_at * 60:
                    killed = kill_a_decode_worker(up)
                    print(f"{time.monotonic() - t0:.0f} s: kill -9 decode worker pid {killed}", file=sys.stderr)
                time.sleep(1.0)
        idle, workers = wait_idle(up, 120)
        rss1 = rss_bytes(gateway)
        result = {
            "machine": machine_line(), "minutes": args.minutes, "decode_workers": args.decode,
            "killed_decode_pid": killed, "normal_requests": load.normal, "normal_errors": dict(load.errors),
            "attacks": dict(sorted(load.attacks.items())),
            "attack_messages": {k: v for k, v in sorted(load.messages.items()) if v}, "kv_idle_at_end": idle,
            "workers_at_end": [{k: w[k] for k in ("role", "pid", "free_blocks", "total_blocks")} for w in workers],
            "gateway_rss_start_mib": rss0 / MIB, "gateway_rss_end_mib": rss1 / MIB,
        }
        print(json.dumps(result, indent=1))
        print(machine_line())
        print(f"VERDICT normal-request errors: {sum(load.errors.values())} of {load.normal} (target 0): "
              f"{'PASS' if not load.errors else 'MISS'}")
        print(f"VERDICT KV idle at the end on every worker: {idle}: {'PASS' if idle else 'MISS'}")
        grew = (rss1 - rss0) / MIB
        print(f"VERDICT gateway RSS {rss0 / MIB:.0f} -> {rss1 / MIB:.0f} MiB ({grew:+.0f}; target within "
              f"{RSS_BOUND_MIB:g}): {'PASS' if grew <= RSS_BOUND_MIB else 'MISS'}")
        write_json(args.output_json, result)
    finally:
        up.stop()


if __name__ == "__main__":
    main()
