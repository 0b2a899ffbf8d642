"""Per-layer timing of the int4 weight matmul paths against the bf16 matmul, one run.

    python -m bench.int4_gemm [--threads 1] [--rows 1 4 5 8 16 32 128 512] [--reps 50]

For each weight shape [N, K] (the ~125M benchmark model's projections: qkv, o, gate_up,
down), row count and thread count: F.linear with the dense bf16 weight; `aten`, torch's
small-M int4 kernel (`torch._weight_int4pack_mm_for_cpu`, the fallback); `gemv`, the
native decode GEMV (pdserve/engine/kernels/_int4_gemv.c, up to 4 rows); `vnni`, the GEMV's arithmetic
in register tiles over many rows (pdserve/engine/kernels/_int4_tiles.c, the GEMM of CPUs without AMX);
`dequant`, unpack the whole weight with `pd_int4_dequant`, then F.linear; and `native`, the
AMX kernel (pdserve/engine/kernels/_int4_gemm.c). `auto` is what `Int4Linear` runs for that row count
(its `route` from pdserve/engine/kernels/table.py). Prints the median time of bf16 and each path's ratio
to it, then the same times as ratios to aten, all measured in the same run, interleaved per
repetition (the host may be shared: compare ratios, not absolute times). A layer called
again and again is served from the CPU caches: `python -m bench.quant` times decode end to end.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import harness
from bench.int8_gemm import SHAPES
from pdserve.engine.quant import int4_kernel
from pdserve.engine.quant.linear import Int4Linear, quantize_weight

PATHS = ("aten", "gemv", "vnni", "dequant", "native", "auto")
VS_ATEN = ("gemv", "vnni", "dequant", "native", "auto")


def _layer(n: int, k: int) -> Int4Linear:
    g = torch.Generator().manual_seed(n * 31 + k)
    layer = quantize_weight((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16), "int4")
    assert isinstance(layer, Int4Linear)
    return layer


def _row(n: int, k: int, m: int, reps: int) -> dict[str, float]:
    """Median seconds of bf16 and each path on an [m, k] input and an [n, k] weight."""
    layer = _layer(n, k)
    dense = layer.dense_weight(torch.bfloat16)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    packed, sz, group = layer.packed, layer.scales_and_zeros, layer.group
    paths: dict[str, Callable[[], object]] = {
        "bf16": lambda: F.linear(x, dense),
        "aten": lambda: torch._weight_int4pack_mm_for_cpu(x, packed, group, sz),
    }
    if int4_kernel.gemv_available() and m <= int4_kernel.GEMV_ROWS:
        paths["gemv"] = lambda: int4_kernel.gemv(x, packed, sz, group)
    if int4_kernel.tiles_available():
        paths["vnni"] = lambda: int4_kernel.tiles(x, packed, sz, group)
    if int4_kernel.available():
        paths["native"] = lambda: int4_kernel.matmul(x, packed, sz, group)
    paths["auto"] = lambda: layer(x)
    paths["dequant"] = lambda: F.linear(x, layer.dense_weight(torch.bfloat16))  # writes a dense weight: last
    return harness.medians(paths, reps)  # the warm-up round: first-call allocations, caches


def _route(n: int, k: int, m: int) -> str:
    return _layer(n, k).plan(torch.bfloat16).kernel_for(m).name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5, 8, 16, 32, 128, 512])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not int4_kernel.available():
        print("AMX int4 kernel unavailable (no library, AMX-BF16 or AVX-512 VBMI): no `native` column")
    if not int4_kernel.tiles_available():
        print("int4 VNNI GEMM unavailable (no library, AVX-512 VNNI, VBMI or BF16): no `vnni` column")
    keys = (("threads", 7), ("N x K", 10), ("M", 4), ("route", 14))
    table = harness.RatioTable(keys, PATHS)
    print(f"{harness.machine_line()}\n{table.header()}")
    measured = []
    for threads, m, n, k in harness.sweep(args.threads, args.rows, SHAPES):
        key, times = (threads, f"{n}x{k}", m, _route(n, k, m)), _row(n, k, m, args.reps)
        measured.append((key, times))
        print(table.row(key, times), flush=True)
    vs_aten = harness.RatioTable(keys, VS_ATEN, base="aten")
    print(f"\nthe same times against aten's int4 kernel (< 1: faster than aten)\n{vs_aten.header()}")
    for key, times in measured:
        print(vs_aten.row(key, times))


if __name__ == "__main__":
    main()
