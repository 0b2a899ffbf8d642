"""Decode step time and KV bytes per block for each `--kv-cache-dtype`, same run.

    python -m bench.kv_cache_dtype [--batch 8] [--context 512] [--steps 20] [--threads 1]

The built-in model in bfloat16: `--batch` sequences of `--context` tokens are
prefilled, then `--steps` decode steps are timed (median) with the KV cache in
bf16, fp8 and int8. On CPU a quantized step also pays the dequantizing read of
every context block (gather + SDPA attention reads the whole context each step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import NamedTuple

import torch

from engine.config import CacheConfig, EngineConfig
from engine.model_runner import ModelRunner
from engine.runner_types import SeqChunk
from pdserve.default_model import default_model_dir

BLOCK = 16


class Row(NamedTuple):
    kv_cache_dtype: str
    block_bytes: int  # one block, every layer, K and V, scales included
    step_ms: float


def measure(kv: str, batch: int, context: int, steps: int) -> Row:
    per_seq = context // BLOCK + steps // BLOCK + 2
    runner = ModelRunner(EngineConfig(
        model_dir=str(default_model_dir()), dtype="bfloat16", kv_cache_dtype=kv,
        cache=CacheConfig(block_size=BLOCK, num_blocks=batch * per_seq + 1)))
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    runner.execute([SeqChunk(list(range(5, 5 + context)), 0, t, False) for t in tables])
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        runner.execute([SeqChunk([7], context + step, t, True) for t in tables])
        times.append(time.perf_counter() - t0)
    layout = runner.layout
    return Row(kv, layout.block_bytes_per_layer * layout.num_layers, statistics.median(times) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(kv, args.batch, args.context, args.steps) for kv in ("auto", "fp8", "int8")]
    base = rows[0]
    print(f"{'kv cache':<10} {'bytes/block':>12} {'vs bf16':>8} {'step ms':>9} {'vs bf16':>8}")
    for r in rows:
        print(f"{r.kv_cache_dtype:<10} {r.block_bytes:>12} {r.block_bytes / base.block_bytes:>8.4f} "
              f"{r.step_ms:>9.1f} {r.step_ms / base.step_ms:>8.2f}")


if __name__ == "__main__":
    main()
