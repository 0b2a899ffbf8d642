"""What row invariance costs at bf16, and prefill against the GEMM limit, in one run.

    python -m bench.invariance [--prompt-len 1500] [--chunk 512] [--batch 8] [--reps 3]
    PDSERVE_CPU_FEATURES=-amx ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python -m bench.invariance

On the issue's perf shape (bench/models.py `125m`: hidden 768, 12 layers, 12 heads, 4 KV
heads, intermediate 2048; random weights), one thread, bf16, medians of `--reps`:

- decode ITL: one step of `--batch` sequences at 256 tokens of context;
- prefill tok/s: a `--prompt-len` prompt in one chunk and in `--chunk`-token chunks;

each on the invariant path (the default: the kernel table's bf16 entry for every linear,
pdserve/engine/kernels/table.py, and prefill attention through the paged kernel,
pdserve/engine/attention/native.py) and on the fastest non-invariant one (aten's oneDNN matmul
for every linear, SDPA for prefill attention; decode attention is the paged kernel in
both). It prints invariant / non-invariant per figure (the issue's target: cost at most
5%, i.e. ITL ratio <= 1.05 and tok/s ratio >= 0.95). Prefill also runs "untiled": the
invariant path without its prefill tiles (the AVX-512 BF16 linear's 4 x 6 register tiles,
pdserve/engine/kernels/_bf16_tiles.c; attention's row tiles, pd_paged_prefill), i.e. every row
as a decode runs it, the same bits: tiled / untiled is the tiles' gain, in the same run.

Then the limit: aten's 1-thread bf16 GEMM rate over the model's linear shapes at
`--prompt-len` rows (GFLOP/s; timed in turn with the prefill runs, median of `--reps`), the model FLOPs per prompt token counted from the config
(2 x the linear weights per layer, plus causal attention's 4 x heads x head_dim x the mean
context, times the layers; the LM head runs on one row per prompt and is left out), and
the fraction  FLOPs/token x tok/s / GEMM rate  per path (the issue's target: >= 0.75).

`PDSERVE_CPU_FEATURES` picks the CPU kind the kernels run as; oneDNN is not masked by it,
so emulating a CPU without AMX on one with it also needs ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
(the script says which it ran with). Times are the process's CPU time (one thread), so
a shared machine's time slicing does not count; its cache and memory contention still
does. Every figure is a ratio within the run; the run says the machine may have been busy.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import harness, models
from bench.profile_step import DecodeBench
from pdserve.common import envs
from pdserve.engine.attention.native import InPlacePagedAttention
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.kernels import bf16_gemv, cpu_features
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.runner.model_runner import ModelRunner


def set_invariant(on: bool, tiled: bool = True) -> None:
    """The invariant path (default) or the fastest non-invariant one, for this process;
    `tiled=False`: the invariant path without its prefill tiles (the linears' 4 x 6 register
    tiles, attention's row tiles): every row as a decode would run it, the same bits."""
    bf16_gemv.set_enabled(on)
    bf16_gemv.set_tiles(tiled)
    InPlacePagedAttention.invariant_prefill = on
    InPlacePagedAttention.row_tiles = tiled


def prefill_seconds(runner: ModelRunner, prompt: list[int], table: list[int], chunk: int) -> float:
    t0 = time.process_time()
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        runner.execute([SeqChunk(prompt[start:end], start, table, end == len(prompt))])
    return time.process_time() - t0


def decode_seconds(bench: DecodeBench) -> float:
    """Median CPU seconds per decode step over one run of the bench's steps (its own
    `run`, timed in process time)."""
    tokens = [1] * len(bench.tables)
    times = []
    for i in range(bench.steps):
        chunks = [SeqChunk([tok], ctx + i, t, True) for tok, ctx, t in zip(tokens, bench.contexts, bench.tables,
                                                                            strict=True)]
        t0 = time.process_time()
        logits = bench.runner.execute(chunks)
        tokens = [r.token_id for r in bench.sampler(logits, bench.rows)]
        times.append(time.process_time() - t0)
    return statistics.median(times)


def interleaved(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, float]:
    """Median of `reps` runs of each, interleaved so background load hits all alike."""
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            runs[k].append(fn())
    return {k: statistics.median(v) for k, v in runs.items()}


def linear_shapes(runner: ModelRunner) -> list[tuple[int, int]]:
    """(N, K) of every linear weight of one decoder layer, as the model holds them."""
    layer = runner.model.layers[0]
    return [tuple(p.shape) for n, p in layer.named_parameters() if p.dim() == 2]  # type: ignore[misc]


def gemm_seconds(shapes: list[tuple[int, int]], rows: int) -> tuple[Callable[[], float], int]:
    """A run of aten's bf16 GEMM over `shapes` at `rows` rows (returns its CPU seconds), and
    its FLOPs. `main` interleaves it with the prefill runs, so the limit and the prefill
    meet the same background load."""
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
    ws = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in ws)

    def run() -> float:
        t0 = time.process_time()
        for w in ws:
            F.linear(xs[w.shape[1]], w)
        return time.process_time() - t0

    run()
    return run, flops


