"""bench/tp_collectives.py runs a real 2-rank gloo group and reports every figure."""

from __future__ import annotations

import json

import pytest

from bench.tp_collectives import main


def test_reports_all_reduce_broadcast_and_lm_head_costs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--tp", "2", "--hidden", "64", "--tokens", "1", "4", "--vocab", "256"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["hidden"], r["tokens"]) for r in rows] == [(64, 1), (64, 4)]
    for r in rows:
        assert r["tp"] == 2 and r["per_layer_us"] == pytest.approx(2 * r["all_reduce_us"], abs=0.11)
        assert min(r["all_reduce_us"], r["step_broadcast_us"], r["lm_head_replicated_us"],
                   r["lm_head_vocab_parallel_us"]) > 0
