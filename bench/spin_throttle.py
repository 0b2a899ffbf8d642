"""OpenMP wait modes of a 2-thread torch team, with and without one busy process beside it.

Each mode runs in a fresh interpreter (libgomp reads its policy once) doing decode-
shaped bf16 work (16 rows x 768 through 768x3072 matmuls, 24 a step) for `--seconds`:

    spin       libgomp's default (spins ~300,000 times before sleeping)
    passive    OMP_WAIT_POLICY=PASSIVE
    throttled  the default, with pdserve/worker/spin_throttle.py on: a docked helper pool makes
               libgomp's documented "more threads than CPUs" rule throttle the spins
    one        1 thread

Modes take turns per repetition, so background load hits them alike; it prints the
median steps/s and CPU per step of each, and the ratios to passive.

    .venv/bin/python -m bench.spin_throttle --reps 3 --seconds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from bench import harness

MODES = ("spin", "passive", "throttled", "one")
ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys, time
import torch
from pdserve.worker.spin_throttle import SpinThrottle
mode, seconds = sys.argv[1], float(sys.argv[2])
torch.set_num_threads(1 if mode == "one" else 2)
ws = [torch.randn(768, 3072, dtype=torch.bfloat16) for _ in range(2)]
x = torch.randn(16, 768, dtype=torch.bfloat16)
def step():
    for _ in range(12):
        for w in ws:
            (x @ w)[:, :768].contiguous()
if mode == "throttled":
    SpinThrottle().on(2)
for _ in range(10):
    step()
c0, t0, k = os.times(), time.perf_counter(), 0
while time.perf_counter() - t0 < seconds:
    step(); k += 1
c1, dt = os.times(), time.perf_counter() - t0
cpu = (c1.user + c1.system) - (c0.user + c0.system)
print(json.dumps({"steps_s": k / dt, "cpu_ms": 1000 * cpu / k}))
"""


def run_mode(mode: str, seconds: float) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_WAIT_POLICY", None)
    if mode == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(seconds)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--loads", default="quiet,spinner")
    args = ap.parse_args(argv)
    print(f"{harness.machine_line()} at the start, {len(os.sched_getaffinity(0))} cores free to this process")
    print("| load | mode | steps/s | CPU ms/step | / passive |\n|---|---|---:|---:|---:|")
    for load in args.loads.split(","):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "spinner" else None
        try:
            runs = harness.rounds({m: functools.partial(run_mode, m, args.seconds) for m in MODES}, args.reps)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        med = {m: harness.median_of(rs) for m, rs in runs.items()}
        for mode in MODES:
            ratio = med[mode]["steps_s"] / med["passive"]["steps_s"]
            print(f"| {load} | {mode} | {med[mode]['steps_s']:.1f} | {med[mode]['cpu_ms']:.0f} | {ratio:.2f} |")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
