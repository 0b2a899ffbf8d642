"""Per-layer timing of the native bf16 GEMV (pdserve/engine/kernels/_bf16_gemv.c) against F.linear, one run.

    python -m bench.bf16_gemv [--threads 1] [--rows 1 2 4 8 16] [--reps 15]

For each weight shape [N, K] of the ~125M benchmark model (fused qkv, o, fused gate_up,
down, the LM head) and row count: F.linear (oneDNN), the kernel's AVX-512 BF16 path, its
AMX path and `bf16_gemv.linear` (the library's choice, with the Python hook around it, as
the model calls it). Each timed call is one pass over LAYERS distinct copies of the
weight (the LM head: one), so the weights stream from memory as in a decode step rather
than from the caches. The variants take turns within each repetition, so background load
on a shared host hits all alike: read the ratios to F.linear (and GB/s of weight read),
not absolute times. The first line is one core's read bandwidth on this host (a sum over
a 256 MiB float32 buffer): the floor a weight stream cannot beat.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench import harness
from pdserve.engine.kernels import bf16_gemv

SHAPES = {"qkv": (1280, 768), "o": (768, 768), "gate_up": (4096, 768), "down": (768, 2048),
          "lm_head": (32000, 768)}
LAYERS = 12


def _each(x: torch.Tensor, ws: list[torch.Tensor], path: int) -> list[torch.Tensor]:
    return [bf16_gemv.gemv(x, w, None, path) for w in ws]


def shape_row(n: int, k: int, m: int, reps: int) -> dict[str, float]:
    """Seconds per layer call of each variant for `m` rows."""
    g = torch.Generator().manual_seed(n * 31 + k)
    copies = 1 if n * k > 8_000_000 else LAYERS
    ws = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    fns: dict[str, Callable[[], object]] = {"F.linear": lambda: [F.linear(x, w) for w in ws]}
    if bf16_gemv.available():
        for name, path in bf16_gemv.paths().items():  # those this CPU (as masked) runs
            fns[name] = functools.partial(_each, x, ws, path)
        fns["hook"] = lambda: [bf16_gemv.linear(x, w) for w in ws]
    return {name: t / copies for name, t in harness.medians(fns, reps).items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not bf16_gemv.available():
        print("the native bf16 GEMV is not available here: F.linear only")
    print(f"{harness.machine_line()}\ntorch {torch.__version__}, {args.threads} thread(s), "
          f"one-core read bandwidth {harness.read_bandwidth() / 1e9:.1f} GB/s")
    table = harness.RatioTable((("shape", 8), ("N x K", 11), ("rows", 4)), ("avx", "amx", "hook"),
                               base="F.linear", width=13, gbps=True)
    print(table.header())
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.rows:
            print(table.row((name, f"{n}x{k}", m), shape_row(n, k, m, args.reps), fmt="11.1f", nbytes=n * k * 2))

if __name__ == "__main__":
    main()
