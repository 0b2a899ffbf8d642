"""Multi-turn chat: TTFT and KV bytes shipped with KV-aware vs round-robin routing.

    .venv/bin/python -m bench.multiturn --runs 3

`--conversations` conversations (16, run concurrently, one client each) of `--turns`
turns (6) in the shape `--shape` names (bench/multiturn_workload.py): `chat` (default),
a ~1,000-token system prompt every conversation shares, a ~300-token document of its
own, then per turn a ~70-token user message and the answer (`--output-len` 32 tokens,
greedy, ignore_eos), growing to ~1,950 tokens at the sixth turn; `private`, no shared
prompt: each conversation's own ~1,300-token opening, then ~85-token user messages, to
~1,950 tokens at the sixth turn (the issue's shape; measured with `--model shape:125m`,
bench/models.py); `legacy`, the earlier shape with no shared prefix and ~180-token user
messages. Turn i sends everything so
far (the answers as the server gave them). Before each measured workload the system
prompt is sent once per prefill worker, at once (both routers then warm every worker),
as in a deployment where it is always hot.

Pools: `--prefill-num-blocks` / `--decode-num-blocks` (0: sized from the workload by
`size_pools`, the arithmetic printed at the start): each prefill worker holds its
kv-aware share (the system prompt + half the conversations) but not what round-robin
spreads onto it (every conversation), and the decode worker holds every conversation
to its end, so suffix-only handoff always finds the history. Every configuration
(`--up-args` + `--router R` for each of `--routers`) starts fresh per run; runs
alternate the routers, ratios are taken within a run, the median over runs reported.

Prints per run and router: TTFT p50/p95, cached tokens, the turns that found their
previous turn cached (client side) and the gateway's routing decisions by reason, KV
bytes the decode worker received; then a VERDICT line per target of issue 18 (TTFT p50
round-robin / kv-aware >= 3; KV bytes >= 80% below shipping every prompt block; the
answers identical between the routers, token for token, greedy).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request
from typing import Any

import numpy as np

from bench import client, harness
from bench.multiturn_workload import (
    SHAPES,
    ChatShape,
    Pools,
    differing,
    history_hits,
    size_pools,
)
from pdserve.loadgen.launch import list_workers, pdserve_up


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--shape", choices=SHAPES, default="chat")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-words", type=int, default=0, help="words per user message (0: the shape's)")
    ap.add_argument("--think-s", type=float, default=None,
                    help="mean seconds a user thinks before each turn (default: the shape's; private 2, others 0)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--routers", default="kv-aware,round-robin")
    ap.add_argument("--up-args", default="--prefill 2 --decode 1 --dtype float32",
                    help="float32: greedy output is the same token for token whatever the batch or "
                    "cache hit (bf16 may part at a near-tie), so the routers' answers compare exactly")
    ap.add_argument("--prefill-num-blocks", type=int, default=0, help="KV blocks per prefill worker (0: sized)")
    ap.add_argument("--decode-num-blocks", type=int, default=0, help="KV blocks of the decode worker (0: sized)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def shape_of(args: argparse.Namespace) -> ChatShape:
    return ChatShape.of(args.shape, args.conversations, args.turns, args.output_len, args.seed,
                        args.turn_words or None, args.think_s)


def _samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample called `name` on a Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return [(dict(s.labels), s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def _kv_bytes(url: str) -> float:
    """KV bytes every decode worker received (its llm_kv_transfer_bytes counter)."""
    workers = list_workers(url)
    return sum(v for w in workers if w["role"] == "decode"
               for _, v in _samples(f"http://127.0.0.1:{w['metrics_port']}/metrics", "llm_kv_transfer_bytes_total"))


def _decisions(url: str) -> dict[str, int]:
    """The gateway's routing decisions by reason (llm_routing_decisions)."""
    return {labels["reason"]: int(v) for labels, v in _samples(f"{url}/metrics", "llm_routing_decisions")}


