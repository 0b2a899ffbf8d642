"""Tokenizer and chat templates, on the default model and on hand-made templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gateway.chat_template import ChatTemplateError, render_chat_template
from gateway.tokenizer import Tokenizer, TokenizerError
from pdserve.builtin.default_model import write_default_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("default-model"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def test_special_token_facts(tok: Tokenizer) -> None:
    assert tok.bos_token_id == 0
    assert set(tok.eos_token_ids) == {1, 4}  # <|end_of_text|> and <|eot_id|>
    assert tok.eos_token_ids[0] == 4  # tokenizer_config's eos_token comes first
    assert tok.all_special_ids == (0, 1, 2, 3, 4)
    assert tok.vocab_size == 2048
    assert tok.id_to_token(4) == "<|eot_id|>"


@pytest.mark.parametrize("text", ["Hello world", "crème brûlée 🍕", "東京は日本の首都です", ""])
def test_encode_decode_matches_transformers(tok: Tokenizer, model_dir: Path, text: str) -> None:
    hf = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(text)
    assert ids == hf(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text  # BOS skipped
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text


def test_multi_turn_chat_matches_transformers(tok: Tokenizer, model_dir: Path) -> None:
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "  Tell me a joke.  "},
    ]
    hf = AutoTokenizer.from_pretrained(model_dir)
    for gen in (True, False):
        ours = tok.apply_chat_template(msgs, add_generation_prompt=gen)
        assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    text = tok.apply_chat_template(msgs)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "Tell me a joke.<|eot_id|>" in text  # content is trimmed
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    no_gen = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert no_gen.endswith("Tell me a joke.<|eot_id|>")


def test_encode_chat_has_exactly_one_bos(tok: Tokenizer) -> None:
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert tok.bos_token_id is not None
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids[1] == tok.token_to_id("<|start_header_id|>")
    # The special-token strings in the template encode as single special ids.
    assert ids.count(4) == 1


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]
    a = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert a == tok.apply_chat_template([{"role": "user", "content": "Hello world"}])
    with pytest.raises(ChatTemplateError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_template_raise_exception_surfaces(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="Unsupported chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_missing_template_is_a_clear_error(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_model_dir(d)
    assert tok.encode("hi")  # plain encoding still works
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    text = Tokenizer.from_model_dir(d).apply_chat_template([{"role": "user", "content": "yo"}])
    assert text == "<|im_start|>user\nyo<|im_end|>\n<|im_start|>assistant\n"


def test_render_helpers_and_sandbox() -> None:
    tmpl = "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}"
    out = render_chat_template(
        tmpl, [{"role": "user", "content": "é"}], bos_token="<s>", eos_token="</s>"
    )
    assert out == '<s>[{"role": "user", "content": "é"}]</s>'
    # Immutable sandbox: templates cannot mutate their inputs.
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.append(1) }}", [])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])


def test_named_template_list(model_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "m"
    shutil.copytree(model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_model_dir(d).apply_chat_template([]) == "D"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)