def flops_per_token(runner: ModelRunner, shapes: list[tuple[int, int]], prompt_len: int) -> float:
    cfg = runner.model_config
    linear = 2 * sum(n * k for n, k in shapes)
    attention = 4 * cfg.num_heads * cfg.head_dim * (prompt_len + 1) / 2
    return cfg.num_layers * (linear + attention)


def main() -> None:
    ap = harness.parser(__doc__, model_help=None)
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = models.model_for("125m")
    runner = ModelRunner(EngineConfig(model_dir=str(model), dtype="bfloat16", num_threads=1,
                                      cache=CacheConfig(num_blocks=2 * args.prompt_len // 16 + 64 * args.batch)))
    feats = native_kernels.features()
    print(f"CPU as: {cpu_features.level_of(feats)} ({', '.join(sorted(feats)) or 'baseline'}); "
          f"PDSERVE_CPU_FEATURES={envs.cpu_features() or '(unset)'}; "
          f"ONEDNN_MAX_CPU_ISA={envs.onednn_max_cpu_isa() or '(unset)'}; bf16 kernel {bf16_gemv.kernel()}; "
          "1 thread; the machine may be shared and busy: ratios are within this run")
    decode = DecodeBench(runner, [256] * args.batch, steps=6, spare_tokens=2 * args.prompt_len)
    table = decode.spare
    prompt = torch.randint(3, runner.model_config.vocab_size, (args.prompt_len,),
                           generator=torch.Generator().manual_seed(1)).tolist()

    def on(fn: Callable[[], float], path: str) -> Callable[[], float]:
        def run() -> float:
            set_invariant(path != "aten", tiled=path != "untiled")
            try:
                return fn()
            finally:
                set_invariant(True)
        return run

    def whole() -> float:
        return prefill_seconds(runner, prompt, table, args.prompt_len)

    def chunked() -> float:
        return prefill_seconds(runner, prompt, table, args.chunk)

    fns = {f"{name} {path}": on(fn, path)
           for name, fn in (("decode", lambda: decode_seconds(decode)), ("prefill", whole), ("chunked", chunked))
           for path in ("invariant", "aten", "untiled") if name != "decode" or path != "untiled"}
    shapes = linear_shapes(runner)
    fns["gemm"], gemm_flops = gemm_seconds(shapes, args.prompt_len)
    t = interleaved(fns, args.reps)
    itl = t["decode invariant"] / t["decode aten"]
    print(f"decode ITL at batch {args.batch}: invariant {1e3 * t['decode invariant']:.2f} ms, "
          f"aten {1e3 * t['decode aten']:.2f} ms, ratio {itl:.3f} (target <= 1.05)")
    rate = gemm_flops / t["gemm"]
    per_token = flops_per_token(runner, shapes, args.prompt_len)
    result = {"decode_itl_ratio": itl, "gemm_gflops": rate / 1e9, "features": sorted(feats)}
    for name, label in (("prefill", f"{args.prompt_len} tokens in one chunk"),
                        ("chunked", f"in chunks of {args.chunk}")):
        inv, base = args.prompt_len / t[f"{name} invariant"], args.prompt_len / t[f"{name} aten"]
        print(f"prefill, {label}: invariant {inv:.0f} tok/s, aten {base:.0f} tok/s, ratio {inv / base:.3f} "
              f"(target >= 0.95); of the GEMM limit: invariant {per_token * inv / rate:.2f}, "
              f"aten {per_token * base / rate:.2f} (target >= 0.75)")
        untiled = args.prompt_len / t[f"{name} untiled"]
        print(f"  before the prefill tiles (same bits): {untiled:.0f} tok/s, fraction {per_token * untiled / rate:.2f}; "
              f"tiled / untiled {inv / untiled:.3f}")
        result[f"{name}_ratio"] = inv / base
        result[f"{name}_limit_fraction"] = per_token * inv / rate
        result[f"{name}_tiled_over_untiled"] = inv / untiled
    print(f"aten 1-thread bf16 GEMM at {args.prompt_len} rows over the layer's linears: {rate / 1e9:.0f} GFLOP/s; "
          f"model {per_token / 1e6:.0f} MFLOP per prompt token")
    harness.write_json(args.output_json, result)


if __name__ == "__main__":
    main()
