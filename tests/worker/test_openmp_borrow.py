"""A decode worker that borrows cores loads OpenMP with them in its mask
(worker/cpu_cores.py, `pin_at_start`): libgomp counts the mask's cores once, at load,
and a team larger than that count barely spins before it sleeps, so a borrower that
loaded torch on its one own core ran its 2-thread team as if passive (a futex wake-up
per parallel region). Checked in a fresh process, the way a worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Start as a borrower: own core A, borrowable core B; then widen to both (as
# worker/core_sharing.py does) and run parallel regions separated by serial Python
# work. A spinning team's second thread burns CPU through the serial gaps; a thread
# that sleeps at once uses almost none. CPU ticks, not wall time: load shifts both alike.
SCRIPT = """
import json, os, sys, time
from worker.cpu_cores import CoreGrant, apply_grant, pin_at_start, pin_process
own, borrow = [int(sys.argv[2])], [int(sys.argv[3])]
pin_at_start(own, borrow) if sys.argv[1] == "pin_at_start" else pin_process(own)
import torch
apply_grant(CoreGrant((*own, *borrow), 2))
x = torch.randn(1 << 16)
def ticks():
    out = {}
    for t in os.listdir("/proc/self/task"):
        f = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
        out[int(t)] = int(f[11]) + int(f[12])
    return out
(x * 2).sum()
before, end = ticks(), time.process_time() + 0.3
while time.process_time() < end:  # the main thread's own CPU time: waits for it, not a clock
    (x * 2).sum()
    gap = time.perf_counter() + 0.0003
    while time.perf_counter() < gap:
        pass
after = ticks()
main = after.pop(os.getpid()) - before[os.getpid()]
helper = max(v - before.get(t, 0) for t, v in after.items())
print(json.dumps({"main": main, "helper": helper}))
"""


def _helper_share(how: str, own: int, borrow: int) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}  # libgomp's default: spin
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT, how, str(own), str(borrow)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    t = json.loads(out.stdout.strip().splitlines()[-1])
    return float(t["helper"]) / max(float(t["main"]), 1.0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="borrowing needs two cores")
def test_a_borrowers_widened_team_spins_like_a_team_that_started_wide() -> None:
    own, borrow = sorted(os.sched_getaffinity(0))[:2]
    share = _helper_share("pin_at_start", own, borrow)
    assert share > 0.5, f"the borrowed core's thread used {share:.0%} of the main thread's CPU: it sleeps"
