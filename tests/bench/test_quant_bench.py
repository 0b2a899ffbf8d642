"""bench/quant.py runs every scheme on one model and prints ratios against bf16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.quant import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_quick_run_prints_one_row_per_scheme(tiny_model_dir: Callable[..., Path]) -> None:
    table = main(["--quick", "--model", str(tiny_model_dir("llama"))]).splitlines()
    assert [line.split("|")[0].strip() for line in table[1:]] == ["bf16", "int8", "int4"]
    bf16 = table[1].split()
    assert bf16[bf16.index("|") + 2] == "1.00"  # bf16 against itself
    for line in table[1:]:
        numbers = [float(x) for x in line.replace("|", " ").split()[1:]]
        assert len(numbers) == 6 and all(x > 0 for x in numbers)


def test_moe_bench_runs_every_scheme_on_a_moe_model(tiny_model_dir: Callable[..., Path]) -> None:
    from bench.moe_quant import main as moe_main

    table = moe_main(["--quick", "--model", str(tiny_model_dir("mixtral"))]).splitlines()
    assert [line.split("|")[0].strip() for line in table[1:]] == ["bf16", "int8", "int4"]
