"""KV handoff between tensor x pipeline layouts through real processes: every pair of
a representative grid (plain and TP 2 x PP 2 on each side; bench/layout_pairs.py runs
all 16 pairs of TP, PP in {1, 2}) generates what the single-process engine does."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import Reference
from tests.e2e.layout_grid import LayoutGrid

PROMPTS = ["The quick brown fox", "Once upon a time in a land"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LayoutGrid]:
    g = LayoutGrid(tmp_path_factory.mktemp("layout_pairs"), ["tp1", "tp2pp2"], ["tp1", "tp2pp2"])
    try:
        g.start()
        yield g
    finally:
        g.stop()


@pytest.mark.parametrize(("prefill", "decode"), [
    ("tp1", "tp2pp2"), ("tp2pp2", "tp1"), ("tp2pp2", "tp2pp2"), ("tp1", "tp1")])
def test_pair_generates_the_engines_tokens(grid: LayoutGrid, reference: Reference, prefill: str,
                                           decode: str) -> None:
    for prompt in PROMPTS:
        body = {"model": reference.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        want = reference.generate(reference.completion_ids(prompt), max_tokens=MAX_TOKENS, temperature=0.0,
                                  ignore_eos=True)[0]
        assert grid.complete(prefill, decode, body) == reference.text(want), (prefill, decode, prompt)
    grid.wait_idle()
