"""Per-layer timing of the int8 weight matmul paths against the bf16 matmul, one run.

    python -m bench.int8_gemm [--threads 1 2] [--rows 1 2 4 16 32 128] [--reps 200] [--step]

For each weight shape [N, K] (the ~125M benchmark model's projections: qkv, o, gate_up,
down), row count and thread count: F.linear with the bf16 weight, the aten int8 kernel
(`torch._weight_int8pack_mm`, up to 16 rows), and each native path of `int8_kernel.PATHS`
(pdserve/engine/quant/int8_kernel.py says which the library picks for which rows): `gemv` (float32
FMA) and `vnni` (integer dot products), up to 4 rows; `amx_rows` (AMX chunk by chunk) and
`amx_q8` (AMX on int8 tiles), up to 16 rows; `dpbf16` (AVX-512 BF16 dot products); `amx`;
and `auto` (the library's pick, with the Python call around it, as a layer runs it).
Prints the median time of each and its ratio to bf16, the paths taking turns after a
warm-up (the host may be shared: compare ratios, not absolute times). A single
layer called again and again is served from the CPU caches; a decode step streams 12
layers of distinct weights (~75 MB int8, ~150 MB bf16) from memory, so `--step` also
times whole passes over 12 distinct copies of the four layers, bf16 against each path, and
prints a second line of each path against the bf16 GEMV (pdserve/engine/kernels/bf16_gemv.py, what bf16
decode runs for 1-16 rows): int8 reads half its bytes, so ~0.5 is the floor there.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import harness
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.quant import int8_kernel
from pdserve.engine.quant.pack import quantize_int8

SHAPES = ((1280, 768), (768, 768), (4096, 768), (768, 2048))  # 125M: qkv, o, gate_up, down
LAYERS = 12
PATHS = ("aten_int8", "gemv", "vnni", "dpbf16", "amx", "amx_rows", "amx_q8", "auto")


def _runs(code: int, m: int) -> bool:
    amx = code in (int8_kernel.AMX, int8_kernel.AMX_ROWS, int8_kernel.AMX_Q8)
    return ((code not in (int8_kernel.GEMV, int8_kernel.VNNI) or m <= 4) and (code not in (int8_kernel.AMX_ROWS, int8_kernel.AMX_Q8) or m <= 16)
            and (not amx or int8_kernel.amx_available()))


def _row(n: int, k: int, m: int, reps: int) -> dict[str, float]:
    """Median seconds of bf16 and each path on an [m, k] input and an [n, k] weight."""
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    parts = quantize_int8(w)
    q, s16 = parts.q.contiguous(), parts.scales.to(torch.bfloat16)
    w16 = (q.float() * s16.float()[:, None]).to(torch.bfloat16)
    packed = int8_kernel.pack(q, s16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    paths: dict[str, Callable[[], object]] = {"bf16": lambda: F.linear(x, w16)}
    if m <= 16:
        paths["aten_int8"] = lambda: torch._weight_int8pack_mm(x, q, s16)
    if int8_kernel.available():
        for name, code in int8_kernel.PATHS.items():
            if _runs(code, m):
                paths[name] = lambda code=code: int8_kernel.matmul(x, packed, code)  # type: ignore[misc]
        paths["auto"] = lambda: int8_kernel.matmul(x, packed)
    return harness.medians(paths, reps, warmup=max(5, reps // 10))


def _step(m: int, reps: int, table: harness.RatioTable) -> str:
    """Median time of one pass over LAYERS x SHAPES distinct layers, bf16 and each path."""
    g = torch.Generator().manual_seed(m)
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            parts = quantize_int8(torch.randn(n, k, generator=g) * 0.05)
            w16 = (parts.q.float() * parts.scales.float()[:, None]).to(torch.bfloat16)
            layers.append((w16, int8_kernel.pack(parts.q, parts.scales), torch.randn(m, k, generator=g).bfloat16()))
    passes: dict[str, Callable[[], object]] = {"bf16": lambda: [F.linear(x, w) for w, _, x in layers]}
    if bf16_gemv.available() and m <= 16:
        passes["bf16_gemv"] = lambda: [bf16_gemv.linear(x, w) for w, _, x in layers]
    if int8_kernel.available():
        for name, code in int8_kernel.PATHS.items():
            if _runs(code, m):
                passes[name] = lambda code=code: [int8_kernel.matmul(x, p, code) for _, p, x in layers]  # type: ignore[misc]
        passes["auto"] = lambda: [int8_kernel.matmul(x, p) for _, p, x in layers]
    med = harness.medians(passes, reps, warmup=5)
    line = table.row((torch.get_num_threads(), "step x12", m), med, fmt="8.0f")
    if "bf16_gemv" in med:
        line += "\n" + table.row(("", "vs GEMV", m), med, base="bf16_gemv", fmt="8.0f")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 32, 128])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--step", action="store_true", help="also time passes over 12 layers of distinct weights")
    args = ap.parse_args()
    if not int8_kernel.available():
        print("native int8 kernel unavailable (no library or no AVX-512 BF16): torch paths only")
    table = harness.RatioTable((("threads", 7), ("N x K", 10), ("M", 4)), PATHS, width=9)
    print(f"{harness.machine_line()}\n{table.header()}")
    for threads in args.threads:
        for _, m, n, k in harness.sweep([threads], args.rows, SHAPES):
            print(table.row((threads, f"{n}x{k}", m), _row(n, k, m, args.reps)), flush=True)
        if args.step:
            for m in args.rows:
                print(_step(m, max(3, args.reps // 20), table))


if __name__ == "__main__":
    main()
