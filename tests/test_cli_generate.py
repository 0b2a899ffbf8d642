"""`pdserve make-model` and `pdserve generate`: the single-process reference, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_builtin_model, write_default_model
from pdserve.cli import main
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "Once upon a time, 你好 🚀"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("dm"))


def _direct(model_dir: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), cache=CacheConfig(num_blocks=64)))
    return [list(c.token_ids) for r in engine.generate(prompts, params) for c in r.choices]


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_generate_subprocess_matches_engine_and_default_model(tmp_path: Path) -> None:
    env = {**os.environ, "PDSERVE_HOME": str(tmp_path / "home"), "PDSERVE_BUILTIN_WEIGHTS": "trained"}
    base = [sys.executable, "-m", "pdserve", "generate", "--json", "--max-tokens", "12", *PROMPTS]
    # No --model: the default (trained) model is assembled on first use under PDSERVE_HOME ...
    out = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    records = _json_lines(out.stdout)
    assert (tmp_path / "home" / "models" / "pdserve-tiny-llama" / "model.safetensors").is_file()
    # ... and it is the model write_builtin_model assembles, so the engine run directly agrees.
    model_dir = write_builtin_model(tmp_path / "trained")
    tok = Tokenizer.from_model_dir(model_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    expected = _direct(model_dir, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [r["prompt_token_ids"] for r in records] == prompts
    assert [r["token_ids"] for r in records] == expected
    assert all(len(r["token_ids"]) == 12 or r["finish_reason"] == "stop" for r in records)
    assert [r["text"] for r in records] == [tok.decode(ids) for ids in expected]


def test_generate_text_output_and_seeded_sampling(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--max-tokens",
        "10",
        "--temperature",
        "0.9",
        "--seed",
        "7",
        "--n",
        "2",
        "--json",
        PROMPTS[0],
    ]
    assert main(argv) == 0
    records = _json_lines(capsys.readouterr().out)
    tok = Tokenizer.from_model_dir(model_dir)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=7, n=2)
    expected = _direct(model_dir, [tok.encode(PROMPTS[0])], params)
    assert [r["token_ids"] for r in records] == expected
    assert [r["index"] for r in records] == [0, 1]
    assert main(argv[:-2] + [PROMPTS[0]]) == 0  # plain text: one line per choice
    lines = capsys.readouterr().out.splitlines()
    assert lines == [tok.decode(ids) for ids in expected]


def test_generate_chat_uses_template(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--chat",
        "--system",
        "Be brief.",
        "--max-tokens",
        "4",
        "--json",
        "Hi",
    ]
    assert main(argv) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    tok = Tokenizer.from_model_dir(model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert record["prompt_token_ids"] == tok.encode_chat(msgs)
    assert record["prompt_token_ids"].count(tok.bos_token_id) == 1


def test_generate_rejects_bad_params(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(model_dir), "--max-tokens", "0", "x"]) == 2
    assert "--max-tokens" in capsys.readouterr().err


def test_make_model_cli(model_dir: Path, tmp_path: Path) -> None:
    from pdserve.builtin.default_model import DRAFT

    def weights(d: Path) -> bytes:
        return (d / "model.safetensors").read_bytes()

    out = tmp_path / "m"
    assert main(["make-model", str(out)]) == 0  # the trained model
    assert weights(out) == weights(write_builtin_model(tmp_path / "trained"))
    assert main(["make-model", "--draft", str(tmp_path / "d")]) == 0
    assert weights(tmp_path / "d") == weights(write_builtin_model(tmp_path / "draft", DRAFT))
    assert main(["make-model", "--random", str(tmp_path / "r")]) == 0
    assert weights(tmp_path / "r") == weights(model_dir)
    assert main(["make-model", str(out)]) == 1  # refuses to overwrite
    (out / "stray.txt").write_text("x")
    assert main(["make-model", "--force", str(out)]) == 0
    assert not (out / "stray.txt").exists() and (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_generate_quantized_matches_the_quantized_engine(
    model_dir: Path, capsys: pytest.CaptureFixture[str], scheme: str
) -> None:
    argv = ["generate", "--model", str(model_dir), "--json", "--max-tokens", "8", "--ignore-eos", PROMPTS[0]]
    assert main([*argv, "--quantization", scheme]) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), quantization=scheme, cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert record["token_ids"] == list(engine.generate([record["prompt_token_ids"]], params)[0].token_ids)
