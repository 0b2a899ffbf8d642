"""Speculative decoding: engine decode tokens/s with speculation off vs on, same run.

    .venv/bin/python -m bench.spec_decode [--workload redo|quote|open|repeat|random]
        [--concurrency 1,16] [--rounds 3] [--speculative-config JSON]
        [--disable-sweep 2,4,8,16] [--model DIR] [--threads N]

Workloads (the trained built-in model unless `--model`):
- `quote`: output repeats the prompt (summarize-and-quote): a held-out story, then its
  first sentence again, meant to be quoted (the trained model does not copy it:
  bench/README.md); n-gram drafts by default.
- `redo`: output repeats the prompt on the trained model (regenerate / ask-again traffic):
  a held-out story's first sentence, the model's own earlier greedy answer and its end
  token, then the same first sentence again (`redo_prompt`). The model does
  not copy a text it did not write (`quote`), but it repeats its own answer held in the context.
  n-gram drafts K=6 with lookup 2-4 tokens by default (chosen by measurement: bench/README.md).
- `open`: open-ended prompts, the first sentence of a held-out story; the trained
  draft model `pdserve-tiny-llama-draft` drafts by default (K=3, chosen by measurement:
  bench/README.md).
- `repeat` / `random`: random token segments said twice / never repeated (any model).

Two engines over the same weights, one without and one with `--speculative-config`.
Each round runs the same C requests on each (fresh prompts every round, so no
prefix-cache hit), off first in even rounds and on first in odd ones; the decode rate
counts tokens after each request's first, over the window after every prompt is
prefilled. Each rate is printed twice: by the wall clock, and by this process's CPU
time (the engine runs on this process's threads, so the CPU-time ratio is the one
other processes' load on the machine does not move). Prints each round's ratios, and
per concurrency the medians over rounds with the mean acceptance length (1 + accepted
drafts per verifying step) and the fraction of output tokens that complete a 3-gram of
their prompt ("copied": how much the output repeats the prompt). Outputs are checked identical (greedy).

`--disable-sweep V1,V2,...` repeats the on engine with `disable_by_batch_size` set to
each value (one engine each) to choose that default.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench import harness
from pdserve.common.sampling_params import SamplingParams

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
REDO_NGRAM = '{"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
DRAFT_K = 3
WORKLOADS = ("redo", "quote", "open", "repeat", "random")
REDO_ANSWER_LEN = 192  # the earlier answer: generated until the model's end token, at most this
REDO_PASSES = 2  # the earlier answer: to the bare opening, then to the redo prompt holding that one
HELDOUT_SEED = 1_000_000  # pdserve.builtin.story_corpus: stories from here on were never trained on


@dataclass(frozen=True)
class Run:
    tokens_per_s: float  # wall clock
    cpu_tokens_per_s: float  # this process's CPU time
    outputs: list[tuple[int, ...]]
    drafts: int
    accepted: int

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


@dataclass(frozen=True)
class Ratio:
    wall: float
    cpu: float
    mean_acceptance_length: float
    identical: bool
    copied: float  # mean fraction of output tokens completing a 3-gram of their prompt


def default_spec(workload: str) -> str:
    """The speculative config a workload is measured with unless one is given."""
    if workload == "redo":
        return REDO_NGRAM  # K and lookup chosen by measurement (bench/README.md)
    if workload != "open":
        return NGRAM
    import json

    from pdserve.builtin.default_model import draft_model_dir

    return json.dumps({"method": "draft_model", "model": str(draft_model_dir()), "num_speculative_tokens": DRAFT_K})


def _story(seed: int) -> str:
    from pdserve.builtin.story_corpus import story

    return story(random.Random(HELDOUT_SEED + seed))


def text_prompt(workload: str, seed: int) -> str:
    """`quote`: a story, a blank line and its first sentence again; `open`: a first sentence."""
    text = _story(seed)
    first = text.split(". ")[0] + "."
    return f"{text}\n\n{first}" if workload == "quote" else first


def prompt_ngram_fraction(prompt: list[int], output: tuple[int, ...] | list[int], n: int = 3) -> float:
    """The fraction of `output` tokens that end an `n`-gram (counting the prompt's tail) found in `prompt`."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    seq = list(prompt) + list(output)
    hits = sum(tuple(seq[k - n + 1:k + 1]) in grams for k in range(len(prompt), len(seq)))
    return hits / len(output) if output else 0.0


def greedy_answer(engine: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """The engine's greedy output for `prompt`, up to and with its end token."""
    rid = f"answer{time.monotonic_ns()}"
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(t for c in o.outputs for t in c.token_ids)
    return out


def redo_prompt(engine: Any, opening: list[int], end_ids: tuple[int, ...]) -> list[int]:
    """`redo`: the opening, the model's earlier greedy answer closed by an end token, the opening
    again. The earlier answer is the one the model gives in that same context (its answer to
    `opening, first answer, end, opening`), as a regenerated chat turn holds the previous answer
    to the same conversation; the model's first answer to the bare opening often differs."""
    answer: list[int] = []
    for _ in range(REDO_PASSES):
        answer = greedy_answer(engine, opening + answer + opening if answer else opening, REDO_ANSWER_LEN)
        if not answer or answer[-1] not in end_ids:
            answer.append(end_ids[0])
    return opening + answer + opening


def prompts(workload: str, n: int, length: int, salt: int, vocab: int, tokenizer: Any = None,
            engine: Any = None) -> list[list[int]]:
    """`n` prompts of `workload` (token ids); `length` sizes the random-token ones; `redo`
    generates each earlier answer on `engine` (greedy)."""
    if workload == "redo":
        return [redo_prompt(engine, list(tokenizer.encode(text_prompt("open", salt * 100 + i), add_special_tokens=True)),
                            tuple(tokenizer.eos_token_ids)) for i in range(n)]
    if workload in ("quote", "open"):
        return [list(tokenizer.encode(text_prompt(workload, salt * 100 + i), add_special_tokens=True))
                for i in range(n)]
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
    from pdserve.engine.core.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=model, dtype=dtype, num_threads=threads, speculative=spec))


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
    tokens, wall, cpu_watch = 0, harness.Stopwatch(), harness.Stopwatch(time.process_time)
    while engine.has_unfinished():
        for o in engine.step():
            new = [t for c in o.outputs for t in c.token_ids]
            outputs[o.request_id].extend(new)
            tokens += len(new)
    elapsed, cpu = wall.lap(), cpu_watch.lap()
    after = engine.stats().spec
    drafts = (after.num_drafts - before.num_drafts) if after is not None else 0
    accepted = (after.num_accepted_tokens - before.num_accepted_tokens) if after is not None else 0
    return Run(tokens / elapsed, tokens / max(cpu, 1e-9), [tuple(outputs[r]) for r in ids], drafts, accepted)


