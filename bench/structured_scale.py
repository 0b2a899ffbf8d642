"""Structured outputs at scale: N seeded json_schema requests, valid and identical in every mode.

    .venv/bin/python -m bench.structured_scale --num-requests 200 --concurrency 8

Each mode starts its own real-process cluster (tests/e2e/cluster.py: a gateway and
`pdserve` workers on free loopback ports, float32) and streams the same N requests
through the official `openai` client, `--concurrency` at a time:

- colocated: one colocated worker (the baseline the other modes are compared with);
- 1p1d: one prefill and one decode worker;
- 1p1d-kill: one prefill and two decode workers; the one every request is routed to
  (4x the KV of the other, slowed by fault injection) is killed with SIGKILL once
  `--kill-after` requests have finished and streams are mid-way; the gateway resumes
  the cut streams on the survivor by re-prefill and grammar replay;
- spec: one prefill and one decode worker drafting with n-gram speculation.

The requests vary their schema (four, each bounding its strings and arrays so even
random weights end inside max_tokens) and prompt, with seeds 1000 + i and temperature
1.0. Every output must finish with `stop` and pass `json.loads` + `jsonschema.validate`
against its schema; its tokens (the per-token strings of `logprobs`) and text must equal
the colocated mode's. Prints a table; exits 1 if anything failed.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, NamedTuple

from bench import harness

MODES = ("colocated", "1p1d", "1p1d-kill", "spec")
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["ok", "color", "name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "rain": {"type": "boolean"}},
     "required": ["city", "days", "rain"], "additionalProperties": False},
    {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{3}$"},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                   "minItems": 1, "maxItems": 4}},
     "required": ["id", "scores"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "first": {"type": "string", "maxLength": 5}, "admin": {"type": "boolean"}},
            "required": ["first", "admin"], "additionalProperties": False},
        "level": {"enum": ["low", "mid", "high"]}},
     "required": ["user", "level"], "additionalProperties": False},
]
PROMPTS = ("Record", "Give me JSON for", "Describe item", "Output:", "The weather object is")
MAX_TOKENS = 160
KILL_CHUNKS = 3  # chunks a stream has received before the kill (so it is cut mid-way)


class Outcome(NamedTuple):
    """One request's result in one mode."""

    tokens: tuple[str, ...]
    text: str
    finish: str | None
    error: str | None


class ModeResult(NamedTuple):
    mode: str
    outcomes: list[Outcome]
    wall_s: float
    interrupted: int  # streams in flight when the decode worker was killed
    spec: str  # accepted / draft tokens of the decode worker ("" without speculation)


def request_body(i: int, model: str) -> dict[str, Any]:
    schema = SCHEMAS[i % len(SCHEMAS)]
    return {"model": model, "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}:", "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 1000 + i, "logprobs": 1,
            "extra_body": {"structured_outputs": {"json": schema}}}


def stream_one(client: Any, body: dict[str, Any], on_chunk: Callable[[int], None]) -> Outcome:
    """Stream one completion; `on_chunk(k)` after the k-th chunk."""
    tokens: list[str] = []
    text: list[str] = []
    finish = None
    try:
        for k, chunk in enumerate(client.completions.create(stream=True, **body), 1):
            for ch in chunk.choices:
                text.append(ch.text)
                if ch.logprobs is not None:
                    tokens += ch.logprobs.tokens or []
                finish = ch.finish_reason or finish
            on_chunk(k)
    except Exception as e:  # reported per request in the table
        return Outcome(tuple(tokens), "".join(text), finish, f"{type(e).__name__}: {str(e)[:200]}")
    return Outcome(tuple(tokens), "".join(text), finish, None)


def start_cluster(mode: str, log_dir: Path, worker_extra: list[str]) -> tuple[Any, Any]:
    """The mode's cluster, and the decode worker to kill (1p1d-kill) or None."""
    from tests.e2e.cluster import Cluster

    c = Cluster(log_dir)
    victim = None
    try:
        c.start_gateway("--heartbeat-timeout", "1.5")
        if mode == "colocated":
            c.add_worker("worker", *worker_extra)
            c.wait_roles(colocated=1)
            return c, None
        c.add_worker("prefill", *worker_extra)
        if mode == "1p1d-kill":
            victim = c.add_worker("decode", *worker_extra, "--num-blocks", "1024", "--enable-fault-injection",
                                  env={"PDSERVE_FAULTS": "step_delay_s=0.05"})
            c.add_worker("decode", *worker_extra)
            c.wait_roles(prefill=1, decode=2)
        else:
            spec = ["--speculative-config", NGRAM] if mode == "spec" else []
            c.add_worker("decode", *worker_extra, *spec)
            c.wait_roles(prefill=1, decode=1)
    except BaseException:
        c.stop()
        raise
    return c, victim


