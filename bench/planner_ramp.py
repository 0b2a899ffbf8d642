"""The P:D planner under a load ramp, on real processes.

A gateway with `--planner flip` and workers (default 1 prefill + 2 decode: with a floor
of one worker per role, 1P+1D can never flip, which `--workers 2` shows) serve three
phases of closed-loop load:

1. prefill-heavy: long unique prompts, 2 output tokens;
2. decode-heavy: short prompts, long outputs (ignore_eos);
3. constant: a steady mix.

It prints, per phase, the flips the gateway completed (`llm_role_flips_total`), the
planner's last pressures, requests sent and failed, and the split at the end. The
issue's target: at most one flip per phase, none under constant load, no failed request.

    python -m bench.planner_ramp --phase-s 60 --concurrency 4
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.e2e.cluster import Cluster, http, metric_value

PHASES = {  # name -> (prompt words, max_tokens, clients per --concurrency)
    "prefill-heavy": (180, 2, 1),
    "decode-heavy": (8, 96, 2),
    "constant": (60, 24, 1),
}
TOKEN = "planner-ramp-admin-token-000000"


def _client(c: Cluster, model: str, words: int, max_tokens: int, stop: threading.Event,
            seed: int, counts: dict[str, int], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = f"{rng.random():.12f} " + " ".join(rng.choice(("alpha", "beta", "gamma", "delta"))
                                                   for _ in range(words))
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        status, out = http("POST", f"{c.url}/v1/completions", body, timeout=300)
        with lock:
            counts["sent"] += 1
            if status != 200:
                counts["failed"] += 1
                counts.setdefault("errors", 0)
                if counts["errors"] < 3:
                    print("  failed:", status, str(out)[:200], flush=True)
                counts["errors"] += 1


def _gateway_metrics(c: Cluster) -> str:
    status, text = http("GET", f"{c.url}/metrics")
    return str(text) if status == 200 else ""


def _gauge(text: str, name: str, role: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels.get("role") == role:
                return float(s.value)
    return None


def run_phase(c: Cluster, model: str, name: str, seconds: float, concurrency: int) -> dict[str, Any]:
    words, max_tokens, scale = PHASES[name]
    concurrency *= scale
    before = metric_value(_gateway_metrics(c), "llm_role_flips_total")
    counts = {"sent": 0, "failed": 0}
    lock, stop = threading.Lock(), threading.Event()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(_client, c, model, words, max_tokens, stop, i * 1000 + len(name), counts, lock)
                   for i in range(concurrency)]
        try:
            time.sleep(seconds)
        finally:  # an interrupt too: the clients must stop before the pool can close
            stop.set()
        for f in futures:
            f.result()
    text = _gateway_metrics(c)
    roles = [w["role"] for w in c.worker_list()]
    return {"phase": name, "flips": metric_value(text, "llm_role_flips_total") - before,
            "sent": counts["sent"], "failed": counts["failed"],
            "pressure_prefill": _gauge(text, "llm_planner_pressure", "prefill"),
            "pressure_decode": _gauge(text, "llm_planner_pressure", "decode"),
            "split": f"{roles.count('prefill')}P+{roles.count('decode')}D"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3, help="1 prefill + the rest decode (>= 2)")
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--slo", default="ttft=1.0,itl=0.025")
    ap.add_argument("--dwell", type=float, default=8.0)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()
    from pdserve.builtin.default_model import default_model_dir

    model = Path(default_model_dir()).name
    c = Cluster(Path(tempfile.mkdtemp(prefix="planner_ramp_")))
    try:
        c.start_gateway("--planner", "flip", "--slo", args.slo, "--planner-dwell", str(args.dwell),
                        "--planner-interval", "1", "--planner-margin", "0.2",
                        env={"PDSERVE_ADMIN_TOKEN": TOKEN})
        c.add_worker("prefill")
        for _ in range(args.workers - 1):
            c.add_worker("decode")
        c.wait_roles(prefill=1, decode=args.workers - 1)
        rows = [run_phase(c, model, name, args.phase_s, args.concurrency) for name in PHASES]
    finally:
        c.stop()
    for r in rows:
        print(json.dumps(r))
    ok = all(r["flips"] <= 1 for r in rows) and rows[-1]["flips"] == 0 and not any(r["failed"] for r in rows)
    print(f"target (<= 1 flip per phase, none under constant load, no failures): {'met' if ok else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
