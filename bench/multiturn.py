"""Multi-turn chat: TTFT and KV bytes shipped with KV-aware vs round-robin routing.

    .venv/bin/python -m bench.multiturn --conversations 16 --turns 6 --runs 3

Each of `--conversations` conversations (run concurrently, one client each) grows
over `--turns` turns: turn i sends everything so far (earlier user messages and the
answers the server gave) plus a new `--turn-words`-word user message (100 words: about
180 tokens of the built-in tokenizer; with the answers re-tokenized the sixth turn sends
about 1,500 tokens, inside the built-in model's 2,048),
streams `--output-len` tokens (ignore_eos) and appends the answer. Conversations share
no prefix. The built-in model is the trained one (its answers are words, so the
re-tokenized history continues the token chain the worker cached). Each prefill worker
gets `--prefill-num-blocks` KV blocks (default 1,024 of 16 tokens): fewer than the
working set it meets under round-robin (every conversation, ~1,500 blocks at the last
turn) but room for its half under kv-aware routing, so cache-blind routing evicts; the
decode worker keeps its default pool, which holds every conversation. Every configuration (`--up-args` plus `--router R` for each router in
`--routers`) is started fresh per run; runs alternate the routers, so a ratio is taken
within one run, and the median of the per-run ratios is reported. Targets of issue 18:
TTFT p50 with kv-aware routing at least 3x lower than round-robin; KV bytes shipped
(suffix-only handoff) at least 80% below every prompt block shipped (prompt tokens x
the model's KV bytes per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import numpy as np

from bench import harness
from bench.loadgen.launch import pdserve_up
from bench.loadgen.prompts import WORDS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-words", type=int, default=100, help="words in each new user message")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--routers", default="kv-aware,round-robin")
    ap.add_argument("--up-args", default="--prefill 2 --decode 1")
    ap.add_argument("--prefill-num-blocks", type=int, default=1024,
                    help="KV blocks per prefill worker (0: the default pool; decode keeps its default)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, str, int, int]:
    """One streamed completion: (TTFT s, text, cached prompt tokens, prompt tokens)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start, ttft, text, cached, prompt_tokens = time.monotonic(), None, [], 0, 0
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:300]!r}") from None
    with r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                if choice.get("text") and ttft is None:
                    ttft = time.monotonic() - start
                text.append(choice.get("text") or "")
            if event.get("usage"):
                cached = int((event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
    if ttft is None:
        raise RuntimeError("a completion streamed no text")
    return ttft, "".join(text), cached, prompt_tokens


def _model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def _kv_bytes(url: str) -> float:
    """KV bytes every decode worker received (its llm_kv_transfer_bytes counter)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/v1/workers", timeout=10) as r:
        workers = json.load(r)["data"]
    total = 0.0
    for w in workers:
        if w["role"] != "decode":
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=10) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                total += sum(s.value for s in fam.samples if s.name == "llm_kv_transfer_bytes_total")
    return total


def _kv_bytes_per_token(model: str | None) -> int:
    """The workers' KV bytes per token (their dtype on this host), by `pdserve plan`'s arithmetic."""
    from pdserve.plan import compute_plan

    return compute_plan(harness.model_dir(model), 2**40, 16).kv_bytes_per_token


def run_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every conversation to its end, concurrently; TTFT percentiles, hits, KV bytes."""
    model, before = _model(url), _kv_bytes(url)
    ttfts: list[float] = []
    cached: list[int] = []
    prompts: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def converse(c: int) -> None:
        rng = np.random.default_rng(args.seed * 1000 + c)
        history = f"Conversation {c}."
        try:
            for _ in range(args.turns):
                user = " ".join(rng.choice(WORDS, args.turn_words))
                history += f"\nUser: {user}\nAssistant:"
                ttft, answer, hit, n = _stream(url, model, history, args.output_len)
                history += answer
                with lock:
                    ttfts.append(ttft)
                    cached.append(hit)
                    prompts.append(n)
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=converse, args=(c,)) for c in range(args.conversations)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    ms = np.array(ttfts) * 1000
    return {"ttft_p50_ms": float(np.percentile(ms, 50)), "ttft_p95_ms": float(np.percentile(ms, 95)),
            "requests": len(ttfts), "cached_tokens": int(sum(cached)), "prompt_tokens": int(sum(prompts)),
            "kv_bytes": _kv_bytes(url) - before, "wall_s": time.monotonic() - started}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    runs: list[dict[str, dict[str, Any]]] = []
    kv_per_token = _kv_bytes_per_token(args.model)
    for run in range(args.runs):
        results: dict[str, dict[str, Any]] = {}
        for router in routers:
            up = harness.up_args(args.up_args, args.model) + ["--router", router]
            up += ["--prefill-num-blocks", str(args.prefill_num_blocks)] if args.prefill_num_blocks else []
            with pdserve_up(f"{router}-{run}", up) as server:
                results[router] = run_workload(server.base_url, args)
            r = results[router]
            r["kv_bytes_all_blocks"] = r["prompt_tokens"] * kv_per_token
            print(f"run {run + 1} {router:>12}: TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p95 {r['ttft_p95_ms']:8.1f} ms"
                  f"  cached {r['cached_tokens']:7d} tok  KV {r['kv_bytes'] / 2**20:8.1f} MiB of "
                  f"{r['kv_bytes_all_blocks'] / 2**20:.1f}  wall {r['wall_s']:.1f} s",
                  flush=True)
        runs.append(results)
    if len(routers) >= 2:
        base, other = routers[1], routers[0]
        ratios = [r[base]["ttft_p50_ms"] / r[other]["ttft_p50_ms"] for r in runs]
        median = statistics.median(ratios)
        print(f"TTFT p50 {base}/{other} per run: {', '.join(f'{x:.2f}' for x in ratios)}; median {median:.2f}"
              f" (target >= 3: {'PASS' if median >= 3 else 'MISS'})")
    for router in routers:
        cuts = [1 - r[router]["kv_bytes"] / r[router]["kv_bytes_all_blocks"] for r in runs]
        median = statistics.median(cuts)
        print(f"KV bytes shipped below every block, {router}: {', '.join(f'{x:.0%}' for x in cuts)}; median "
              f"{median:.0%} (target >= 80%: {'PASS' if median >= 0.8 else 'MISS'})")
    harness.write_json(args.output_json, {"args": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
