"""Workload generation: lengths, shared prefixes, datasets, exact token sizing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.loadgen.config import LenDistribution, MixedConfig, WorkloadConfig, WorkloadKind
from pdserve.loadgen.prompts import WORDS, TokenCounter, make_prompt
from pdserve.loadgen.workloads import LONG_PROMPT_TAG, Workload, sample_len


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE tokenizer (GPT-2 style spaces) trained on the spot."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = np.random.default_rng(0)
    # Only some words get enough merges to become single tokens: exercises the filter.
    lines = [" ".join(rng.choice(WORDS[:120], 12)) for _ in range(400)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    d = tmp_path_factory.mktemp("tok")
    tok.save(str(d / "tokenizer.json"))
    return d


def test_fixed_lengths_without_tokenizer() -> None:
    w = Workload(WorkloadConfig(input_len=50, output_len=7, seed=1))
    specs = w.take(5)
    assert all(len(s.prompt.split()) == 50 and s.prompt_tokens_est == 50 for s in specs)
    assert all(s.max_tokens == 7 for s in specs)
    assert len({s.prompt for s in specs}) == 5  # unique prompts: no accidental prefix hits
    again = Workload(WorkloadConfig(input_len=50, output_len=7, seed=1)).take(5)
    assert [s.prompt for s in again] == [s.prompt for s in specs]


def test_length_distributions() -> None:
    rng = np.random.default_rng(0)
    uni = [sample_len(100, LenDistribution.UNIFORM, 0.5, rng) for _ in range(500)]
    assert min(uni) >= 50 and max(uni) <= 150 and 90 < float(np.mean(uni)) < 110
    norm = [sample_len(100, LenDistribution.NORMAL, 0.1, rng) for _ in range(500)]
    assert 95 < float(np.mean(norm)) < 105
    expo = [sample_len(100, LenDistribution.EXPONENTIAL, 0.0, rng) for _ in range(500)]
    assert min(expo) >= 1 and 80 < float(np.mean(expo)) < 120
    assert sample_len(3, LenDistribution.FIXED, 0.5, rng) == 3


def test_shared_prefix_workload() -> None:
    cfg = WorkloadConfig(kind=WorkloadKind.SHARED_PREFIX, shared_prefix_len=64, input_len=8)
    specs = Workload(cfg).take(4)
    prefix = specs[0].messages[0]["content"]  # type: ignore[index]
    assert len(prefix.split()) == 64
    assert all(s.prompt.startswith(prefix + " ") for s in specs)
    assert all(s.messages and s.messages[0]["role"] == "system" for s in specs)
    assert len({s.prompt for s in specs}) == 4
    assert all(s.prompt_tokens_est == 72 for s in specs)


def test_mixed_workload_long_prompts() -> None:
    cfg = WorkloadConfig(
        kind=WorkloadKind.MIXED,
        input_len=8,
        output_len=200,
        mixed=MixedConfig(long_prompt_len=300, long_prompt_output_len=4),
    )
    w = Workload(cfg)
    assert w.has_long_prompts
    assert w.next().tag == "decode" and w.next().max_tokens == 200
    long = w.next_long_prompt()
    assert long.tag == LONG_PROMPT_TAG and long.max_tokens == 4 and long.prompt_tokens_est == 300


def test_dataset_workload(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "hello there", "max_tokens": 3},
        {"messages": [{"role": "user", "content": "hi"}]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    w = Workload(WorkloadConfig(kind=WorkloadKind.DATASET, dataset_path=str(path), output_len=9))
    a, b, c = w.take(3)
    assert (a.prompt, a.max_tokens) == ("hello there", 3)
    assert b.chat_messages() == [{"role": "user", "content": "hi"}] and b.max_tokens == 9
    assert c.prompt == a.prompt  # cycled
    path.write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match=":1:"):
        Workload(WorkloadConfig(kind=WorkloadKind.DATASET, dataset_path=str(path)))


def test_exact_token_sizing_with_tokenizer(tokenizer_dir: Path) -> None:
    counter = TokenCounter(str(tokenizer_dir))
    assert 0 < len(counter.single_token_words) < len(WORDS)
    rng = np.random.default_rng(3)
    for n in (1, 2, 17, 256, 1500):
        p = make_prompt(n, rng, counter)
        assert p.exact and p.tokens == n == counter.count(p.text)
    cfg = WorkloadConfig(
        kind=WorkloadKind.SHARED_PREFIX,
        shared_prefix_len=100,
        input_len=20,
        tokenizer_dir=str(tokenizer_dir),
    )
    spec = Workload(cfg, counter).next()
    assert spec.prompt_tokens_est == counter.count(spec.prompt)
    assert abs(spec.prompt_tokens_est - 120) <= 1


def test_missing_tokenizer_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        TokenCounter(str(tmp_path))


def test_a_word_level_tokenizer_gets_prompts_of_distinct_tokens(tmp_path: Path) -> None:
    """bench/README.md's vs-vLLM model has a word-level tokenizer over w0..wN: every English
    word of WORDS is its one unknown token. Prompts then come from its own vocabulary, so
    two random prompts are not the same prompt (which would be a prefix-cache hit)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<unk>", *(f"w{i}" for i in range(2000))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter(str(tmp_path))
    assert len(counter.single_token_words) >= 64 and "the" not in counter.single_token_words
    rng = np.random.default_rng(0)
    a, b = (counter.encode(make_prompt(1500, rng, counter).text) for _ in range(2))
    assert len(a) == len(b) == 1500 and a != b and 0 not in a and len(set(a)) > 500
