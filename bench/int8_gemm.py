"""Per-layer timing of the int8 weight matmul paths against the bf16 matmul, one run.

    python -m bench.int8_gemm [--threads 1 2] [--rows 1 8 16 32] [--reps 200]

For each weight shape [N, K] (the ~125M benchmark model's projections), row count and
thread count: F.linear with the bf16 weight, the aten int8 kernel
(`torch._weight_int8pack_mm`), the int8 -> bf16 conversion + matmul that Int8Linear
ran past 8 rows, and the native kernel (engine/_int8_gemm.c). Prints the median time
of each and its ratio to bf16, all measured in the same run (the host may be shared:
compare ratios, not absolute times).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.quant import int8_kernel
from engine.quant.pack import quantize_int8

SHAPES = ((2048, 768), (768, 2048), (3072, 768))


def _median_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(max(5, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _row(n: int, k: int, m: int, reps: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    parts = quantize_int8(w)
    q, s16 = parts.q.contiguous(), parts.scales.to(torch.bfloat16)
    w16 = (q.float() * s16.float()[:, None]).to(torch.bfloat16)
    packed = int8_kernel.pack(q, s16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    paths: dict[str, Callable[[], object]] = {
        "bf16": lambda: F.linear(x, w16),
        "aten_int8": lambda: torch._weight_int8pack_mm(x, q, s16),
        "convert": lambda: F.linear(x, q.to(torch.bfloat16)) * s16,
    }
    if int8_kernel.available():
        paths["native"] = lambda: int8_kernel.matmul(x, packed)
    return {name: _median_us(fn, reps) for name, fn in paths.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    if not int8_kernel.available():
        print("native int8 kernel unavailable (no library or no AVX-512 BF16): torch paths only")
    print(f"{'threads':>7} {'N x K':>11} {'M':>3} {'bf16 us':>8}  ratio to bf16: aten_int8 convert native")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n, k in SHAPES:
            for m in args.rows:
                r = _row(n, k, m, args.reps)
                ratios = "  ".join(f"{r[p] / r['bf16']:9.2f}" for p in ("aten_int8", "convert", "native") if p in r)
                print(f"{threads:>7} {f'{n}x{k}':>11} {m:>3} {r['bf16']:8.1f}  {ratios}")


if __name__ == "__main__":
    main()
