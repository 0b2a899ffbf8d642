"""Others' inter-token latency while pathological regexes compile, against the same
streams without them, in one run, through a real gateway and 1P+1D workers.

    python -m bench.grammar_attack [--streams 4] [--tokens 48] [--attackers 8] [--reps 2]
        [--output-json out.json]

Each rep runs a baseline phase (`--streams` greedy streams of `--tokens` tokens, ITL
measured from the SSE chunks' arrival times) and an attack phase (the same streams
while `--attackers` requests with a pathological regex, `(a{N}){1000}` with a fresh N
each so no compile is a cache hit, are kept in flight the whole time), alternating.
Printed: each phase's ITL p50 (and p99: a compile on the step loop shows as stalls)
per rep, the attack/baseline p50 ratio per rep and its median (target <= 1.5x: a
grammar compiles off the step loop, docs/security.md), and how many attack requests ran (each compiles 0.3-0.5 s on both workers). Not in CI: the tests
(tests/engine/test_grammar_off_loop.py, tests/nodes/test_grammar_wait.py) cover the
behaviour with a gate instead of timing.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.client import at_once, served_model
from bench.harness import background, machine_line, parser, percentile, verdict, write_json
from tests.e2e.cluster import Cluster, http

FIRST_N = 150  # the first attack regex's repeat count; each later one adds 1


def stream_itls(url: str, body: dict[str, Any]) -> list[float]:
    """Seconds between consecutive token chunks of one streamed completion."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps[1:])]  # from the second chunk: decode only


class Attackers:
    """Pathological-regex requests one after another until `stop` (`run`, one per thread)."""

    def __init__(self, url: str, model: str, counter: itertools.count[int]) -> None:
        self.url, self.model, self.counter = url, model, counter
        self.stop = threading.Event()
        self.statuses: list[int] = []

    def run(self) -> None:
        while not self.stop.is_set():
            regex = f"(a{{{next(self.counter)}}}){{1000}}"
            status, _ = http("POST", self.url, {"model": self.model, "prompt": "attack", "max_tokens": 8,
                                                "structured_outputs": {"regex": regex}}, timeout=120)
            self.statuses.append(status)


def phase(url: str, model: str, streams: int, tokens: int) -> list[float]:
    """Every ITL of `streams` concurrent greedy streams."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True}
    out: list[list[float]] = [[] for _ in range(streams)]
    at_once(lambda i: out[i].extend(stream_itls(url, body)), range(streams))
    return [x for xs in out for x in xs]


def main() -> None:
    ap = parser(__doc__, model_help=None)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--attackers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    c = Cluster(Path(tempfile.mkdtemp(prefix="pdserve-grammar-attack-")))
    try:
        c.start_gateway(wait=False)
        c.add_worker("prefill")
        c.add_worker("decode")
        c.wait_gateway()
        c.wait_roles(prefill=1, decode=1)
        model = served_model(c.url)
        url = f"{c.url}/v1/completions"
        phase(url, model, args.streams, 8)  # warm-up
        counter = itertools.count(FIRST_N)
        base, attack, ratios, p99s, sent = [], [], [], [], 0
        for rep in range(args.reps):
            b_all = phase(url, model, args.streams, args.tokens)
            b = statistics.median(b_all)
            attackers = Attackers(url, model, counter)
            with background([attackers.run] * args.attackers, attackers.stop):
                deadline = time.monotonic() + 60
                while len(attackers.statuses) < 1 and time.monotonic() < deadline:
                    time.sleep(0.05)  # bench only: let the first compiles start before measuring
                a_all = phase(url, model, args.streams, args.tokens)
                a = statistics.median(a_all)
            sent += len(attackers.statuses)
            base.append(b * 1e3)
            attack.append(a * 1e3)
            ratios.append(a / b)
            p99s.append((percentile(b_all, 0.99) * 1e3, percentile(a_all, 0.99) * 1e3))
            print(f"rep {rep}: ITL p50 baseline {b * 1e3:.1f} ms, with {args.attackers} pathological regexes "
                  f"{a * 1e3:.1f} ms ({a / b:.2f}x); p99 {p99s[-1][0]:.0f} -> {p99s[-1][1]:.0f} ms; attack statuses {sorted(set(attackers.statuses))}",
                  file=sys.stderr)
        result = {"machine": machine_line(), "streams": args.streams, "tokens": args.tokens,
                  "attackers": args.attackers, "attack_requests": sent, "itl_p50_baseline_ms": base,
                  "itl_p50_attack_ms": attack, "itl_p99_baseline_attack_ms": p99s, "ratio": ratios, "ratio_median": statistics.median(ratios)}
        print(machine_line())
        print(f"ITL p50 (ms) baseline {', '.join(f'{x:.1f}' for x in base)}; with {args.attackers} "
              f"pathological regexes in flight {', '.join(f'{x:.1f}' for x in attack)}; "
              f"{sent} attack requests; ITL p99 (ms) {', '.join(f'{x:.0f} -> {y:.0f}' for x, y in p99s)}")
        print(verdict("others' ITL p50 under attack / baseline", ratios, "<= 1.5x", lambda r: r <= 1.5,
                      fmt="{:.2f}x"))
        write_json(args.output_json, result)
    finally:
        c.stop()


if __name__ == "__main__":
    main()
