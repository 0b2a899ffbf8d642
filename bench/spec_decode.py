"""Speculative decoding: engine decode tokens/s with speculation off vs on, same run.

    .venv/bin/python -m bench.spec_decode [--model DIR] [--concurrency 1,16] [--rounds 3]
        [--speculative-config JSON] [--workload repeat|random] [--threads N]

Two engines over the same weights, one without and one with `--speculative-config`
(default: n-gram, K=4, lookup 1..3). Each round runs the same C requests on each,
off first, then on (fresh prompts every round, so no prefix-cache hit); the decode
rate counts tokens after each request's first, over the window after every prompt
is prefilled. Prints each round's ratio on/off and the median over rounds, with the
mean acceptance length of the on runs. Outputs are checked identical (greedy).

`repeat` prompts are a random segment said twice (summarize-and-quote, code edit:
text the output can copy); `random` prompts never repeat.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

from bench import harness
from common.sampling_params import SamplingParams

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@dataclass(frozen=True)
class Run:
    tokens_per_s: float
    outputs: list[tuple[int, ...]]
    drafts: int
    accepted: int


def prompts(workload: str, n: int, length: int, salt: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(salt)
    out = []
    for _ in range(n):
        if workload == "repeat":
            seg = [rng.randrange(5, vocab) for _ in range(length // 2)]
            out.append(seg + seg)
        else:
            out.append([rng.randrange(5, vocab) for _ in range(length)])
    return out


def build(model: str, threads: int, dtype: str, spec: Any) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=harness.model_dir(model), dtype=dtype, num_threads=threads,
                                  speculative=spec))


def decode_run(engine: Any, batch: list[list[int]], output_len: int) -> Run:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    before = engine.stats().spec
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(batch))]
    for rid, prompt in zip(ids, batch, strict=True):
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    started: set[str] = set()
    while len(started) < len(ids):  # prefill every prompt first
        for o in engine.step():
            outputs[o.request_id].extend(t for c in o.outputs for t in c.token_ids)
            started.add(o.request_id)
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            new = [t for c in o.outputs for t in c.token_ids]
            outputs[o.request_id].extend(new)
            tokens += len(new)
    elapsed = time.perf_counter() - t0
    after = engine.stats().spec
    drafts = (after.num_drafts - before.num_drafts) if after is not None else 0
    accepted = (after.num_accepted_tokens - before.num_accepted_tokens) if after is not None else 0
    return Run(tokens / elapsed, [tuple(outputs[r]) for r in ids], drafts, accepted)


def main() -> int:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--workload", choices=("repeat", "random"), default="repeat")
    ap.add_argument("--speculative-config", default=NGRAM)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from engine.spec.config import SpeculativeConfig

    spec = SpeculativeConfig.from_json(args.speculative_config)
    off = build(args.model, args.threads, args.dtype, None)
    on = build(args.model, args.threads, args.dtype, spec)
    vocab = min(on.vocab_size, 2000)
    warm = prompts(args.workload, 1, args.prompt_len, 999, vocab)
    decode_run(off, warm, 8)
    decode_run(on, warm, 8)
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "output_json"}, "runs": []}
    print(f"speculative config: {spec.to_json()}  workload {args.workload}, prompt {args.prompt_len}, "
          f"output {args.output_len}, {args.threads} threads, dtype {on.runner.dtype}")
    for c in (int(x) for x in args.concurrency.split(",")):
        ratios, lengths = [], []
        for r in range(args.rounds):
            batch = prompts(args.workload, c, args.prompt_len, 1000 * c + r, vocab)
            a, b = decode_run(off, batch, args.output_len), decode_run(on, batch, args.output_len)
            same = a.outputs == b.outputs
            mal = 1 + b.accepted / b.drafts if b.drafts else 1.0
            ratios.append(b.tokens_per_s / a.tokens_per_s)
            lengths.append(mal)
            print(f"C={c} round {r + 1}: off {a.tokens_per_s:.1f} tok/s, on {b.tokens_per_s:.1f} tok/s, "
                  f"ratio {ratios[-1]:.2f}, mean acceptance length {mal:.2f} ({b.drafts} drafts), "
                  f"outputs {'identical' if same else 'DIFFER'}")
            result["runs"].append(replace(a, outputs=[]).__dict__ | {"concurrency": c, "round": r, "spec": False})
            result["runs"].append(replace(b, outputs=[]).__dict__ | {"concurrency": c, "round": r, "spec": True,
                                                                     "identical": same})
        print(f"C={c}: median ratio on/off {statistics.median(ratios):.2f} over {args.rounds} rounds, "
              f"median mean acceptance length {statistics.median(lengths):.2f}")
    harness.write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
