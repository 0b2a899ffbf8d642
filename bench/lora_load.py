"""A LoRA adapter loaded at run time against running streams: their ITL p99 with and
without the load, in one run.

    .venv/bin/python -m bench.lora_load [--model DIR|shape:NAME] [--streams 16] [--adapters 4]
        [--rank 16] [--load-rank R] [--loads 3] [--output-len 48] [--rounds 3] [--threads N]

A real colocated node (pdserve/worker/colocated.py) behind the worker's adapter loader
(pdserve/worker/lora_loading.py), driven as the worker loop drives it (hand it the
messages that arrived, step, repeat), over an engine serving STREAMS streams spread over
ADAPTERS rank-RANK adapters on all seven projections, all held. While the streams
decode, LOADS more requests arrive, a few steps apart, each under an adapter of its own
(rank LOAD_RANK, default RANK: a larger one makes a longer read):

  held:    adapters registered before the phase (the baseline: no read at all);
  runtime: adapters never seen, read on the loader's thread while the loop steps on;
  on-loop: never seen, read inside `handle` on the loop (what the worker did before the
           loader; shown for scale, not a target).

Each phase starts the same prompts afresh (phase order rotates each round); the ITL of a
stream is the time between two steps that gave it a token, over the STREAMS running
streams only (the late requests are not counted). Prints each round's p99 and median
ITL per phase and the median over rounds of runtime / held p99 (the issue's target: a
run-time load raises the others' ITL p99 by at most 20%, a ratio <= 1.20).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.lora import write_adapter
from pdserve.common.sampling_params import SamplingParams

PHASES = ("held", "runtime", "on-loop")


def build(model: str, threads: int, max_loras: int, rank: int) -> tuple[Any, Any]:
    """(the loader-wrapped colocated node, its sent messages)."""
    from pdserve.common.roles import Role
    from pdserve.engine.core.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.lora.config import LoraConfig
    from pdserve.worker.colocated import ColocatedNode
    from pdserve.worker.lora_loading import LoraLoadingNode
    from pdserve.worker.metrics import WorkerMetrics

    engine = LLMEngine(EngineConfig(model_dir=model, num_threads=threads,
                                    lora=LoraConfig(max_loras=max_loras, max_lora_rank=rank,
                                                    max_cpu_loras=4 * max_loras)))
    out: list[Any] = []
    node = ColocatedNode("bench", engine, engine.runner, out.append, WorkerMetrics(Role.COLOCATED, "bench"))
    return LoraLoadingNode(node), out


def phase(node: Any, out: list[Any], phase_name: str, prompts: list[list[int]], streams: list[Any],
          late: list[Any], output_len: int, every: int) -> list[float]:
    """ITLs (seconds) of the streams while `late` requests arrive `every` steps apart."""
    from pdserve.common import protocol as p

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = random.getrandbits(32)
    if phase_name == "held":
        for ref in late:
            node.inner.engine.loras.register(ref)
    ids = [f"{tag}-s{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        node.handle(p.RunRequest(rid, p.RequestPayload(prompt, params, lora=streams[i % len(streams)])))
    running = set(ids)
    last: dict[str, float] = {}
    itls: list[float] = []
    steps, arrived = 0, 0
    out.clear()
    while node.busy():
        if arrived < len(late) and steps >= every * (arrived + 1):
            msg = p.RunRequest(f"{tag}-late{arrived}", p.RequestPayload(prompts[arrived], params, lora=late[arrived]))
            (node.inner.handle if phase_name == "on-loop" else node.handle)(msg)
            arrived += 1
        node.step()
        steps += 1
        now = time.perf_counter()
        for m in out:
            for d in getattr(m, "deltas", ()):
                if d.token_ids and d.request_id in running:
                    if d.request_id in last:
                        itls.append(now - last[d.request_id])
                    last[d.request_id] = now
        out.clear()
    return itls


def main() -> None:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--load-rank", type=int, default=None, help="rank of the adapters loaded (default --rank)")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from pdserve.common.lora import lora_ref

    model = harness.model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="bench-lora-load-") as tmp:
        def adapter(name: str, seed: int, rank: int = args.rank) -> Any:
            return lora_ref(name, write_adapter(model, Path(tmp) / name, rank, seed))

        streams = [adapter(f"s{i}", i) for i in range(args.adapters)]
        load_rank = args.load_rank or args.rank
        node, out = build(model, args.threads, args.adapters + args.loads, max(args.rank, load_rank))
        for ref in streams:
            node.inner.engine.loras.register(ref)
        vocab = node.inner.engine.vocab_size
        every = max(1, args.output_len // (args.loads + 2))
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            rng = random.Random(r)
            order = PHASES[r % 3:] + PHASES[: r % 3]
            got: dict[str, dict[str, float]] = {}
            for k, name in enumerate(order):
                prompts = [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
                late = [adapter(f"r{r}-{name}-{i}", 1000 * (r + 1) + 10 * k + i, load_rank) for i in range(args.loads)]
                itls = phase(node, out, name, prompts, streams, late, args.output_len, every)
                got[name] = {"p99": harness.percentile(itls, 0.99), "p50": harness.percentile(itls, 0.5), "n": len(itls)}
            ratio = got["runtime"]["p99"] / got["held"]["p99"]
            rounds.append({**got, "ratio_p99": ratio, "on_loop_ratio_p99": got["on-loop"]["p99"] / got["held"]["p99"]})
            print(f"round {r}: " + ", ".join(f"{n} ITL p99 {got[n]['p99'] * 1e3:.2f} ms (p50 {got[n]['p50'] * 1e3:.2f})"
                                            for n in PHASES)
                  + f"; runtime/held p99 {ratio:.3f}", flush=True)
        node.close()
    ratio = statistics.median(float(x["ratio_p99"]) for x in rounds)
    on_loop = statistics.median(float(x["on_loop_ratio_p99"]) for x in rounds)
    print(f"median runtime-load / held ITL p99: {ratio:.3f} (on-loop read: {on_loop:.3f}); {args.streams} streams "
          f"over {args.adapters} adapters of rank {args.rank}, {args.loads} loads of rank {load_rank} per phase; "
          "target <= 1.20")
    harness.write_json(args.output_json, {"rounds": rounds, "median_ratio_p99": ratio,
                                          "median_on_loop_ratio_p99": on_loop, "streams": args.streams,
                                          "adapters": args.adapters, "rank": args.rank, "loads": args.loads,
                                          "load_rank": load_rank})


if __name__ == "__main__":
    main()
