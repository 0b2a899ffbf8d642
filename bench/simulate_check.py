"""The P:D simulator against real processes: predicted vs measured goodput.

    .venv/bin/python -m bench.simulate_check [--profile PROFILE.json] [--splits 1:1,2:1]

Profiles this machine first (`pdserve profile`, one thread, as the workers run) unless
`--profile` is given, then for each split starts `pdserve up --prefill P --decode D
--threads 1` and replays each workload (pdserve/workload.py: the same seeded arrivals
and lengths the simulator sees; prompts are random token ids of exactly the drawn
length, outputs exactly the drawn length with ignore_eos) from one client thread per
request, streaming. Measured TTFT = first streamed text; ITL = (last token - first) /
(output - 1); goodput and percentiles as the simulator computes them
(`pdserve.simulate.summarize`). Target of issue 18: predicted goodput within 20% of
measured for 3 workloads x 2 splits. The simulator gives each worker its own core: on
a machine with fewer free cores than workers + gateway the measurement is slower.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench import harness
from bench.loadgen.launch import pdserve_up
from pdserve.sim_profile import Profile
from pdserve.simulate import Cluster, RequestResult, SimResult, simulate, summarize
from pdserve.workload import SimRequest, Workload, parse_workload_slo

WORKLOADS = (
    "rate=1,n=20,prompt=128-512,output=16,seed=1",  # light, mixed
    "rate=2.5,n=24,prompt=512-1024,output=8,seed=2",  # prefill-heavy
    "rate=2,n=20,prompt=64,output=48-64,seed=3",  # decode-heavy
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--profile", type=Path, default=None, help="a `pdserve profile` file (default: measure now)")
    ap.add_argument("--splits", default="1:1,2:1", help="P:D splits to start, comma-separated")
    ap.add_argument("--workloads", default=";".join(WORKLOADS), help="workload specs, ';'-separated")
    ap.add_argument("--slo", default="ttft=1.5,itl=0.15", help="seconds: ttft=S,itl=S")
    ap.add_argument("--handoff-ms", type=float, default=2.0, help="simulated prefill -> decode handoff")
    return ap.parse_args(argv)


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """One streamed completion: (seconds to the first text, seconds to the last)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    start, first, last = time.monotonic(), None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            if any(c.get("text") for c in json.loads(line[6:]).get("choices") or []):
                last = time.monotonic() - start
                first = last if first is None else first
    if first is None or last is None:
        raise RuntimeError("a completion streamed no text")
    return first, last


def replay(url: str, requests: list[SimRequest], vocab: int, seed: int) -> list[RequestResult]:
    """Each request sent at its arrival time from its own thread."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        model = str(json.load(r)["data"][0]["id"])
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(q.prompt_tokens)] for q in requests]
    results: list[RequestResult | None] = [None] * len(requests)
    errors: list[BaseException] = []
    t0 = time.monotonic() + 0.5

    def one(i: int) -> None:
        q = requests[i]
        time.sleep(max(0.0, t0 + q.arrival - time.monotonic()))
        sent = time.monotonic() - t0
        try:
            first, last = _complete(url, model, prompts[i], q.output_tokens)
        except BaseException as e:  # reported below
            errors.append(e)
            return
        itl = (last - first) / (q.output_tokens - 1) if q.output_tokens > 1 else 0.0
        results[i] = RequestResult(sent, first, itl, sent + last)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def _row(name: str, split: str, pred: SimResult, meas: SimResult) -> dict[str, Any]:
    err = (pred.goodput - meas.goodput) / meas.goodput if meas.goodput else float("inf")
    print(f"{name:>14} {split:>4}  goodput pred {pred.goodput:6.3f} meas {meas.goodput:6.3f} ({err:+6.1%})"
          f"  met {pred.met:>2}/{meas.met:<2}  TTFT p50 {pred.ttft.p50 * 1e3:6.0f}/{meas.ttft.p50 * 1e3:<6.0f} ms"
          f"  p90 {pred.ttft.p90 * 1e3:6.0f}/{meas.ttft.p90 * 1e3:<6.0f} ms"
          f"  ITL p50 {pred.itl.p50 * 1e3:5.0f}/{meas.itl.p50 * 1e3:<5.0f} ms", flush=True)
    return {"workload": name, "split": split, "goodput_pred": pred.goodput, "goodput_meas": meas.goodput,
            "error": err, "met_pred": pred.met, "met_meas": meas.met,
            "ttft_pred": pred.ttft._asdict(), "ttft_meas": meas.ttft._asdict(),
            "itl_pred": pred.itl._asdict(), "itl_meas": meas.itl._asdict()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = harness.model_dir(args.model)
    if args.profile is not None:
        profile = Profile.load(args.profile)
    else:
        from pdserve.hw_profile import ProfileConfig, measure

        profile = measure(ProfileConfig(model, threads=1), progress=lambda s: print(s, file=sys.stderr))
    from pdserve.plan import read_model_config

    vocab = read_model_config(Path(model)).vocab_size
    slo = parse_workload_slo(args.slo)
    workloads = [Workload.parse(w) for w in args.workloads.split(";") if w.strip()]
    rows = []
    for split in args.splits.split(","):
        p, d = (int(x) for x in split.split(":"))
        cluster = Cluster(p, d, args.handoff_ms / 1000)
        up = harness.up_args(f"--prefill {p} --decode {d} --threads 1 --no-prefix-caching", args.model)
        with pdserve_up(f"sim-{p}p{d}d", up) as server:
            for i, w in enumerate(workloads):
                requests = w.requests()
                measured = summarize(cluster, replay(server.base_url, requests, vocab, w.seed), slo)
                rows.append(_row(f"workload {i + 1}", split, simulate(profile, cluster, requests, slo), measured))
    within = sum(abs(r["error"]) <= 0.2 for r in rows)
    print(f"goodput within 20%: {within}/{len(rows)} (target: all)")
    harness.write_json(args.output_json, {"args": {k: str(v) for k, v in vars(args).items()},
                                          "profile": profile.to_dict(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
