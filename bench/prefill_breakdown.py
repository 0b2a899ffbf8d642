"""Where a bf16 prefill's time goes: each linear shape, the paged attention and the small
fused ops, one thread, against aten's GEMM on the same shapes in the same run.

    python -m bench.prefill_breakdown [--prompt-len 1500] [--reps 3]

On the issue's perf shape (bench/models.py `125m`, random weights), one `--prompt-len`
prompt in one chunk on the invariant path (what `bench.invariance` calls "invariant"). The
model's calls are wrapped in process-CPU-time timers (the wrappers add well under 1% at
this size); each part's seconds per prompt are the median of `--reps` prompts. Each linear
shape is then timed alone at `--prompt-len` rows on pdserve's kernel and on aten's
(`F.linear`, oneDNN), interleaved, and its rate printed as pdserve / aten. Last, what the
prefill would take with every linear at aten's rate and the rest as measured: the fraction
of the GEMM limit (bench/invariance.py's definition and GEMM run, median of 5) that reaches,
the ceiling a faster linear alone can give. Shares move little with background load; absolute times do.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from bench import harness, models
from bench.invariance import flops_per_token, gemm_seconds, linear_shapes, prefill_seconds
from pdserve.engine.attention import native as native_attention
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.models import llama
from pdserve.engine.runner.model_runner import ModelRunner

Timers = dict[str, float]


def timed(name: Callable[..., str], fn: Callable[..., Any], acc: Timers) -> Callable[..., Any]:
    """fn, adding each call's process CPU time to acc[name(*args)]."""
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name(*args)] += time.process_time() - t0
    return run


@contextlib.contextmanager
def instrumented(acc: Timers) -> Iterator[None]:
    """The model's linears (by weight shape), attention kernel and fused ops wrapped in
    timers while the block runs; the originals back after it."""
    cls = native_attention.NativeAttention
    saved: list[tuple[object, str, Any]] = [(llama, op, getattr(llama, op)) for op in ("linear", "silu_mul", "rope_qk", "add_rms_norm")]
    saved.append((cls, "prefill", cls.prefill))
    llama.linear = timed(lambda x, w, b=None: f"linear {w.shape[0]}x{w.shape[1]}", llama.linear, acc)
    for op in ("silu_mul", "rope_qk", "add_rms_norm"):
        setattr(llama, op, timed(lambda *a, op=op: op, getattr(llama, op), acc))
    cls.prefill = timed(lambda *a: "attention", cls.prefill, acc)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def breakdown(runner: ModelRunner, prompt: list[int], table: list[int], reps: int) -> dict[str, float]:
    """Median CPU seconds per part over `reps` one-chunk prefills of `prompt` (after one
    warm-up): "total", each timed part, and "the rest" (total less the parts)."""
    acc: Timers = defaultdict(float)
    runs: dict[str, list[float]] = defaultdict(list)
    with instrumented(acc):
        prefill_seconds(runner, prompt, table, len(prompt))
        for _ in range(reps):
            acc.clear()
            total = prefill_seconds(runner, prompt, table, len(prompt))
            runs["total"].append(total)
            for k, v in acc.items():
                runs[k].append(v)
            runs["the rest"].append(total - sum(acc.values()))
    return {k: statistics.median(v) for k, v in runs.items()}


def shape_ratio(n: int, k: int, rows: int, reps: int) -> tuple[float, float]:
    """(pdserve / aten speed, pdserve GFLOP/s) of one linear shape at `rows` rows, medians
    of `reps` interleaved pairs."""
    x = torch.randn(rows, k).bfloat16()
    w = (torch.randn(n, k) * 0.05).bfloat16()

    def cpu(fn: Callable[[], object]) -> float:
        t0 = time.process_time()
        fn()
        return time.process_time() - t0

    ours, aten = (lambda: bf16_gemv.gemv(x, w)), (lambda: F.linear(x, w))
    ours(), aten()
    pairs = [(cpu(ours), cpu(aten)) for _ in range(reps)]
    return (statistics.median(a / o for o, a in pairs),
            statistics.median(2 * rows * n * k / o / 1e9 for o, _ in pairs))


def main() -> None:
    ap = harness.parser(__doc__, model_help=None)
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner(EngineConfig(model_dir=str(models.model_for("125m")), dtype="bfloat16", num_threads=1,
                                      cache=CacheConfig(num_blocks=args.prompt_len // 16 + 8)))
    prompt = torch.randint(3, runner.model_config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(args.prompt_len // 16 + 8))
    med = breakdown(runner, prompt, table, args.reps)
    total = med.pop("total")
    print(f"bf16 prefill of {args.prompt_len} tokens, one thread: {total:.3f} s "
          f"({args.prompt_len / total:.0f} tok/s), medians of {args.reps}")
    shapes = linear_shapes(runner)
    layers = runner.model_config.num_layers
    at_aten = 0.0
    for part, seconds in sorted(med.items(), key=lambda kv: -kv[1]):
        line = f"  {part:<20} {seconds:7.3f} s  {100 * seconds / total:5.1f}%"
        n_out, k_in = (int(v) for v in part.split()[1].split("x")) if part.startswith("linear ") else (0, 0)
        if (n_out, k_in) in shapes:  # a layer's linear (the LM head runs on one row: as it is)
            ratio, gflops = shape_ratio(n_out, k_in, args.prompt_len, max(args.reps, 5))
            at_aten += seconds * ratio
            line += f"  pdserve/aten {ratio:.2f} ({gflops:.0f} GFLOP/s alone)"
        else:
            at_aten += seconds
        print(line)
    ceiling = at_aten  # the prefill with every layer linear at aten's rate
    gemm_run, gemm_flops = gemm_seconds(shapes, args.prompt_len)
    rate = gemm_flops / statistics.median(gemm_run() for _ in range(max(args.reps, 5)))
    per_token = flops_per_token(runner, shapes, args.prompt_len)
    print(f"aten GEMM over the layer's linears: {rate / 1e9:.0f} GFLOP/s; fraction of the limit now "
          f"{per_token * args.prompt_len / total / rate:.2f}; with every linear at aten's rate "
          f"{per_token * args.prompt_len / ceiling / rate:.2f} ({ceiling:.3f} s; {layers} layers)")
    harness.write_json(args.output_json, {"seconds": med, "total": total, "ceiling_seconds": ceiling})


if __name__ == "__main__":
    main()
