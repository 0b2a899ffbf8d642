"""generation_config.json, read once (pdserve/common/generation_config.py) for the engine's EOS ids,
the gateway's tokenizer and the gateway's sampling defaults (vLLM's --generation-config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.tokenizer import Tokenizer, TokenizerError
from pdserve.builtin.default_model import write_default_model
from pdserve.cli import build_parser
from pdserve.cli.args import UsageError, model_dir
from pdserve.cli.gateway_options import sampling_defaults
from pdserve.cli.up import _gateway_cmd
from pdserve.common.generation_config import (
    GenerationConfigError,
    SamplingDefaults,
    parse_generation_config,
    read_generation_config,
)
from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError

LLAMA3_INSTRUCT = {  # Meta-Llama-3.1-8B-Instruct's file
    "bos_token_id": 128000, "do_sample": True, "eos_token_id": [128001, 128008, 128009],
    "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.42.3",
}


def test_sampling_defaults_are_the_files_non_default_values() -> None:
    g = parse_generation_config(LLAMA3_INSTRUCT)
    assert g.eos_token_ids == (128001, 128008, 128009) and g.bos_token_id == 128000
    assert g.defaults == SamplingDefaults(temperature=0.6, top_p=0.9)
    assert g.defaults.as_dict() == {"temperature": 0.6, "top_p": 0.9}

    g = parse_generation_config({"eos_token_id": 2, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
                                 "max_new_tokens": 32, "do_sample": False})
    assert g.eos_token_ids == (2,)
    # max_new_tokens is not a max_tokens default; do_sample is ignored (as vLLM does).
    assert g.defaults.as_dict() == {"top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}


def test_transformers_own_defaults_set_nothing() -> None:
    # vLLM reads GenerationConfig.to_diff_dict(): top_k 50 is transformers' default, not a choice.
    g = parse_generation_config({"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0})
    assert g.defaults == SamplingDefaults() and g.defaults.as_dict() == {}
    assert parse_generation_config({}).eos_token_ids == ()


@pytest.mark.parametrize(("raw", "message"), [
    ({"temperature": "0.7"}, "temperature must be a number"),
    ({"temperature": -0.5}, "temperature -0.5 is out of range"),
    ({"top_p": 0}, "top_p 0.0 is out of range"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"eos_token_id": [1, "x"]}, "eos_token_id must be a token id"),
])
def test_bad_values_are_errors_naming_the_file_and_field(raw: dict[str, object], message: str) -> None:
    with pytest.raises(GenerationConfigError, match=message) as e:
        parse_generation_config(raw, "/m/generation_config.json")
    assert str(e.value).startswith("/m/generation_config.json: ")


def test_engine_tokenizer_and_cli_read_the_same_file(tmp_path: Path) -> None:
    d = write_default_model(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({**LLAMA3_INSTRUCT, "eos_token_id": [4, 1, 9],
                                                          "bos_token_id": 0}))
    assert read_generation_config(d).eos_token_ids == (4, 1, 9)
    assert ModelConfig.from_hf_dir(d).eos_token_ids == (4, 1, 9)
    assert set(Tokenizer.from_model_dir(d).eos_token_ids) == {4, 1, 9}
    assert sampling_defaults("auto", d) == SamplingDefaults(temperature=0.6, top_p=0.9)
    assert sampling_defaults("vllm", d) == SamplingDefaults()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 3}))
    assert sampling_defaults(str(other), d) == SamplingDefaults(top_k=3)
    with pytest.raises(UsageError, match="--generation-config: expected auto, vllm or a directory"):
        sampling_defaults(str(tmp_path / "missing"), d)

    # A bad sampling value stops only the reader that applies it (the gateway's --generation-config).
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [4], "temperature": "hot"}))
    assert ModelConfig.from_hf_dir(d).eos_token_ids == (4,) and Tokenizer.from_model_dir(d).eos_token_ids == (4,)
    with pytest.raises(UsageError, match="--generation-config: .*temperature must be a number"):
        sampling_defaults("auto", d)
    assert sampling_defaults("vllm", d) == SamplingDefaults()

    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ModelConfigError, match="eos_token_id"):
        ModelConfig.from_hf_dir(d)
    with pytest.raises(TokenizerError, match="eos_token_id"):
        Tokenizer.from_model_dir(d)
    (d / "generation_config.json").unlink()  # no file: config.json's eos id
    assert read_generation_config(d).eos_token_ids == ()
    assert ModelConfig.from_hf_dir(d).eos_token_ids == (1, 4)  # the built-in model's config.json


def test_up_passes_served_names_and_generation_config_to_the_gateway(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--served-model-name", "org/m", "m", "--generation-config", "vllm"])
    cmd = _gateway_cmd(args, 5555)
    i = cmd.index("--served-model-name")
    assert cmd[i + 1 : i + 3] == ["org/m", "m"] and cmd[cmd.index("--generation-config") + 1] == "vllm"
    gateway_args = build_parser().parse_args(cmd[cmd.index("gateway"):])
    assert gateway_args.served_model_name == ["org/m", "m"] and gateway_args.generation_config == "vllm"
    cmd = _gateway_cmd(build_parser().parse_args(["up", "--generation-config", str(tmp_path)]), 5555)
    assert cmd[cmd.index("--generation-config") + 1] == str(tmp_path.resolve())
    assert "--served-model-name" not in cmd


@pytest.mark.parametrize(("argv", "message"), [
    (["--served-model-name", "a", "a"], "--served-model-name: expected distinct non-empty names"),
    (["--served-model-name", " "], "--served-model-name: expected distinct non-empty names"),
    (["--generation-config", "/nonexistent"], "--generation-config: expected auto, vllm or a directory"),
])
def test_bad_served_names_and_generation_config_are_refused_before_starting(
    argv: list[str], message: str
) -> None:
    from pdserve.cli import gateway, up
    from pdserve.common.hosts import free_port

    with pytest.raises(UsageError, match=message):
        up.check_args(build_parser().parse_args(["up", "--port", str(free_port()), *argv]))
    args = build_parser().parse_args(["gateway", "--port", "0", *argv])
    with pytest.raises(UsageError, match=message):  # what `pdserve gateway` runs before it binds
        gateway.check_args(args)
        sampling_defaults(args.generation_config, model_dir(args.model))
