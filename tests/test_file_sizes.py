"""The house plan's size rule (docs/STYLE.md): a source file outside tests stays
within 400 lines; one that grows past that is usually two ideas and is split
along its seam."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "engine", "kv_transfer", "worker", "prefill_node", "decode_node",
            "gateway", "pdserve", "bench")
MAX_LINES = 400


def line_counts() -> dict[str, int]:
    counts = {}
    for package in PACKAGES:
        for f in sorted((ROOT / package).rglob("*.py")):
            counts[f.relative_to(ROOT).as_posix()] = len(f.read_text().splitlines())
    return counts


def test_no_source_file_over_the_line() -> None:
    counts = line_counts()
    assert len(counts) > 100  # the walk found the packages
    over = {p: n for p, n in counts.items() if n > MAX_LINES}
    assert over == {}, f"split these along a seam (at most {MAX_LINES} lines): {over}"
