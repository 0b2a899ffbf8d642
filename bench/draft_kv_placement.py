"""Where the draft model's prompt KV is made, 1P+1D: the decode worker (draft_kv=decode)
or the prefill worker, which ships it with the target's (draft_kv=prefill); same run.

    .venv/bin/python -m bench.draft_kv_placement [--rounds 3] [--duration 40]
        [--streams 4] [--long-prompt-len 512] [--interval 2] [--model DIR --draft DIR]

The mixed workload of bench/disagg_vs_colocated.py: `--streams` decode streams (short
prompts, long outputs) run while a long prompt arrives every `--interval` seconds. With
draft_kv=decode each arriving prompt's draft prefill runs inside a decode step and
stalls the OTHER streams; with draft_kv=prefill the prefill worker runs it, and its KV
travels. Both placements speculate with the same draft (default: the trained built-in
model with its trained draft, K=3, drafting at every batch size here).

Per round (placements alternate which goes first) and as medians over rounds: decode
streams' ITL p50/p99, long prompts' TTFT p50, KV bytes the prefill worker shipped per
prompt token it computed (target and draft KV), its CPU seconds per prompt (its busy
time: the worker process's user + system time over the run), tokens the decode
worker's draft prefilled, and the mean acceptance length; then prefill/decode ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
from typing import Any

from bench import harness
from bench.disagg_vs_colocated import bench_config
from pdserve.loadgen.compare import Column, format_comparison
from pdserve.loadgen.launch import list_workers, pdserve_up
from pdserve.loadgen.runner import run_benchmark

PLACEMENTS = ("decode", "prefill")
COLUMNS = (
    Column("ITL p50 ms", ("decode", "itl", "p50")),
    Column("ITL p99 ms", ("decode", "itl", "p99")),
    Column("TTFT p50 ms", ("long_prompt", "ttft", "p50")),
    Column("KV B/token", ("worker", "kv_bytes_per_token"), scale=1, fmt=".0f"),
    Column("prefill CPU s", ("worker", "prefill_cpu_s_per_prompt"), scale=1, fmt=".3f"),
    Column("draft pf tok", ("worker", "draft_prefill_tokens"), scale=1, fmt=".0f"),
    Column("accept len", ("worker", "mean_acceptance_length"), scale=1, fmt=".2f"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help="target model dir (default: the built-in)", tokenizer=True)
    ap.add_argument("--draft", default=None, help="draft model dir (default: the built-in draft)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=40.0, help="seconds per placement per round")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-input", type=int, default=32)
    ap.add_argument("--stream-output", type=int, default=128)
    ap.add_argument("--long-prompt-len", type=int, default=512)
    ap.add_argument("--long-prompt-output", type=int, default=8)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--slo", default="ttft=5,tpot=0.2")
    ap.add_argument("--up-extra", default="", help="flags added to both `pdserve up` commands")
    return ap.parse_args(argv)


def spec_json(args: argparse.Namespace, placement: str) -> str:
    if args.draft is None:
        from pdserve.builtin.default_model import draft_model_dir

        args.draft = str(draft_model_dir())
    return json.dumps({"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k,
                       "disable_by_batch_size": 64, "draft_kv": placement})


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _metric(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_counters(base_url: str) -> dict[str, float]:
    """The counters this bench reads from the prefill and decode workers."""
    workers = {w["role"]: w for w in list_workers(base_url)}
    pre = _get(f"http://127.0.0.1:{workers['prefill']['metrics_port']}/metrics")
    dec = _get(f"http://127.0.0.1:{workers['decode']['metrics_port']}/metrics")
    return {"kv_bytes": _metric(pre, "llm_kv_transfer_bytes_total"),
            "prefill_cpu_s": _cpu_s(int(workers["prefill"]["pid"])),
            "prompts": _metric(pre, "llm_prefill_requests_total"),
            "prompt_tokens": _metric(pre, "llm_prefill_tokens_total"),
            "draft_prefill_tokens": _metric(dec, "llm_spec_draft_prefill_tokens_total"),
            "drafts": _metric(dec, "llm_spec_decode_num_drafts_total"),
            "accepted": _metric(dec, "llm_spec_decode_num_accepted_tokens_total")}


def run_placement(args: argparse.Namespace, placement: str, tokenizer: str | None) -> dict[str, Any]:
    up = ["--prefill", "1", "--decode", "1", "--speculative-config", spec_json(args, placement),
          *harness.up_args(args.up_extra, args.model)]
    with pdserve_up(f"draft-kv-{placement}", up) as server:
        before = worker_counters(server.base_url)
        run = run_benchmark(bench_config(args, server.base_url, tokenizer)).runs[0]
        after = worker_counters(server.base_url)
    d = {k: after[k] - before[k] for k in after}
    prompts = max(d["prompts"], 1.0)
    worker = {"kv_bytes_per_token": d["kv_bytes"] / max(d["prompt_tokens"], 1.0),
              "prefill_cpu_s_per_prompt": d["prefill_cpu_s"] / prompts,
              "draft_prefill_tokens": d["draft_prefill_tokens"],
              "mean_acceptance_length": 1 + d["accepted"] / d["drafts"] if d["drafts"] else 1.0}
    return {"all": run.summary, **run.per_tag, "worker": worker}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = harness.tokenizer_dir(args)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in PLACEMENTS}
    for r in range(args.rounds):
        order = PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]
        for placement in order:
            runs[placement].append(run_placement(args, placement, tokenizer))
        print(f"\n## round {r + 1} ({' then '.join(order)})")
        print(format_comparison(COLUMNS, [(p, runs[p][-1]) for p in PLACEMENTS],
                                [("prefill/decode", "prefill", "decode")]), flush=True)
    print(f"\n{harness.machine_line()}\n## medians of {args.rounds} rounds: draft KV made on the decode vs the prefill worker")
    medians = {p: harness.median_summary(runs[p], COLUMNS) for p in PLACEMENTS}
    print(format_comparison(COLUMNS, [(p, medians[p]) for p in PLACEMENTS],
                            [("prefill/decode", "prefill", "decode")]))
    harness.write_json(args.output_json, {"args": vars(args), "medians": medians, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
