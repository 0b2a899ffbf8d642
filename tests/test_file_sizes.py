"""A smell detector, not the house rule: files are split where a concept ends
(tests/test_layering.py checks the folders); a source file far past the style guide's
~400 lines is still worth a look for the seam between two ideas."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "kv_transfer", "prefill_node", "decode_node", "gateway", "bench")
MAX_LINES = 600


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
    assert over == {}, f"two ideas in one file? (over {MAX_LINES} lines): {over}"
