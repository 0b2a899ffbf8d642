"""The trained built-in models: assembled without training, byte-identical, sharing a
tokenizer, and they have learned the corpus (readable greedy English, chat answers that
end their turn, held-out perplexity far below the random model's). They have not learned
to pick the topic a question names: "Tell me about the sea." gets a readable answer about
some topic of the corpus, not necessarily the sea."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.quality import measure
from gateway.tokenizer import Tokenizer
from pdserve.builtin import default_model
from pdserve.builtin.default_model import DRAFT, TRAINED, training_record, write_builtin_model
from pdserve.builtin.random_model import write_random_model
from pdserve.builtin.story_corpus import documents, vocabulary
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2]
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json")


def _digests(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("trained"))


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("draft"), DRAFT)


def _greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32",
                                    cache=CacheConfig(num_blocks=128)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [list(r.token_ids) for r in engine.generate(prompts, params)]


def readable_share(text: str) -> float:
    """The share of `text`'s words that are words of the training corpus."""
    words = [m.lower() for m in re.findall(r"[A-Za-z']+", text)]
    known = vocabulary("train")
    return sum(wd in known for wd in words) / max(1, len(words))


def test_two_assemblies_are_byte_identical(trained: Path, draft: Path, tmp_path: Path) -> None:
    assert _digests(write_builtin_model(tmp_path / "a")) == _digests(trained)
    assert _digests(write_builtin_model(tmp_path / "b", DRAFT)) == _digests(draft)
    assert _digests(trained)["model.safetensors"] != _digests(draft)["model.safetensors"]


def test_the_draft_shares_the_tokenizer_and_is_smaller(trained: Path, draft: Path) -> None:
    assert (draft / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()
    assert (draft / "tokenizer_config.json").read_bytes() == (trained / "tokenizer_config.json").read_bytes()
    big, small = (json.loads((d / "config.json").read_text()) for d in (trained, draft))
    assert (big["hidden_size"], big["num_hidden_layers"], big["num_attention_heads"],
            big["num_key_value_heads"]) == (256, 4, 8, 4)
    assert (small["hidden_size"], small["num_hidden_layers"]) == (128, 2)
    assert small["vocab_size"] == big["vocab_size"] and 1800 <= big["vocab_size"] <= 2048
    assert small["eos_token_id"] == big["eos_token_id"]
    # Both fit the committed-weights budget together.
    size = sum((d / "model.safetensors").stat().st_size for d in (trained, draft))
    assert size <= 25 * 2**20


def test_training_record_is_complete() -> None:
    rec = training_record()
    for name in (TRAINED.weights, DRAFT.weights):
        entry = rec[name]
        assert isinstance(entry, dict)
        assert entry["heldout_loss"] < 2.0 and entry["seconds"] > 0


@pytest.mark.parametrize("model", ["trained", "draft"])
def test_greedy_chat_answer_is_readable_and_ends_its_turn(trained: Path, draft: Path, model: str) -> None:
    d = trained if model == "trained" else draft
    tok = Tokenizer.from_model_dir(d)
    questions = ["Tell me about the sea.", "Can you tell me about rainbows?"]
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions]
    outs = _greedy(d, prompts, 96)
    for q, ids in zip(questions, outs, strict=True):
        text = tok.decode(ids, skip_special_tokens=True)
        assert "\ufffd" not in text, text
        assert ids[-1] in tok.eos_token_ids, f"{q!r} -> {text!r} did not end its turn"
        assert len(text.split()) >= 8 and readable_share(text) >= 0.9, text


def test_greedy_story_continuation_is_readable(trained: Path) -> None:
    tok = Tokenizer.from_model_dir(trained)
    prompts = ["Once upon a time, there was a little girl named", "One rainy day, Ben went to the"]
    outs = _greedy(trained, [tok.encode(p) for p in prompts], 64)
    for ids in outs:
        text = tok.decode(ids, skip_special_tokens=True)
        assert "\ufffd" not in text and len(text.split()) >= 10, text
        assert readable_share(text) >= 0.9, text


def test_heldout_perplexity_is_far_below_the_random_model(trained: Path, tmp_path: Path) -> None:
    # Held-out documents come from seeds the training never used: short chats (greetings,
    # animal sounds) may coincide with training ones, the stories do not.
    train = set(documents("train"))
    held = documents("heldout")
    assert sum(d in train for d in held) <= 0.1 * len(held)
    stories = [d for d in held if len(d.text) > 300]
    assert len(stories) > 100 and not any(d in train for d in stories)
    (learned,) = measure(trained, {"float32": {"dtype": "float32"}}, rows=4, length=64)
    (random,) = measure(write_random_model(tmp_path / "random"), {"float32": {}}, rows=4, length=64)
    assert learned.reference_ppl < 8.0, learned
    assert random.reference_ppl > 50 * learned.reference_ppl, (learned, random)


def test_assembly_is_torch_free(tmp_path: Path) -> None:
    # The gateway resolves the default model too, and never imports torch.
    code = ("import sys; from pathlib import Path; from pdserve.builtin.default_model import DRAFT,"
            " write_builtin_model; write_builtin_model(Path(sys.argv[1]));"
            " write_builtin_model(Path(sys.argv[2]), DRAFT); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t"), str(tmp_path / "d")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    assert (tmp_path / "d" / "model.safetensors").is_file()


def test_tampered_weights_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    copy = tmp_path / "weights"
    shutil.copytree(default_model.BUILTIN_WEIGHTS_DIR, copy)
    raw = bytearray((copy / "tiny-llama.safetensors").read_bytes())
    raw[-1] ^= 1  # one bit of one weight
    (copy / "tiny-llama.safetensors").write_bytes(bytes(raw))
    monkeypatch.setattr(default_model, "BUILTIN_WEIGHTS_DIR", copy)
    with pytest.raises(default_model.BuiltinWeightsError, match="rerun `pdserve train-model`"):
        write_builtin_model(tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written
