"""`pdserve plan --simulate PROFILE --workload SPEC --slo ttft=S,itl=S --workers N`:
replay a workload (pdserve/planner/workload.py) through every P:D split of N workers in the
discrete-event simulator (pdserve/planner/simulate.py), with the step times of a
`pdserve profile` file, and print TTFT/ITL p50/p90/p99 and goodput per split and the
recommended split."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdserve.cli.args import UsageError, non_negative_float, non_negative_int, positive_int


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation (--simulate)")
    g.add_argument("--simulate", type=Path, default=None, metavar="PROFILE",
                   help="a `pdserve profile` JSON file: predict each P:D split for --workload")
    g.add_argument("--workload", default=None, metavar="SPEC",
                   help="e.g. rate=4,n=200,prompt=128-512,output=64,arrivals=poisson,seed=0")
    g.add_argument("--slo", default="ttft=1.0,itl=0.1", metavar="SPEC", help="seconds: ttft=S,itl=S")
    g.add_argument("--workers", type=positive_int, default=2, help="workers to split into prefill and decode")
    g.add_argument("--handoff-ms", type=non_negative_float, default=2.0,
                   help="first token on prefill -> KV on the decode worker")
    g.add_argument("--kv-tokens", type=positive_int, default=None,
                   help="KV pool of one decode worker in tokens (default: the profile's)")
    g.add_argument("--gateway-ms", type=non_negative_float, default=0.0,
                   help="the gateway's own time per request (HTTP, tokenizing, routing), counted in TTFT")
    g.add_argument("--local-prefill-threshold", type=non_negative_int, default=0, metavar="TOKENS",
                   help="as the gateway's: requests with at most this many uncached tokens prefill on decode")
    g.add_argument("--cores", type=positive_int, default=None,
                   help="cores the workers share (default: one per worker)")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="the workers run without prefix caching (a workload's prefix= is then recomputed)")


def run_simulate(args: argparse.Namespace) -> int:
    from pdserve.planner.profile import Profile, ProfileError
    from pdserve.planner.simulate import (
        Cluster,
        SimulationError,
        format_results,
        recommend,
        simulate_splits,
    )
    from pdserve.planner.workload import Workload, WorkloadError, parse_workload_slo

    if args.workload is None:
        raise UsageError("--workload", "is required with --simulate")
    if args.workers < 2:
        raise UsageError("--workers", "a P:D split needs at least 2 workers")
    try:
        workload, slo = Workload.parse(args.workload), parse_workload_slo(args.slo)
        profile = Profile.load(args.simulate)
        template = Cluster(1, 1, gateway_s=args.gateway_ms / 1000,
                           local_prefill_threshold=args.local_prefill_threshold, prefix_caching=args.prefix_caching,
                           cores=args.cores)
        results = simulate_splits(profile, args.workers, workload.requests(), slo,
                                  args.handoff_ms / 1000, args.kv_tokens, template)
    except (ProfileError, WorkloadError, SimulationError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 2
    best = recommend(results, slo)
    if args.json:
        print(json.dumps({"workload": workload.spec(), "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
                          "splits": [_split(r) for r in results],
                          "recommended": f"{best.cluster.prefill_workers}:{best.cluster.decode_workers}"}, indent=2))
    else:
        print(f"workload: {workload.spec()}\n{format_results(results, slo)}")
    return 0


def _split(r: Any) -> dict[str, Any]:
    return {"prefill": r.cluster.prefill_workers, "decode": r.cluster.decode_workers,
            "ttft_s": r.ttft._asdict(), "itl_s": r.itl._asdict(), "met": r.met,
            "requests": len(r.requests), "goodput_rps": r.goodput}
