"""Colocated `pdserve up` beside a busy process: OpenMP wait policy against the thread governor.

For each load (quiet, then one `python3 -c "while True: pass"` spinner beside the
server) and each policy, one colocated `pdserve up` runs bench.vs_vllm's c1 and c16
workloads (500-token prompts, 64 tokens out):

    fixed+spin      --thread-policy fixed, libgomp spinning (up's default when threads fit)
    fixed+passive   --thread-policy fixed, OMP_WAIT_POLICY=PASSIVE in up's environment
    adaptive+spin   --thread-policy adaptive (pdserve/worker/thread_governor.py): spinning, or its
                    low state (N threads, waits throttled: pdserve/worker/spin_throttle.py)

and prints output tok/s per cell, ratios to fixed+spin quiet, the governor's switches
(scraped from the worker's /metrics before the server stops) and the load average.
All cells run back to back in one process, so background load hits them alike.

    .venv/bin/python -m bench.contention --model /tmp/m125

Without --model it builds the ~125M Llama shape (bench.engine.build_125m) in a
temporary directory. Targets: adaptive+spin >= 0.95x fixed+spin quiet (c16), and
>= fixed+passive under the spinner (c1 and c16).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from bench import harness
from bench.vs_vllm import workload_config
from pdserve.loadgen.launch import (
    ServerHandle,
    free_port,
    list_workers,
    pdserve_command,
    serve_command,
)
from pdserve.loadgen.runner import run_benchmark

POLICIES = {  # name -> (--thread-policy, extra environment of `pdserve up`)
    "fixed+spin": ("fixed", {}),
    "fixed+passive": ("fixed", {"OMP_WAIT_POLICY": "PASSIVE"}),
    "adaptive+spin": ("adaptive", {}),
}
LOADS = ("quiet", "spinner")
SPINNER = [sys.executable, "-c", "while True: pass"]


class Cell(NamedTuple):
    load: str
    policy: str
    workload: str
    tok_s: float
    switches: str  # the governor's switch counters at the server's end ('' : none)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help="HF model dir (default: the 125M shape, built in a temp dir)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"from {','.join(POLICIES)}")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"from {','.join(LOADS)}")
    ap.add_argument("--workloads", default="c1,c16")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--c1-requests", type=int, default=4)
    ap.add_argument("--c16-requests", type=int, default=32)
    ap.add_argument("--up-extra", default="", help="flags added to every `pdserve up`")
    args = ap.parse_args(argv)
    for name, allowed in (("policies", POLICIES), ("loads", LOADS)):
        bad = [x for x in getattr(args, name).split(",") if x not in allowed]
        if bad:
            ap.error(f"--{name}: unknown {bad}; choose from {','.join(allowed)}")
    return args


def up_command(policy: str, args: argparse.Namespace, model: str, port: int) -> list[str]:
    """The colocated `pdserve up` of one policy."""
    return [*pdserve_command(), "up", "--colocated", "--model", model, "--dtype", args.dtype,
            "--max-model-len", str(args.max_model_len), "--thread-policy", POLICIES[policy][0],
            *harness.up_args(args.up_extra, None), "--port", str(port)]


@contextmanager
def spinner(on: bool) -> Iterator[None]:
    proc = subprocess.Popen(SPINNER) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def switch_counts(base_url: str) -> str:
    """`reason=count` of every worker's llm_thread_switches_total, from its /metrics."""
    workers = list_workers(base_url)
    out = []
    for w in workers:
        with urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("llm_thread_switches_total{"):
                    reason = line.split('reason="', 1)[1].split('"', 1)[0]
                    out.append(f"{reason}={float(line.rsplit(' ', 1)[1]):g}")
    return " ".join(out)


def run_cells(args: argparse.Namespace, model: str) -> list[Cell]:
    cells = []
    for load in args.loads.split(","):
        for policy in args.policies.split(","):
            port = free_port()
            with spinner(load == "spinner"), \
                    serve_command(policy, up_command(policy, args, model, port), port,
                                  env=POLICIES[policy][1]) as s:
                done = [(w, measure(w, args, s, model)) for w in args.workloads.split(",")]
                switches = switch_counts(s.base_url)
            cells += [Cell(load, policy, w, tok_s, switches) for w, tok_s in done]
            print(f"{load} {policy}: " + ", ".join(f"{w} {t:.1f} tok/s" for w, t in done)
                  + f" (switches: {switches or 'none'}; load {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
    return cells


def measure(workload: str, args: argparse.Namespace, server: ServerHandle, model: str) -> float:
    config = workload_config(workload, args, server.base_url, model)
    run = run_benchmark(config).runs[0]
    return float(run.summary["output_throughput"])


def report(cells: list[Cell]) -> str:
    base = {c.workload: c.tok_s for c in cells if c.load == "quiet" and c.policy == "fixed+spin"}
    lines = ["| load | policy | workload | out tok/s | / fixed+spin quiet | switches |",
             "|---|---|---|---:|---:|---|"]
    for c in cells:
        ratio = f"{c.tok_s / base[c.workload]:.2f}x" if base.get(c.workload) else "-"
        lines.append(f"| {c.load} | {c.policy} | {c.workload} | {c.tok_s:.1f} | {ratio} | {c.switches or '-'} |")
    by = {(c.load, c.policy, c.workload): c.tok_s for c in cells}
    checks = (("quiet", "fixed+spin", 0.95), ("spinner", "fixed+passive", 1.0))
    for w in sorted({c.workload for c in cells}):
        for load, other, bound in checks:
            ours, theirs = by.get((load, "adaptive+spin", w)), by.get((load, other, w))
            if ours is not None and theirs:
                lines.append(f"target {w} {load}: adaptive+spin / {other} {ours / theirs:.2f} (>= {bound})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-contention-") as tmp:
        if args.model:
            model = harness.model_dir(args.model)
        else:
            from bench.engine import build_125m

            model = str(build_125m(Path(tmp)))
        load_before = os.getloadavg()
        cells = run_cells(args, model)
    print(f"{harness.machine_line()}\nmodel {model}, {args.dtype}, colocated up on {len(os.sched_getaffinity(0))} cores; "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(report(cells))
    harness.write_json(args.output_json, {"args": vars(args), "cells": [c._asdict() for c in cells]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

