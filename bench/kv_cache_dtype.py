"""Decode step time and KV bytes per block for each `--kv-cache-dtype`, same run.

    python -m bench.kv_cache_dtype [--model shape:125m] [--batch 8] [--context 1500] \\
        [--steps 20] [--threads 1,2] [--attention-only]

The model (default: the built-in one; `shape:125m` is the ~125M benchmark shape) in
bfloat16: `--batch` sequences of `--context` tokens are prefilled, then `--steps` decode
steps are timed (median) with the KV cache in bf16, fp8 and int8, on each thread count
of `--threads`; each row's ratio is to bf16 KV at the same thread count. On CPU with the
native kernels built, fp8/int8 decode reads the codes and their scales in place
(engine/_attn_q8.c); `quant-gather` rows time the quantized cache through the previous
path (gather + dequantize + SDPA, `TorchPagedAttention`) in the same run.
`--attention-only` also times one layer's decode attention alone (`attn ms`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from bench.harness import MODEL_HELP, model_dir
from engine.attention import TorchPagedAttention, build_metadata, order_chunks
from engine.config import CacheConfig, EngineConfig
from engine.model_runner import ModelRunner
from engine.runner_types import SeqChunk

BLOCK = 16
PATHS = (("auto", False), ("fp8", False), ("int8", False), ("fp8", True), ("int8", True))


class Row(NamedTuple):
    kv_cache_dtype: str
    path: str  # the decode attention backend that ran
    threads: int
    block_bytes: int  # one block, every layer, K and V, scales included
    step_ms: float
    attn_ms: float  # one layer's decode attention alone (0: not timed)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(model: str, kv: str, gather: bool, batch: int, context: int, steps: int,
            threads: int, attention_only: bool) -> Row:
    torch.set_num_threads(threads)
    per_seq = context // BLOCK + steps // BLOCK + 2
    runner = ModelRunner(EngineConfig(
        model_dir=model, dtype="bfloat16", kv_cache_dtype=kv,
        cache=CacheConfig(block_size=BLOCK, num_blocks=batch * per_seq + 1)),
        backend=TorchPagedAttention() if gather else None)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    runner.execute([SeqChunk(list(range(5, 5 + context)), 0, t, False) for t in tables])
    pos = [context]

    def step() -> None:
        runner.execute([SeqChunk([7], pos[0], t, True) for t in tables])
        pos[0] += 1

    step()  # warm-up
    step_ms = _median_ms(step, steps)
    attn_ms = _attention_ms(runner, tables, pos[0], steps) if attention_only else 0.0
    layout = runner.layout
    return Row(kv, type(runner.backend).__name__, threads,
               layout.block_bytes_per_layer * layout.num_layers, step_ms, attn_ms)


def _attention_ms(runner: ModelRunner, tables: list[list[int]], pos: int, reps: int) -> float:
    """Layer 0's decode attention over the prefilled pool (its write included)."""
    mc, backend = runner.model_config, runner.backend
    chunks = [SeqChunk([7], pos - 1, t, True) for t in tables]
    meta = build_metadata(chunks, order_chunks(chunks), BLOCK, runner.dtype, runner.device,
                          flat_decode=backend.flat_decode)
    b, hd = len(tables), mc.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, mc.num_heads, hd, generator=g).to(torch.bfloat16)
    k = torch.randn(b, mc.num_kv_heads, hd, generator=g).to(torch.bfloat16)
    kc, vc = runner.pool.layer_views(0)
    with torch.inference_mode():
        return _median_ms(lambda: backend.forward(q, k, k, kc, vc, meta), reps * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=None, help=MODEL_HELP)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--attention-only", action="store_true", help="also time one layer's attention")
    args = ap.parse_args()
    model = model_dir(args.model)
    print(f"{'kv cache':<8} {'path':<22} {'thr':>3} {'bytes/block':>11} {'vs bf16':>7} "
          f"{'step ms':>8} {'vs bf16':>7} {'attn ms':>8} {'vs bf16':>7}")
    for threads in (int(t) for t in args.threads.split(",")):
        base: Row | None = None
        for kv, gather in PATHS:
            r = measure(model, kv, gather, args.batch, args.context, args.steps, threads,
                        args.attention_only)
            base = base or r
            attn = r.attn_ms / base.attn_ms if base.attn_ms else 0.0
            print(f"{r.kv_cache_dtype:<8} {r.path:<22} {r.threads:>3} {r.block_bytes:>11} "
                  f"{r.block_bytes / base.block_bytes:>7.4f} {r.step_ms:>8.2f} "
                  f"{r.step_ms / base.step_ms:>7.2f} {r.attn_ms:>8.3f} {attn:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
