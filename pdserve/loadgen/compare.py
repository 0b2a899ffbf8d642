"""Side-by-side tables with ratios, for the benchmark drivers in `bench/*.py`."""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: a header, a path into a run summary, and a unit scale."""

    header: str
    path: tuple[str, ...]
    scale: float = 1000.0  # seconds -> ms by default
    fmt: str = ".1f"

    def value(self, summary: dict[str, Any]) -> float | None:
        node: Any = summary
        for key in self.path:
            if not isinstance(node, dict) or node.get(key) is None:
                return None
            node = node[key]
        return float(node) * self.scale


@dataclasses.dataclass(frozen=True)
class Target:
    """`numerator / denominator` of column `header` must be <= or >= `bound`."""

    header: str
    bound: float
    at_most: bool = True

    def check(self, ratio: float | None) -> str:
        if ratio is None:
            return "n/a"
        ok = ratio <= self.bound if self.at_most else ratio >= self.bound
        return f"{'MET' if ok else 'MISSED'} ({ratio:.3f} {'<=' if self.at_most else '>='} {self.bound})"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def format_comparison(
    columns: Sequence[Column],
    rows: Sequence[tuple[str, dict[str, Any]]],
    ratio_rows: Sequence[tuple[str, str, str]] = (),
) -> str:
    """Rows of summaries, then `label = numerator_row / denominator_row` ratio rows."""
    width = max([12, *(len(label) for label, _ in rows), *(len(r[0]) for r in ratio_rows)])
    head = f"{'':<{width}}" + "".join(f"{c.header:>14}" for c in columns)
    lines = [head, "-" * len(head)]
    values = {label: [c.value(s) for c in columns] for label, s in rows}
    for label, _ in rows:
        cells = (
            ("-" if v is None else format(v, c.fmt))
            for c, v in zip(columns, values[label], strict=True)
        )
        lines.append(f"{label:<{width}}" + "".join(f"{x:>14}" for x in cells))
    for label, num, den in ratio_rows:
        rs = [ratio(a, b) for a, b in zip(values[num], values[den], strict=True)]
        lines.append(
            f"{label:<{width}}" + "".join(f"{'-' if r is None else f'{r:.3f}':>14}" for r in rs)
        )
    return "\n".join(lines)


def column_ratio(
    columns: Sequence[Column], header: str, num: dict[str, Any], den: dict[str, Any]
) -> float | None:
    col = next(c for c in columns if c.header == header)
    return ratio(col.value(num), col.value(den))


def split_args(text: str) -> list[str]:
    return shlex.split(text)
