"""bench/models.py: `--model shape:NAME` stands for a random-weight Llama of that shape,
written once under $PDSERVE_BENCH_MODELS and reused, and every bench path (the
model dir, the tokenizer, `pdserve up --model`) resolves it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import harness, models
from pdserve.builtin.random_model import DefaultModelSpec

TINY = DefaultModelSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture
def tiny_shapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(models, "SHAPES", {**models.SHAPES, "tiny": TINY})
    monkeypatch.setenv("PDSERVE_BENCH_MODELS", str(tmp_path))
    return tmp_path


def test_a_named_shape_is_written_once_and_every_bench_path_resolves_it(tiny_shapes: Path) -> None:
    first = Path(harness.model_dir("shape:tiny"))
    assert first.parent == tiny_shapes and first.name.startswith("pdserve-bench-tiny-")
    config = json.loads((first / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (32, 1, 1)
    assert (first / "tokenizer.json").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert harness.model_dir("shape:tiny") == str(first)  # reused, not rewritten
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert harness.up_args("--prefill 1", "shape:tiny") == ["--prefill", "1", "--model", str(first)]
    assert harness.tokenizer_dir(argparse.Namespace(model="shape:tiny")) == str(first)
    assert [p.name for p in tiny_shapes.iterdir()] == [first.name]  # no temp dir left behind


def test_tokens_that_decode_to_no_text_never_win_a_greedy_pick(tiny_shapes: Path) -> None:
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    model = Path(harness.model_dir("shape:tiny"))
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    head = load_file(str(model / "model.safetensors"))["lm_head.weight"]
    zero = {i for i in range(head.shape[0]) if not head[i].any()}
    silent = {i for i in range(head.shape[0]) if not tok.decode([i]).strip() or "\ufffd" in tok.decode([i])}
    assert zero == silent and 0 < len(silent) < head.shape[0] // 2  # byte pieces exist, words win
    assert all(tok.decode([i]).strip() for i in range(head.shape[0]) if i not in zero)


def test_a_directory_passes_through_and_an_unknown_shape_is_refused(tiny_shapes: Path) -> None:
    assert harness.model_dir("/some/model") == "/some/model" and models.resolve(None) is None
    with pytest.raises(ValueError, match="125m"):
        harness.model_dir("shape:nope")
    assert models.SHAPES["125m"].hidden_size == 768 and models.SHAPES["125m"].num_layers == 12
