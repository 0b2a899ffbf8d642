"""`bench/quality.py` on a tiny slice of the held-out text: one markdown table, the
reference against itself exact, bfloat16 close but measurably different."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bench import moe_model, quality
from pdserve.builtin.default_model import write_builtin_model
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.runner.model_runner import ModelRunner


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("trained"))


def _table(out: str) -> dict[str, list[str]]:
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    assert lines[0].startswith("| scheme | tokens | top-1 agreement | mean KL |"), out
    assert set(lines[1]) <= set("|-: "), out
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:])}


def test_quality_table_on_a_tiny_slice(trained: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(trained), "--tokens", "96", "--rows", "3", "--threads", "1"]
    assert quality.main(argv) == 0
    rows = _table(capsys.readouterr().out)
    assert set(rows) == set(quality.SCHEMES) >= {"float32", "bfloat16"}
    tokens, agree, kl, ref_ppl, ppl = rows["float32"]
    assert (tokens, agree, kl) == ("96", "100.00%", "0.00e+00") and ppl == ref_ppl
    tokens, agree, kl, bf_ref_ppl, bf_ppl = rows["bfloat16"]
    assert bf_ref_ppl == ref_ppl  # one reference for every row
    assert float(agree.rstrip("%")) >= 90.0
    assert 0.0 < float(kl) < 0.05  # a real, small difference
    assert float(ref_ppl) < 8.0  # the held-out text is what the model learned


def test_schemes_are_engine_config_overrides() -> None:
    base = EngineConfig(model_dir="m")
    got = quality.with_overrides(base, {"dtype": "bfloat16", "cache.block_size": 8})
    assert (got.dtype, got.cache.block_size, got.model_dir) == ("bfloat16", 8, "m")
    with pytest.raises(ValueError, match="no field 'nope'"):
        quality.with_overrides(base, {"nope": 1})
    with pytest.raises(ValueError, match="CacheConfig has no field 'nope'"):
        quality.with_overrides(base, {"cache.nope": 1})


def test_unknown_scheme_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        quality.main(["--schemes", "int3"])
    assert e.value.code == 2 and "unknown scheme" in capsys.readouterr().err


def test_a_trained_mixtral_quantizes_and_runs(tmp_path: Path) -> None:
    """bench/moe_model.py's Mixtral (two training steps) loads into the engine's MoE
    family, its experts take the int8 and int4 weights, and the quality rows come out."""
    schedule = dataclasses.replace(moe_model.SCHEDULE, steps=2, seq_len=32)
    record = moe_model.train_moe(tmp_path, schedule, split="heldout")  # the small split: quick
    assert record["steps"] == 2 and record["heldout_loss"] > 0
    config = EngineConfig(model_dir=str(tmp_path), quantization="int4", num_threads=1,
                          cache=CacheConfig(num_blocks=8))
    expert = ModelRunner(config).model.layers[0].mlp.experts[0]
    assert not isinstance(expert.gate_up_weight, torch.nn.Parameter)  # a quantized layer
    rows = quality.measure(tmp_path, {n: quality.SCHEMES[n] for n in ("int8 weights", "int4 weights",
                                                                        "fp8 KV")}, rows=2, length=8)
    assert [r.tokens for r in rows] == [16, 16, 16]
    assert all(r.mean_kl > 0 and r.top1_agreement > 0.5 for r in rows)
