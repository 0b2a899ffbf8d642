"""PNG report (matplotlib, Agg backend): TTFT and ITL CDFs for every run and,
for a sweep, output throughput against TTFT p50 and TPOT p50.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.loadgen.metrics import itls, ttft
from pdserve.loadgen.runner import BenchResult


def _cdf(ax, values: Sequence[float], label: str) -> None:  # type: ignore[no-untyped-def]
    xs = sorted(v * 1000 for v in values)
    if not xs:
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=label)


def write_png(result: BenchResult, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot
    import matplotlib.pyplot as plt

    sweep = len(result.runs) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 2, figsize=(12, 9 if sweep else 4.5), squeeze=False)
    ax_ttft, ax_itl = axes[0]
    for run in result.runs:
        done = [r for r in run.records if r.ok]
        _cdf(ax_ttft, [t for r in done if (t := ttft(r)) is not None], run.label)
        _cdf(ax_itl, [x for r in done for x in itls(r)], run.label)
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "ITL")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    if sweep:
        _sweep_curves(axes[1], result)
    fig.suptitle(f"pdserve bench: {result.model}")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def _sweep_curves(axes, result: BenchResult) -> None:  # type: ignore[no-untyped-def]
    """Throughput vs latency: one point per concurrency, annotated with it."""
    for ax, key, name in ((axes[0], "ttft", "TTFT p50"), (axes[1], "tpot", "TPOT p50")):
        pts = [
            (run.summary[key]["p50"], run.summary["output_throughput"], run.label)
            for run in result.runs
            if run.summary[key]["p50"] is not None and run.summary["output_throughput"] is not None
        ]
        if pts:
            ax.plot([p[0] * 1000 for p in pts], [p[1] for p in pts], marker="o")
            for x, y, label in pts:
                ax.annotate(
                    label,
                    (x * 1000, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize="small",
                )
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"throughput vs {name}")
        ax.grid(alpha=0.3)