def converse(url: str, model: str, shape: ChatShape) -> dict[str, Any]:
    """Every conversation to its end, concurrently: per-turn TTFT, cached and prompt
    tokens, and each answer's text keyed "conversation/turn"."""
    ttfts: list[float] = []
    texts: dict[str, str] = {}
    per_conv: dict[int, tuple[list[int], list[int]]] = {}
    lock = threading.Lock()

    def one(c: int) -> None:
        history = shape.system_prompt() + shape.opening(c)
        prompts: list[int] = []
        cached: list[int] = []
        for t, (user, think) in enumerate(zip(shape.user_messages(c), shape.think_times(c), strict=True)):
            time.sleep(think)  # the user reading and typing: the workload's arrival pattern
            history += shape.turn_text(user)
            got = client.stream_completion(url, model, history, shape.output_len)
            history += got.text
            prompts.append(int(got.usage.get("prompt_tokens") or 0))
            cached.append(int((got.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
            with lock:
                ttfts.append(got.first_s)
                texts[f"{c}/{t}"] = got.text
        with lock:
            per_conv[c] = (prompts, cached)

    client.at_once(one, range(shape.conversations))
    hits = [history_hits(p, c) for p, c in per_conv.values()]
    ms = np.array(ttfts) * 1000
    return {"ttft_p50_ms": float(np.percentile(ms, 50)), "ttft_p95_ms": float(np.percentile(ms, 95)),
            "requests": len(ttfts), "texts": texts,
            "cached_tokens": sum(sum(c) for _, c in per_conv.values()),
            "prompt_tokens": sum(sum(p) for p, _ in per_conv.values()),
            "history_hits": sum(h for h, _ in hits), "later_turns": sum(n for _, n in hits),
            "max_prompt_tokens": max(max(p) for p, _ in per_conv.values())}


def run_workload(url: str, shape: ChatShape, warmups: int) -> dict[str, Any]:
    """Warm the system prompt (`warmups` requests at once: one per prefill worker, under
    either router), then every conversation; with the server's counters."""
    model = client.served_model(url)
    if shape.system_prompt():
        client.at_once(lambda _: client.stream_completion(url, model, shape.system_prompt() + "User:", 1),
                       range(warmups))
    before, decided = _kv_bytes(url), _decisions(url)
    watch = harness.Stopwatch()
    out = converse(url, model, shape)
    out["wall_s"] = watch.lap()
    out["kv_bytes"] = _kv_bytes(url) - before
    out["decisions"] = {k: v - decided.get(k, 0) for k, v in _decisions(url).items() if v - decided.get(k, 0)}
    return out


def _kv_bytes_per_token(model: str | None, up_args: str) -> int:
    """The workers' KV bytes per token (the `--dtype` of `up_args`, else theirs on this
    host), by `pdserve plan`'s arithmetic."""
    from pdserve.planner.capacity import compute_plan

    words = harness.up_args(up_args, None)
    dtype = words[words.index("--dtype") + 1] if "--dtype" in words else "auto"
    return compute_plan(harness.model_dir(model), 2**40, 16, dtype=dtype).kv_bytes_per_token


def prefill_workers(up_args: str) -> int:
    """The `--prefill N` of `pdserve up` arguments (its default: 1)."""
    words = harness.up_args(up_args, None)
    return int(words[words.index("--prefill") + 1]) if "--prefill" in words else 1


def pools_for(args: argparse.Namespace, shape: ChatShape) -> Pools:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(harness.model_dir(args.model), "tokenizer.json"))
    return size_pools(shape, lambda s: len(tok.encode(s, add_special_tokens=False).ids), prefill_workers(args.up_args))


def report(runs: list[dict[str, dict[str, Any]]], routers: list[str]) -> list[str]:
    """The VERDICT lines of issue 18's multi-turn target."""
    lines = []
    if len(routers) >= 2:
        fast, base = routers[0], routers[1]
        ratios = [r[base]["ttft_p50_ms"] / r[fast]["ttft_p50_ms"] for r in runs]
        lines.append(harness.verdict(f"TTFT p50 {base} / {fast}", ratios, ">= 3", lambda m: m >= 3))
        diffs = [len(differing(r[fast]["texts"], r[base]["texts"])) for r in runs]
        total = sum(r[fast]["requests"] for r in runs)
        lines.append(f"VERDICT answers identical ({fast} vs {base}): {total - sum(diffs)}/{total} turns "
                     f"(differing per run: {diffs}): {'PASS' if not any(diffs) else 'MISS'}")
    for router in routers:
        cuts = [1 - r[router]["kv_bytes"] / r[router]["kv_bytes_all_blocks"] for r in runs]
        lines.append(harness.verdict(f"KV bytes shipped below every prompt block, {router}", cuts, ">= 80%",
                             lambda m: m >= 0.8, "{:.0%}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = shape_of(args)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    pools = pools_for(args, shape)
    prefill_blocks = args.prefill_num_blocks or pools.prefill_blocks
    decode_blocks = args.decode_num_blocks or pools.decode_blocks
    print(pools.describe(prefill_workers(args.up_args)), flush=True)
    kv_per_token = _kv_bytes_per_token(args.model, args.up_args)
    runs: list[dict[str, dict[str, Any]]] = []
    failed: list[str] = []
    for run in range(args.runs):
        results: dict[str, dict[str, Any]] = {}
        for router in routers:
            up = harness.up_args(args.up_args, args.model) + ["--router", router]
            up += ["--num-blocks", str(decode_blocks), "--prefill-num-blocks", str(prefill_blocks)]
            try:
                with pdserve_up(f"{router}-{run}", up) as server:
                    r = results[router] = run_workload(server.base_url, shape, prefill_workers(args.up_args))
            except RuntimeError as e:  # a request the server failed: this run compares nothing
                failed.append(f"run {run + 1} {router}: {e}")
                print(f"run {run + 1} {router:>12}: FAILED ({e}); the run is left out", flush=True)
                break
            r["kv_bytes_all_blocks"] = r["prompt_tokens"] * kv_per_token
            print(f"run {run + 1} {router:>12}: TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p95 {r['ttft_p95_ms']:8.1f} ms"
                  f"  cached {r['cached_tokens']:7d} of {r['prompt_tokens']} tok  history cached "
                  f"{r['history_hits']}/{r['later_turns']} turns  longest prompt {r['max_prompt_tokens']}  KV "
                  f"{r['kv_bytes'] / 2**20:7.1f} MiB of {r['kv_bytes_all_blocks'] / 2**20:.1f}  wall "
                  f"{r['wall_s']:.1f} s  decisions {r['decisions']}  load {os.getloadavg()[0]:.1f}", flush=True)
        else:
            runs.append(results)
    print(f"{harness.machine_line()}; runs compared {len(runs)} of {args.runs}")
    for line in report(runs, routers):
        print(line)
    harness.write_json(args.output_json, {"args": vars(args), "pools": vars(pools), "runs": runs, "failed": failed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
