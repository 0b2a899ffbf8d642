"""Decode step time and KV bytes per block for each `--kv-cache-dtype`, same run.

    python -m bench.kv_cache_dtype [--model shape:125m] [--batch 8] [--context 1500] \\
        [--steps 20] [--threads 1,2]

The model (default: the built-in one; `shape:125m` is the ~125M benchmark shape) in
bfloat16: `--batch` sequences of `--context` tokens are prefilled, then `--steps` decode
steps are timed (median) with the KV cache in bf16, fp8 and int8, on each thread count
of `--threads`, every configuration prefilled once and then timed round-robin (one step
of each per round, so background load hits them alike); each row's ratio is to bf16 KV
at the same thread count. On CPU with the
native kernels built, fp8/int8 decode reads the codes and their scales in place
(pdserve/engine/kernels/_attn_q8.c); the `TorchPagedAttention` rows time the quantized cache through the previous
path (gather + dequantize + SDPA, `TorchPagedAttention`) in the same run.
`attn ms` times layer 0's decode attention alone (best of 3 per round).
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable
from typing import NamedTuple

import torch

from bench import harness
from pdserve.engine.attention.paged import TorchPagedAttention, build_metadata, order_chunks
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.model_runner import ModelRunner

BLOCK = 16
PATHS = (("auto", False), ("fp8", False), ("int8", False), ("fp8", True), ("int8", True))


class Row(NamedTuple):
    kv_cache_dtype: str
    path: str  # the decode attention backend that ran
    threads: int
    block_bytes: int  # one block, every layer, K and V, scales included
    step_ms: float
    attn_ms: float  # one layer's decode attention alone (0: not timed)


class Case(NamedTuple):
    """One prefilled runner: `step()` decodes every sequence once, `attend()` runs layer
    0's decode attention alone (its write included)."""

    row: Row
    step: Callable[[], object]
    attend: Callable[[], object]


def build(model: str, kv: str, gather: bool, batch: int, context: int, steps: int) -> Case:
    per_seq = context // BLOCK + (4 * steps + 2) // BLOCK + 2
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

    layout = runner.layout
    row = Row(kv, type(runner.backend).__name__, 0, layout.block_bytes_per_layer * layout.num_layers,
              0.0, 0.0)
    return Case(row, step, _attention(runner, tables, context))


def _attention(runner: ModelRunner, tables: list[list[int]], pos: int) -> Callable[[], object]:
    mc, backend = runner.model_config, runner.backend
    chunks = [SeqChunk([7], pos - 1, t, True) for t in tables]
    meta = build_metadata(chunks, order_chunks(chunks), BLOCK, runner.dtype, runner.device,
                          flat_decode=backend.flat_decode)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(tables), mc.num_heads, mc.head_dim, generator=g).to(torch.bfloat16)
    k = torch.randn(len(tables), mc.num_kv_heads, mc.head_dim, generator=g).to(torch.bfloat16)
    kc, vc = runner.pool.layer_views(0)

    def attend() -> None:
        with torch.inference_mode():
            backend.forward(q, k, k, kc, vc, meta)

    return attend


def measure(cases: list[Case], threads: int, steps: int) -> list[Row]:
    """Median step and attention times, the cases interleaved round by round (after a
    warm-up round) so that background load falls on all of them alike."""
    torch.set_num_threads(threads)
    fns: dict[tuple[int, str], Callable[[], float]] = {}
    for i, c in enumerate(cases):
        fns[i, "step"] = functools.partial(harness.seconds, c.step)
        fns[i, "attn"] = functools.partial(harness.fastest, c.attend, 3)
    got = harness.rounds(fns, steps, warmup=1)
    return [c.row._replace(threads=threads, step_ms=statistics.median(got[i, "step"]) * 1e3,
                           attn_ms=statistics.median(got[i, "attn"]) * 1e3) for i, c in enumerate(cases)]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default=None, help=harness.MODEL_HELP)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    args = ap.parse_args()
    model = harness.model_dir(args.model)
    cases = [build(model, kv, gather, args.batch, args.context, args.steps) for kv, gather in PATHS]
    print(harness.machine_line())
    print(f"{'kv cache':<8} {'path':<22} {'thr':>3} {'bytes/block':>11} {'vs bf16':>7} "
          f"{'step ms':>8} {'vs bf16':>7} {'attn ms':>8} {'vs bf16':>7}")
    for threads in (int(t) for t in args.threads.split(",")):
        rows = measure(cases, threads, args.steps)
        base = rows[0]
        for r in rows:
            print(f"{r.kv_cache_dtype:<8} {r.path:<22} {r.threads:>3} {r.block_bytes:>11} "
                  f"{r.block_bytes / base.block_bytes:>7.4f} {r.step_ms:>8.2f} "
                  f"{r.step_ms / base.step_ms:>7.2f} {r.attn_ms:>8.3f} {r.attn_ms / base.attn_ms:>7.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
