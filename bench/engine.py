"""Engine throughput beside Hugging Face `transformers` on the same weights, same run.

    python -m bench.engine [--quick] [--models default,125m] [--batches 1,8,32]

For each model and batch size: prefill tokens/s (B prompts of `--prompt-len`
tokens, time to the first token) and decode tokens/s (the next `--decode-tokens`
tokens of each), for the engine (greedy, paged KV, continuous batching) and for
`transformers.generate` with its own KV cache. Prefill = until the first token;
decode = from the first token to the last. Ratio = engine / transformers (> 1: the engine is faster).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench import harness
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine

# ~125M parameters: the issue's reference shape.
LLAMA_125M: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class Throughput(NamedTuple):
    prefill_tok_s: float
    decode_tok_s: float


class Row(NamedTuple):
    model: str
    batch: int
    engine: Throughput
    hf: Throughput


def build_125m(out_dir: Path) -> Path:
    """A random-weight Llama of the 125M shape, saved in the Hugging Face layout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_125M))
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_default(out_dir: Path) -> Path:
    from pdserve.builtin.default_model import write_default_model

    return write_default_model(out_dir)


def _prompts(batch: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(salt)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def engine_run(engine: LLMEngine, prompts: list[list[int]], decode_tokens: int) -> Throughput:
    params = SamplingParams(max_tokens=decode_tokens + 1, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
    watch = harness.Stopwatch()
    engine.step()  # the budget holds every prompt: one prefill step, first tokens out
    prefill_s = watch.lap()
    while engine.has_unfinished():
        engine.step()
    n = len(prompts)
    return Throughput(n * len(prompts[0]) / prefill_s, n * decode_tokens / watch.lap())


def hf_run(model: Any, prompts: list[list[int]], decode_tokens: int) -> Throughput:
    """One `generate` call; a logits processor timestamps every forward's end, so
    prefill = start -> first forward, decode = first -> last forward (one run, no
    subtraction of two noisy runs)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps: list[float] = []

    class _Stamp(LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
        max_new_tokens=decode_tokens + 1, min_new_tokens=decode_tokens + 1,
        eos_token_id=None, pad_token_id=0, logits_processor=LogitsProcessorList([_Stamp()]),
    )
    n = len(prompts)
    return Throughput(n * ids.shape[1] / (stamps[0] - t0), n * decode_tokens / (stamps[-1] - stamps[0]))


def bench_model(
    name: str, model_dir: Path, batches: list[int], args: argparse.Namespace
) -> list[Row]:
    from transformers import AutoModelForCausalLM

    max_batch = max(batches)
    cfg = EngineConfig(
        model_dir=str(model_dir),
        dtype="float32",  # against HF in float32 below
        cache=CacheConfig(
            num_blocks=max_batch * ((args.prompt_len + args.decode_tokens + 1) // 16 + 2) + 1,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_batch, max_num_batched_tokens=max_batch * args.prompt_len
        ),
    )
    engine = LLMEngine(cfg)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = engine.vocab_size
    warm = _prompts(2, 8, vocab, 99)
    engine_run(engine, warm, 2)
    hf_run(hf, warm, 2)
    rows = []
    for b in batches:
        prompts = _prompts(b, args.prompt_len, vocab, b)

        def run_engine(p: list[list[int]] = prompts) -> Throughput:
            return engine_run(engine, p, args.decode_tokens)

        def run_hf(p: list[list[int]] = prompts) -> Throughput:
            return hf_run(hf, p, args.decode_tokens)

        with torch.inference_mode():  # interleaved so background load hits both alike
            got = harness.rounds({"engine": run_engine, "hf": run_hf}, args.reps)
        rows.append(Row(name, b, harness.median_of(got["engine"]), harness.median_of(got["hf"])))
        print(format_row(rows[-1]), flush=True)
    return rows


HEADER = (
    f"{'model':>8} {'batch':>5} | {'prefill tok/s':>13} {'hf':>9} {'ratio':>6} | "
    f"{'decode tok/s':>12} {'hf':>9} {'ratio':>6}"
)


def format_row(r: Row) -> str:
    return (
        f"{r.model:>8} {r.batch:>5} | {r.engine.prefill_tok_s:>13.0f} {r.hf.prefill_tok_s:>9.0f} "
        f"{r.engine.prefill_tok_s / r.hf.prefill_tok_s:>6.2f} | {r.engine.decode_tok_s:>12.0f} "
        f"{r.hf.decode_tok_s:>9.0f} {r.engine.decode_tok_s / r.hf.decode_tok_s:>6.2f}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", default="default,125m", help="comma list of default,125m")
    ap.add_argument("--batches", default="1,8,32")
    args = harness.parse_speed_args(ap, argv, quick=(32, 16), full=(128, 64))
    batches = [int(b) for b in args.batches.split(",")]
    builders = {"default": build_default, "125m": build_125m}
    print(harness.machine_line())
    print(
        f"torch threads {torch.get_num_threads()}, prompt {args.prompt_len} tokens, "
        f"{args.decode_tokens} decode tokens, median of {args.reps}"
    )
    print(HEADER)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = builders[name](Path(tmp) / name)
            bench_model(name, model_dir, batches, args)


if __name__ == "__main__":
    main()
