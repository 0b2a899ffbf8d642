"""Time and profile one engine step on the issue's ~125M Llama shape: decode and prefill.

    python -m bench.profile_step [--dtype bfloat16] [--batch 16] [--ctx 512] [--steps 16]
        [--prefill-len 512] [--reps 3] [--threads N] [--profile]

Decode: `--batch` sequences with `--ctx`-token prompts already in the pool, in
shuffled blocks (as in a pool that has served a while). A timed run is
`--steps` decode steps (model + greedy sampler) from the same positions, so
every run rewrites the same KV slots and reads the same contexts. Prefill: one
`--prefill-len`-token prompt in one step. Three variants take turns within each
repetition, so background load on the shared machine hits all alike: the old
bf16 path (gather + SDPA decode attention, torch RMSNorm and rotary), in-place
attention only, the fused path with `F.linear` (in-place attention with its
generic loop, fused add + RMSNorm, in-place rotary), that plus the native bf16
GEMV for the decode linears and LM head (pdserve/engine/kernels/bf16_gemv.py; `PDSERVE_BF16_GEMV=0`
is the same switch for a server), and the new path: that plus the AVX-512 BF16
attention loop (pdserve/engine/kernels/_attn_bf16.c). The table shows medians over `--reps` and
ratios to the first variant run; `--variants` picks a subset (e.g. `--variants 3 4 5`).

--profile adds torch.profiler's top-10 ops by self CPU time for one decode run
and one prefill, old and new, and the share of the wall time no op accounts
for (Python and dispatch overhead).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from bench import harness
from bench.engine import build_125m
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.attention.native import NATIVE, InPlacePagedAttention, NativeAttention
from pdserve.engine.attention.paged import TorchPagedAttention
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.sampler import Sampler, SampleRow


class DecodeBench:
    """Sequences prefilled to `contexts` tokens (one per sequence), and room for `steps` more each."""

    def __init__(self, runner: ModelRunner, contexts: Sequence[int], steps: int,
                 spare_tokens: int) -> None:
        bs = runner.block_size
        g = torch.Generator().manual_seed(0)
        free = (torch.randperm(runner.num_blocks - 1, generator=g) + 1).tolist()
        sizes = [(ctx + steps + bs - 1) // bs for ctx in contexts]
        spare = (spare_tokens + bs - 1) // bs
        if len(free) < sum(sizes) + spare:
            raise SystemExit(f"the pool has {len(free)} blocks, {sum(sizes) + spare} needed")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.tables = [free[start : start + n] for start, n in zip(starts, sizes, strict=True)]
        self.spare = free[sum(sizes) : sum(sizes) + spare]  # for the prefill bench
        self.runner, self.contexts, self.steps = runner, list(contexts), steps
        prompts = [torch.randint(3, runner.model_config.vocab_size, (ctx,), generator=g).tolist()
                   for ctx in contexts]
        runner.execute([SeqChunk(p, 0, t, False) for p, t in zip(prompts, self.tables, strict=True)])
        greedy = SamplingParams(max_tokens=steps + 1, temperature=0.0)
        self.rows = [SampleRow(i, greedy, 0, 0, 0, (), ()) for i in range(len(contexts))]
        self.sampler = Sampler()

    def run(self) -> float:
        """Median seconds per decode step over one run of `steps` steps."""
        tokens = [1] * len(self.tables)
        times = []
        for i in range(self.steps):
            chunks = [SeqChunk([tok], ctx + i, t, True)
                      for tok, ctx, t in zip(tokens, self.contexts, self.tables, strict=True)]

            def step(chunks: list[SeqChunk] = chunks) -> None:
                tokens[:] = [r.token_id for r in self.sampler(self.runner.execute(chunks), self.rows)]

            times.append(harness.seconds(step))
        return statistics.median(times)


def prefill_run(runner: ModelRunner, length: int, table: list[int]) -> float:
    prompt = torch.randint(3, runner.model_config.vocab_size, (length,)).tolist()
    return harness.seconds(lambda: runner.execute([SeqChunk(prompt, 0, table, True)]))


def profile(label: str, fn: Callable[[], object]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = harness.seconds(fn)
    events = prof.key_averages()
    # Top-level ops only: a child's time is inside its parent's, so summing every
    # row would count nested work twice.
    top_us = sum(e.cpu_time_total for e in prof.events() if e.cpu_parent is None)
    print(f"\n== {label}: wall {wall * 1e3:.1f} ms, outside any op "
          f"{max(0.0, 1 - top_us / 1e6 / wall) * 100:.0f}% (Python, dispatch)")
    print(events.table(sort_by="self_cpu_time_total", row_limit=10))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--variants", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                    help="which of the variants to run, numbered from 1 (default all)")
    args = ap.parse_args(argv)
    variants = [VARIANTS[i - 1] for i in args.variants]
    base_name = variants[0]
    if NATIVE is None:
        raise SystemExit("pdserve/engine/_cpu_kernels is not built (pip install -e . builds it)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_125m(Path(tmp) / "125m")
        cfg = EngineConfig(model_dir=str(model_dir), dtype=args.dtype, num_threads=args.threads,
                           cache=CacheConfig(num_blocks=args.batch * ((args.ctx + args.steps) // 16 + 2)
                                             + args.prefill_len // 16 + 4))
        runner = ModelRunner(cfg)
        dec = DecodeBench(runner, [args.ctx] * args.batch, args.steps, args.prefill_len)
        pre_table = dec.spare
        print(f"{harness.machine_line()}\ntorch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, "
              f"decode batch {args.batch} at ctx {args.ctx}, prefill {args.prefill_len} tokens")

        def run(name: str) -> tuple[float, float]:
            with variant(runner, name):
                return dec.run(), prefill_run(runner, args.prefill_len, pre_table)

        got = harness.rounds({name: functools.partial(run, name) for name in variants}, args.reps, warmup=1)
        for i, label in enumerate(("decode step", "prefill step")):
            meds = {name: statistics.median(t[i] for t in ts) for name, ts in got.items()}
            for name, med in meds.items():
                print(f"{label} {name:<30} {med * 1e3:8.2f} ms  ratio to {base_name.split()[0]} {med / meds[base_name]:.3f}")
        if args.profile:
            for name in (base_name, variants[-1]):
                with variant(runner, name, recorded=True):
                    profile(f"decode x{args.steps} steps, {name}", dec.run)
                    profile(f"prefill, {name}",
                            lambda: prefill_run(runner, args.prefill_len, pre_table))


OLD, FUSED = "old (gather, torch ops)", "fused (in-place, F.linear)"
GEMV, NEW = "fused + bf16 GEMV", "new (GEMV + bf16 attn loop)"
VARIANTS = (OLD, "in-place attention only", FUSED, GEMV, NEW)


class Recorded:
    """The native library with each call shown as its own op in torch.profiler."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.lib, name)

        def call(*args: Any) -> Any:
            with torch.profiler.record_function(f"native::{name}"):
                return fn(*args)

        return call


@contextmanager
def variant(runner: ModelRunner, name: str, recorded: bool = False) -> Iterator[None]:
    """The runner with the old or new bf16 paths for the duration."""
    lib = native_kernels.LIB
    assert NATIVE is not None and lib is not None
    new_lib = cast(ctypes.CDLL, Recorded(lib)) if recorded else lib
    runner.backend = (TorchPagedAttention() if name == OLD
                      else InPlacePagedAttention(NativeAttention(new_lib)))
    native_kernels.LIB = new_lib if name in (FUSED, GEMV, NEW) else None  # the fused norm and rope paths
    gemv_was = bf16_gemv.set_enabled(name in (GEMV, NEW))
    attn_was = lib.pd_attn_bf16_set(int(name == NEW)) if hasattr(lib, "pd_attn_bf16_set") else None
    try:
        yield
    finally:
        native_kernels.LIB = lib
        bf16_gemv.set_enabled(gemv_was)
        if attn_was is not None:
            lib.pd_attn_bf16_set(attn_was)

if __name__ == "__main__":
    main()