def compare(off: Any, on: Any, batch: list[list[int]], output_len: int, on_first: bool) -> tuple[Run, Run, Ratio]:
    """One round: the same batch on both engines, in the order asked."""
    if on_first:
        b = decode_run(on, batch, output_len)
        a = decode_run(off, batch, output_len)
    else:
        a = decode_run(off, batch, output_len)
        b = decode_run(on, batch, output_len)
    copied = statistics.mean(prompt_ngram_fraction(p, o) for p, o in zip(batch, a.outputs, strict=True))
    return a, b, Ratio(b.tokens_per_s / a.tokens_per_s, b.cpu_tokens_per_s / a.cpu_tokens_per_s,
                       b.mean_acceptance_length, a.outputs == b.outputs, copied)


def rounds(off: Any, on: Any, make_batch: Any, c: int, n_rounds: int, output_len: int,
           label: str, runs: list[dict[str, Any]]) -> Ratio:
    """`n_rounds` alternating rounds at concurrency `c`; the medians."""
    got = []
    for r in range(n_rounds):
        a, b, ratio = compare(off, on, make_batch(c, r), output_len, on_first=r % 2 == 1)
        got.append(ratio)
        print(f"{label} C={c} round {r + 1} ({'on' if r % 2 else 'off'} first): off {a.tokens_per_s:.1f} / "
              f"on {b.tokens_per_s:.1f} tok/s, ratio wall {ratio.wall:.2f} cpu {ratio.cpu:.2f}, mean acceptance "
              f"length {ratio.mean_acceptance_length:.2f} ({b.drafts} drafts), copied {ratio.copied:.2f}, "
              f"outputs {'identical' if ratio.identical else 'DIFFER'}")
        runs += [replace(a, outputs=[]).__dict__ | {"label": label, "concurrency": c, "round": r, "spec": False},
                 replace(b, outputs=[]).__dict__ | {"label": label, "concurrency": c, "round": r, "spec": True,
                                                    "identical": ratio.identical}]
    med = replace(harness.median_of(got), identical=all(x.identical for x in got))
    print(f"{label} C={c}: median ratio on/off wall {med.wall:.2f}, cpu {med.cpu:.2f} over {n_rounds} rounds, "
          f"median mean acceptance length {med.mean_acceptance_length:.2f}, copied {med.copied:.2f}"
          f"{'' if med.identical else ', OUTPUTS DIFFER'}")
    return med


def main() -> int:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128, help="repeat/random workloads")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--workload", choices=WORKLOADS, default="redo")
    ap.add_argument("--speculative-config", default=None, help="default: per workload (see above)")
    ap.add_argument("--disable-sweep", default="", help="disable_by_batch_size values, comma-separated")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    from pdserve.engine.spec.config import SpeculativeConfig

    model = harness.model_dir(args.model)
    spec = SpeculativeConfig.from_json(args.speculative_config or default_spec(args.workload))
    off = build(model, args.threads, args.dtype, None)
    tokenizer = None
    if args.workload in ("redo", "quote", "open"):
        from gateway.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model_dir(model)
    vocab = min(off.vocab_size, 2000)

    def make_batch(c: int, r: int) -> list[list[int]]:
        return prompts(args.workload, c, args.prompt_len, 1000 * c + r, vocab, tokenizer, off)

    variants = ([replace(spec, disable_by_batch_size=int(v)) for v in args.disable_sweep.split(",")]
                if args.disable_sweep else [spec])
    runs: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    print(f"{harness.machine_line()}\nworkload {args.workload}, output {args.output_len}, {args.threads} threads, dtype {off.runner.dtype}")
    for variant in variants:
        on = build(model, args.threads, args.dtype, variant)
        for engine in (off, on):  # warm both
            decode_run(engine, make_batch(1, 999), 8)
        label = f"disable_by_batch_size={variant.disable_by_batch_size}"
        print(f"speculative config: {variant.to_json()}")
        for c in (int(x) for x in args.concurrency.split(",")):
            med = rounds(off, on, make_batch, c, args.rounds, args.output_len, label, runs)
            summary.append({"label": label, "concurrency": c, **asdict(med)})
    result = {"config": {k: v for k, v in vars(args).items() if k != "output_json"}, "runs": runs,
              "summary": summary}
    harness.write_json(args.output_json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
