"""Quality of engine configurations against the unquantized reference, teacher-forced.

    python -m bench.quality [--model DIR | --moe] [--tokens 20480] [--rows 80] [--schemes bfloat16]

The held-out split of the story corpus (`pdserve.builtin.story_corpus`, never trained on) is
tokenized and cut into `--rows` rows; the engine's own `ModelRunner` (what pdserve
serves, not `transformers`) reads them one token per row per step, decode-style, so
every prediction attends over the paged KV cache exactly as decoding does (a quantized
KV cache shows up here). The reference (`REFERENCE`, float32) and every scheme run in
lockstep over the same tokens; per scheme the table gives top-1 agreement with the
reference, the mean KL divergence KL(reference || scheme) over positions, and the
perplexity of both on the actual next tokens.

`--moe` scores a tiny Mixtral trained on the same corpus instead (`bench/moe_model.py`:
trained on first use in a few minutes, then cached; never shipped), so every weight
scheme is measured on a mixture-of-experts family too.

A scheme is a row of `SCHEMES`: overrides of `EngineConfig` fields, a dotted name for
a nested one. A new quantization adds one line, e.g.
`"int8": {"quantization": "int8"}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench import harness
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.model_runner import ModelRunner

REFERENCE: dict[str, Any] = {"dtype": "float32"}
SCHEMES: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32"},  # the reference against itself: 100%, KL 0
    "bfloat16": {"dtype": "bfloat16"},
    "fp8 KV": {"dtype": "float32", "kv_cache_dtype": "fp8"},  # e4m3, per-block-per-head scales
    "int8 KV": {"dtype": "float32", "kv_cache_dtype": "int8"},
    # Weight schemes as served: the LM head int8 (`--lm-head-quantization auto`), and with
    # the head left in the compute dtype (`none`) to show what the int8 head costs.
    "int8 weights": {"dtype": "float32", "quantization": "int8"},  # per-output-channel scales
    "int4 weights": {"dtype": "float32", "quantization": "int4"},  # group 128, asymmetric
    "int8 weights (float head)": {"dtype": "float32", "quantization": "int8", "lm_head_quantization": "none"},
    "int4 weights (float head)": {"dtype": "float32", "quantization": "int4", "lm_head_quantization": "none"},
    # As a CPU user serves them: bf16 compute, where the native int8/int4 kernels run (decode's
    # 1-16 rows on rows in 15-bit fixed point: compare --rows 4 and 16 with the default 80).
    "int8 weights (bf16)": {"dtype": "bfloat16", "quantization": "int8"},
    "int4 weights (bf16)": {"dtype": "bfloat16", "quantization": "int4"},
}


class SchemeQuality(NamedTuple):
    scheme: str
    tokens: int
    top1_agreement: float
    mean_kl: float
    reference_ppl: float
    scheme_ppl: float


def with_overrides(config: EngineConfig, overrides: Mapping[str, Any]) -> EngineConfig:
    """`config` with each `field` or `outer.inner` replaced; unknown fields are errors."""
    for key, value in overrides.items():
        head, _, rest = key.partition(".")
        if head not in {f.name for f in dataclasses.fields(config)}:
            raise ValueError(f"EngineConfig has no field {head!r} (scheme override {key!r})")
        if rest:
            inner = getattr(config, head)
            names = {f.name for f in dataclasses.fields(inner)}
            if rest not in names:
                raise ValueError(f"{type(inner).__name__} has no field {rest!r} ({key!r})")
            value = dataclasses.replace(inner, **{rest: value})
        config = dataclasses.replace(config, **{head: value})
    return config


def heldout_rows(model_dir: Path, rows: int, length: int) -> list[list[int]]:
    """`rows` rows of `length` + 1 consecutive held-out token ids (inputs and targets)."""
    from tokenizers import Tokenizer

    from pdserve.builtin.story_corpus import documents, render

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    need = rows * (length + 1)
    for doc in documents("heldout"):
        ids += tok.encode(render(doc), add_special_tokens=False).ids
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"the held-out split has {len(ids)} tokens, {need} needed")
    return [ids[r * (length + 1) : (r + 1) * (length + 1)] for r in range(rows)]


class _Runner:
    """A ModelRunner and the block tables that give each row its own blocks."""

    def __init__(self, config: EngineConfig, rows: int, length: int) -> None:
        bs = config.cache.block_size
        per_row = -(-length // bs)
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, num_blocks=1 + rows * per_row,
                                              enable_prefix_caching=False))
        self.runner = ModelRunner(config)
        # Block 0 is the null block; row r owns blocks 1 + r*per_row ...
        self.tables = [list(range(1 + r * per_row, 1 + (r + 1) * per_row)) for r in range(rows)]

    def logprobs(self, step: int, tokens: Sequence[int]) -> torch.Tensor:
        chunks = [SeqChunk([t], step, table, True) for t, table in zip(tokens, self.tables, strict=True)]
        return torch.log_softmax(self.runner.execute(chunks).float().cpu(), dim=-1)


def measure(model_dir: Path, schemes: Mapping[str, Mapping[str, Any]], rows: int, length: int,
            base: EngineConfig | None = None) -> list[SchemeQuality]:
    """Teacher-force `rows` x `length` held-out tokens through the reference and each scheme."""
    base = base or EngineConfig(model_dir=str(model_dir), cache=CacheConfig())
    data = heldout_rows(model_dir, rows, length)
    ref = _Runner(with_overrides(base, REFERENCE), rows, length)
    cands = {name: _Runner(with_overrides(base, o), rows, length) for name, o in schemes.items()}
    sums = {name: [0.0, 0.0, 0.0, 0.0] for name in schemes}  # agree, kl, ref nll, nll
    for step in range(length):
        inputs = [row[step] for row in data]
        target = torch.tensor([row[step + 1] for row in data])
        ref_lp = ref.logprobs(step, inputs)
        ref_nll = -ref_lp.gather(1, target[:, None]).sum().item()
        ref_top = ref_lp.argmax(dim=-1)
        for name, runner in cands.items():
            lp = runner.logprobs(step, inputs)
            s = sums[name]
            s[0] += (lp.argmax(dim=-1) == ref_top).sum().item()
            s[1] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            s[2] += ref_nll
            s[3] += -lp.gather(1, target[:, None]).sum().item()
    n = rows * length
    return [SchemeQuality(name, n, s[0] / n, s[1] / n, math.exp(s[2] / n), math.exp(s[3] / n))
            for name, s in sums.items()]


def markdown(results: Sequence[SchemeQuality]) -> str:
    """One markdown table, a row per scheme."""
    head = ("| scheme | tokens | top-1 agreement | mean KL | reference ppl | scheme ppl |\n"
            "|---|---:|---:|---:|---:|---:|\n")
    return head + "".join(
        f"| {r.scheme} | {r.tokens} | {100 * r.top1_agreement:.2f}% | {r.mean_kl:.2e} "
        f"| {r.reference_ppl:.3f} | {r.scheme_ppl:.3f} |\n" for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: the built-in)")
    ap.add_argument("--moe", action="store_true",
                    help="the tiny Mixtral of bench/moe_model.py (trained on first use, cached)")
    ap.add_argument("--tokens", type=int, default=20480, help="held-out tokens scored per scheme")
    ap.add_argument("--rows", type=int, default=80, help="rows decoded side by side")
    ap.add_argument("--schemes", default=",".join(SCHEMES),
                    help=f"comma-separated rows of SCHEMES (default: all: {', '.join(SCHEMES)})")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    args = ap.parse_args(argv)
    names = [s for s in args.schemes.split(",") if s]
    unknown = [s for s in names if s not in SCHEMES]
    if unknown or not names:
        ap.error(f"unknown scheme(s) {unknown}; choose from {', '.join(SCHEMES)}")
    if args.rows < 1 or args.tokens < args.rows:
        ap.error("--tokens must be at least --rows, and --rows at least 1")
    if args.moe:
        if args.model is not None:
            ap.error("--moe names its own model; drop --model")
        from bench.moe_model import trained_moe_dir

        args.model = trained_moe_dir()
    if args.model is None:
        from pdserve.builtin.default_model import default_model_dir

        args.model = default_model_dir()
    base = EngineConfig(model_dir=str(args.model), num_threads=args.threads)
    watch = harness.Stopwatch()
    results = measure(args.model, {n: SCHEMES[n] for n in names}, args.rows,
                      -(-args.tokens // args.rows), base)
    print(markdown(results), end="")
    print(f"\n{harness.machine_line()}\n{args.model}, {results[0].tokens} held-out tokens, {watch.lap():.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
