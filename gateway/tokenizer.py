"""Tokenizer: a model's `tokenizer.json` plus its special tokens and chat template.

Torch-free (the gateway never imports torch): it uses the `tokenizers` library
directly and reads the special-token facts from `tokenizer_config.json` and
`generation_config.json` (through `pdserve/common/generation_config.py`, its one reader), the way
Hugging Face `transformers` would.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import Tokenizer as HFTokenizer

from gateway.chat_template import load_chat_template, render_chat_template
from pdserve.common.generation_config import (
    GenerationConfigError,
    read_generation_config,
    token_ids,
)


class TokenizerError(ValueError):
    """The model directory has no usable tokenizer."""


class Encoded(NamedTuple):
    """A bounded encoding: `ids` is None when `num_tokens` passed the limit (never materialized)."""

    ids: list[int] | None
    num_tokens: int


# Texts at least this long are encoded through `encode_batch`, which releases the GIL, so a
# long prompt tokenizing in the prompt pool does not stall the event loop.
_UNLOCKED_CHARS = 2048


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config stores special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """Encode/decode text and render chat prompts for one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self._tok = tokenizer
        self._max_token_chars: int | None = None
        # What other modules derive from this tokenizer once (gateway/chat_prompt.py).
        self.derived: dict[str, Any] = {}
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        eos_ids: list[int] = []
        if eos_token is not None and (tid := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.append(tid)
        eos_ids.extend(i for i in extra_eos_token_ids if i not in eos_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        if bos_token is not None and (tid := tokenizer.token_to_id(bos_token)) is not None:
            bos_token_id = tid
        self.bos_token_id: int | None = bos_token_id
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: tuple[int, ...] = tuple(
            sorted(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` (special tokens, chat
        template), `chat_template.jinja` and `generation_config.json` (eos ids)."""
        d = Path(path)
        tok_file = d / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{d} has no tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"cannot load {tok_file}: {e}") from e
        tcfg = _read_json(d / "tokenizer_config.json")
        cfg = _read_json(d / "config.json")
        try:
            gen = read_generation_config(d, sampling=False)
            gen_eos = gen.eos_token_ids or token_ids(cfg.get("eos_token_id"))
        except GenerationConfigError as e:
            raise TokenizerError(str(e)) from e
        bos_id = gen.bos_token_id if gen.bos_token_id is not None else cfg.get("bos_token_id")
        return cls(
            hf,
            chat_template=load_chat_template(d, tcfg),
            bos_token=_token_content(tcfg.get("bos_token")),
            eos_token=_token_content(tcfg.get("eos_token")),
            extra_eos_token_ids=gen_eos,
            bos_token_id=bos_id if isinstance(bos_id, int) else None,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, the tokenizer's own
        post-processor adds what the model expects (e.g. BOS)."""
        ids = self.encode_bounded(text, add_special_tokens, None).ids
        assert ids is not None
        return ids

    def encode_bounded(self, text: str, add_special_tokens: bool, limit: int | None) -> Encoded:
        """`encode`, but past `limit` tokens only the count: a prompt refused as too long
        never has its ids built. Long texts release the GIL while they are split."""
        if len(text) < _UNLOCKED_CHARS:
            enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            enc = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        count = len(enc)
        if limit is not None and count > limit:
            return Encoded(None, count)
        return Encoded(list(enc.ids), count)

    @property
    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: the longest vocabulary
        entry (a byte-level token's characters are its bytes, a byte-fallback token's
        spelling is longer than its byte). A text of more than `n * max_token_chars`
        characters cannot be n tokens or fewer."""
        if self._max_token_chars is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self._max_token_chars = max((len(t) for t in vocab), default=1)
        return self._max_token_chars

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object itself."""
        return self._tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The rendered prompt string. Encode it with add_special_tokens=False: the
        template already contains BOS. Raises ChatTemplateError without a template."""
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render and encode a chat prompt (no extra special tokens added)."""
        prompt = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(prompt, add_special_tokens=False)
