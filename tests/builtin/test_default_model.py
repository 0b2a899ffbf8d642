"""The built-in random-weight model (what `PDSERVE_BUILTIN_WEIGHTS=random` serves):
deterministic, loadable by transformers, real BPE; and where the built-in models live."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from pdserve.builtin.default_model import default_model_dir, write_builtin_model
from pdserve.builtin.random_model import DefaultModelSpec
from pdserve.builtin.random_model import write_random_model as write_default_model
from pdserve.builtin.tokenizer import BOS_TOKEN, EOT_TOKEN, train_tokenizer

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _digests(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("default-model"))


def test_two_builds_are_byte_identical(model_dir: Path, tmp_path: Path) -> None:
    again = write_default_model(tmp_path / "again")
    assert _digests(again) == _digests(model_dir)


def test_bpe_training_is_deterministic() -> None:
    a = train_tokenizer(2048).to_str()
    b = train_tokenizer(2048).to_str()
    assert a == b
    assert train_tokenizer(1024).to_str() != a  # the vocab size is real


def test_config_shape(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"]) == (256, 4)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (8, 4)
    assert cfg["tie_word_embeddings"] is False
    assert 2000 <= cfg["vocab_size"] <= 4096
    gen = json.loads((model_dir / "generation_config.json").read_text())
    tcfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert gen["bos_token_id"] == 0 and 4 in gen["eos_token_id"]
    assert tcfg["bos_token"] == BOS_TOKEN and tcfg["eos_token"] == EOT_TOKEN
    assert "add_generation_prompt" in tcfg["chat_template"]


def test_loads_in_transformers_and_runs(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == cfg["vocab_size"]
    # Untied: lm_head is its own tensor, with the wider init.
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    std = model.model.layers[0].self_attn.q_proj.weight.std().item()
    assert 0.018 < std < 0.022
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("The capital of France is")["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(BOS_TOKEN)
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4)


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "café naïve Zürich",
        "你好，世界 東京",
        "launch 🚀 👨‍👩‍👧‍👦 🇯🇵",
        "  spaces\n\ttabs  ",
    ],
)
def test_tokenizer_round_trips_text(model_dir: Path, text: str) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_vocab_has_real_merges_and_multibyte_tokens(model_dir: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
    # Frequent English words are single tokens, not bytes.
    assert len(tok.encode(" the", add_special_tokens=False)) == 1
    assert len(tok.encode(" village", add_special_tokens=False)) == 1
    # Some token decodes to a whole CJK character (3 bytes) ...
    assert len(tok.encode("你好", add_special_tokens=False)) < 6
    # ... and some token holds an incomplete UTF-8 sequence (part of a character).
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert partial


def test_chat_template_renders_in_transformers(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_spec_changes_shape(tmp_path: Path) -> None:
    d = write_default_model(
        tmp_path,
        DefaultModelSpec(
            hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=96
        ),
    )
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (64, 1, 16)


@pytest.mark.parametrize("weights", ["trained", "random"])
def test_default_model_dir_builds_once_and_concurrently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_dir: Path, weights: str
) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PDSERVE_BUILTIN_WEIGHTS", weights)
    with ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(lambda _: default_model_dir(), range(4)))
    models = tmp_path / "home" / "models"
    expected = models / "pdserve-tiny-llama" if weights == "trained" else models / "random" / "pdserve-tiny-llama"
    want = write_builtin_model(tmp_path / "want") if weights == "trained" else model_dir
    assert dirs == [expected] * 4
    assert _digests(expected) == _digests(want)
    # No temporary directories are left behind by the losers of the race.
    assert sorted(p.name for p in expected.parent.iterdir()) == ["pdserve-tiny-llama"]
    # A second call reuses it (no rebuild: the file is not rewritten).
    mtime = (expected / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == mtime


def test_default_model_dir_rebuilds_stale_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path))
    monkeypatch.setenv("PDSERVE_BUILTIN_WEIGHTS", "trained")
    stale = tmp_path / "models" / "pdserve-tiny-llama"
    write_default_model(stale)  # the random model a previous version served here
    assert default_model_dir() == stale
    assert _digests(stale) == _digests(write_builtin_model(tmp_path / "want"))


def test_builtin_weights_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_BUILTIN_WEIGHTS", "fp8")
    with pytest.raises(ValueError, match="PDSERVE_BUILTIN_WEIGHTS must be one of trained, random"):
        default_model_dir()


def test_envs_home_and_declared_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.common import envs

    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "h"))
    assert envs.home() == tmp_path / "h"
    monkeypatch.setenv("PDSERVE_HOME", "")  # empty means unset: the default applies
    assert envs.home() == (Path.home() / ".cache" / "pdserve").resolve()
    monkeypatch.setenv("PDSERVE_LOG_LEVEL", "debug")
    assert envs.log_level() == "DEBUG"
    with pytest.raises(KeyError):
        envs.get("PDSERVE_NO_SUCH_VARIABLE")
