"""The routes the kernel table (pdserve/engine/kernels/table.py) gives this host's layers.

    python -m bench.kernel_table [--in-features 768] [--out-features 2048] [--group 128]
    PDSERVE_CPU_FEATURES=avx2 python -m bench.kernel_table      # as a CPU without AVX-512

For each op (bf16, int8, int4) at bf16 activations: the row buckets and the kernel each
runs, whether the plan is row-invariant, and every entry of the op with the reason it
cannot take the layer here (none: it can). Nothing is timed.
"""

from __future__ import annotations

from bench import harness
from pdserve.engine.kernels import cpu_features, table
from pdserve.engine.kernels import native as native_kernels


def describe(spec: table.LinearSpec) -> list[str]:
    """One line per route, then one per entry with its reason."""
    plan = table.plan(spec)
    hi = lambda h: "inf" if h >= table.INF else str(h)  # noqa: E731
    lines = [f"{spec.op}: " + ", ".join(f"rows {lo}-{hi(h)} {name}" for lo, h, name in plan.names())
             + (" (row-invariant)" if plan.invariant else "")]
    lines += [f"    {name}: {why or 'can run it'}" for name, why in table.reasons(spec).items()]
    return lines


def main() -> None:
    ap = harness.parser(__doc__, model_help=None)
    ap.add_argument("--in-features", type=int, default=768)
    ap.add_argument("--out-features", type=int, default=2048)
    ap.add_argument("--group", type=int, default=128)
    args = ap.parse_args()
    feats = native_kernels.features()
    print(f"CPU as: {cpu_features.level_of(feats)} ({', '.join(sorted(feats)) or 'baseline'}); "
          f"K {args.in_features}, N {args.out_features}, int4 group {args.group}")
    for op in ("bf16", "int8", "int4"):
        spec = table.LinearSpec(op, "bfloat16", "cpu", args.in_features, args.out_features,
                                args.group if op == "int4" else 0)
        print("\n".join(describe(spec)))


if __name__ == "__main__":
    main()
