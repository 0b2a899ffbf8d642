"""Prompt text of a given length in tokens, for any server tokenizer.

Prompts are random sequences of common English words. Without a tokenizer, one
word is taken as one token (common words are single tokens in most BPE
vocabularies), and the server's `usage.prompt_tokens` is what gets reported.
With `--tokenizer DIR` (a directory holding `tokenizer.json`), prompts are sized
exactly: the words are restricted to those that encode as one token, and the
text is adjusted until it encodes to the requested count. Counts exclude
special tokens the server may add (a BOS token makes the server's count one
higher).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

_WORD_TEXT = """
    the of and to in is was for on that with as by at from his it an were are which
    this be has had or not but their he new first its after also who they have one
    two been her she time all other into more during there three when out can most
    over some made only used such may year many later then between about city part
    world under where team would state through while four high since these both early
    known well war each against before school used well him five any long them being
    over work found than same life age back area best game group home house land line
    music name people place play power road room side small story way water week year
    day end form head high law left man name old open point public right set show
    south north east west air art bank book car case child club cost data door field
    film fire food free girl gold hand heart hill idea king lake light list love market
    money month night office page paper party plan press rate red river sea season
    sound star street table term test text town tree unit voice wall window word yard
    young blue green black white small large great little good real full short hard
    able ready clear easy fast slow warm cold deep wide dark bright quiet simple
"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_WORD_TEXT.split()))


MIN_DISTINCT_WORDS = 64  # fewer distinct one-token words than this: take them from the vocabulary
VOCAB_WORDS = 1024  # how many to take from the vocabulary then


class Prompt(NamedTuple):
    text: str
    tokens: int  # exact with a tokenizer, else the word count
    exact: bool


class TokenCounter:
    """Counts tokens with a Hugging Face `tokenizer.json` (the `tokenizers` library)."""

    def __init__(self, tokenizer_dir: str) -> None:
        from tokenizers import Tokenizer  # optional dependency of the load generator

        path = tokenizer_dir
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no tokenizer.json at {tokenizer_dir}")
        self._tok: Any = Tokenizer.from_file(path)
        self.single_token_words = self._distinct_single_tokens()

    def _distinct_single_tokens(self) -> tuple[str, ...]:
        """Words that are one token each and no two the same token: WORDS first, then, when
        fewer than MIN_DISTINCT_WORDS of those qualify, the tokenizer's own vocabulary. A
        word-level tokenizer maps every word it does not know to one unknown token: those
        words would all be one token, so every random prompt would be the same prompt (and a
        prefix-cache hit)."""
        by_id: dict[int, list[str]] = {}
        for w in WORDS:
            ids = self.encode(" " + w)
            if len(ids) == 1:
                by_id.setdefault(ids[0], []).append(w)
        words = {tid: ws[0] for tid, ws in by_id.items() if len(ws) == 1}
        seen = set(by_id)
        if len(words) < MIN_DISTINCT_WORDS:
            for token, tid in sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1]):
                if len(words) >= VOCAB_WORDS:
                    break
                if tid not in seen and token.isalnum() and self.encode(" " + token) == [tid]:
                    words[tid] = token
                    seen.add(tid)
        return tuple(words.values())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


def random_words(n: int, rng: np.random.Generator, vocab: Sequence[str] = WORDS) -> list[str]:
    idx = rng.integers(0, len(vocab), size=max(0, n))
    return [vocab[i] for i in idx]


def make_prompt(
    n_tokens: int, rng: np.random.Generator, counter: TokenCounter | None = None
) -> Prompt:
    """Random word text of `n_tokens` tokens (exact with a counter, else approximate)."""
    n_tokens = max(1, n_tokens)
    if counter is None:
        return Prompt(" ".join(random_words(n_tokens, rng)), n_tokens, exact=False)
    vocab = counter.single_token_words or WORDS
    words = random_words(n_tokens, rng, vocab)
    # Word boundaries usually give one token per word; merges or splits at the
    # first word are corrected by adding or dropping words until the count fits.
    for _ in range(32):
        count = counter.count(" ".join(words))
        if count == n_tokens:
            return Prompt(" ".join(words), count, exact=True)
        if count < n_tokens:
            words += random_words(n_tokens - count, rng, vocab)
        else:
            del words[max(1, len(words) - (count - n_tokens)) :]
            if len(words) == 1 and counter.count(words[0]) > n_tokens:
                break
    # Fallback: cut at the token level; a re-encode can differ, so report the real count.
    ids = counter.encode(" ".join(words))[:n_tokens]
    text = counter.decode(ids)
    count = counter.count(text)
    return Prompt(text, count, exact=count == n_tokens)


def concat(a: Prompt, b: Prompt, counter: TokenCounter | None) -> Prompt:
    """`a` then `b` separated by a space, with the token count of the result."""
    text = f"{a.text} {b.text}"
    if counter is None:
        return Prompt(text, a.tokens + b.tokens, exact=False)
    return Prompt(text, counter.count(text), exact=True)