def run_mode(mode: str, n: int, concurrency: int, kill_after: int, model: str, worker_extra: list[str],
             log_dir: Path) -> ModeResult:
    import openai

    from tests.e2e.cluster import metric_value, worker_metrics

    (log_dir / mode).mkdir(parents=True, exist_ok=True)
    c, victim = start_cluster(mode, log_dir / mode, worker_extra)
    try:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=300)
        lock, kill_now = threading.Lock(), threading.Event()
        done = [0]
        in_flight: set[int] = set()

        def one(i: int) -> Outcome:
            def on_chunk(k: int) -> None:
                if k == KILL_CHUNKS and victim is not None:
                    with lock:
                        if done[0] >= kill_after:
                            kill_now.set()

            with lock:
                in_flight.add(i)
            out = stream_one(client, request_body(i, model), on_chunk)
            with lock:
                in_flight.discard(i)
                done[0] += 1
            return out

        watch, interrupted = harness.Stopwatch(), 0
        with ThreadPoolExecutor(concurrency) as pool:
            futures = [pool.submit(one, i) for i in range(n)]
            if victim is not None:
                while not kill_now.wait(0.2):
                    if all(f.done() for f in futures):
                        break  # never killed: interrupted stays 0, which fails the mode
                with lock:
                    interrupted = len(in_flight)
                    if interrupted:
                        victim.signal(signal.SIGKILL)
            outcomes = [f.result() for f in futures]
        wall = watch.lap()
        spec = ""
        if mode == "spec":
            text = worker_metrics(next(w for w in c.worker_list() if w["role"] == "decode"))
            spec = (f"{metric_value(text, 'llm_spec_decode_num_accepted_tokens_total'):.0f}/"
                    f"{metric_value(text, 'llm_spec_decode_num_draft_tokens_total'):.0f}")
        c.wait_idle(timeout=60)
        return ModeResult(mode, outcomes, wall, interrupted, spec)
    finally:
        c.stop()


def failures(result: ModeResult, baseline: ModeResult | None, n: int) -> tuple[int, int, list[str]]:
    """(valid, identical, problems) of one mode: every output a complete, valid match of
    its schema; identical: tokens and text equal the baseline's."""
    import jsonschema

    valid = identical = 0
    problems = []
    for i, out in enumerate(result.outcomes):
        try:
            if out.error is not None:
                raise ValueError(out.error)
            if out.finish != "stop":
                raise ValueError(f"finish_reason {out.finish!r}")
            jsonschema.validate(json.loads(out.text), SCHEMAS[i % len(SCHEMAS)])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append(f"{result.mode} #{i}: invalid ({str(e)[:160]}): {out.text[:80]!r}")
        ref = baseline.outcomes[i] if baseline is not None else out
        if (out.tokens, out.text) == (ref.tokens, ref.text) and out.tokens:
            identical += 1
        else:
            problems.append(f"{result.mode} #{i}: differs from {baseline.mode if baseline else 'itself'}")
    return valid, identical, problems


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kill-after", type=int, default=16, help="requests finished before the kill (1p1d-kill)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--log-dir", default=None, help="keep the processes' logs here (default: a temporary dir)")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if unknown := sorted(set(modes) - set(MODES)):
        ap.error(f"unknown mode {unknown[0]!r}")
    worker_extra = ["--model", args.model] if args.model else []
    model = Path(harness.model_dir(args.model)).name
    with TemporaryDirectory(prefix="structured-scale-") as tmp:
        log_dir = Path(args.log_dir or tmp)
        results = [run_mode(m, args.num_requests, args.concurrency, args.kill_after, model, worker_extra, log_dir)
                   for m in modes]
    baseline = results[0]
    print(f"{harness.machine_line()}\n{args.num_requests} seeded json_schema requests, concurrency {args.concurrency}, "
          f"identity against {baseline.mode}")
    print(f"{'mode':10s} {'valid':>9s} {'identical':>9s} {'cut':>4s} {'wall s':>7s} {'tok/s':>6s}  spec acc/draft")
    problems: list[str] = []
    rows = []
    for r in results:
        valid, same, bad = failures(r, None if r is baseline else baseline, args.num_requests)
        problems += bad
        toks = sum(len(o.tokens) for o in r.outcomes)
        print(f"{r.mode:10s} {valid:>5d}/{args.num_requests:<3d} {same:>5d}/{args.num_requests:<3d} "
              f"{r.interrupted:>4d} {r.wall_s:>7.1f} {toks / r.wall_s:>6.1f}  {r.spec}")
        rows.append({"mode": r.mode, "valid": valid, "identical": same, "interrupted": r.interrupted,
                     "wall_s": r.wall_s, "tokens": toks, "spec": r.spec})
    for p in problems[:20]:
        print("FAIL", p)
    ok = not problems and all(r.interrupted > 0 for r in results if r.mode == "1p1d-kill")
    print("all valid and identical" if ok else f"{len(problems)} problems")
    harness.write_json(args.output_json, {"num_requests": args.num_requests, "concurrency": args.concurrency,
                                          "modes": rows, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
