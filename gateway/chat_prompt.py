"""A chat request's prompt token ids, with special tokens only where the template put them.

A chat template writes control tokens (`<|start_header_id|>`, `<|eot_id|>`, `<|im_start|>`
...) around each message; if a message's own text contains such a string and the rendered
prompt is tokenized as a whole, the user's text becomes real control tokens and a user
can forge a system or assistant turn. By default (`special_tokens_in_content=False`):

1. every special-token string inside the request's own text (message contents, names,
   tool calls, tool definitions) is replaced by a placeholder before rendering: a
   noncharacter marker plus a private-use character naming which string it was
   (the marker itself, should it occur, is replaced the same way);
2. the template renders as usual; no placeholder in the result (ordinary content): the
   prompt is tokenized as a whole, exactly as Hugging Face `transformers` does;
3. otherwise the rendered prompt is split at the special tokens the template wrote (found
   by the tokenizer itself), and each piece between them, placeholders turned back into
   their text, is tokenized with special tokens treated as plain text.

`special_tokens_in_content=True` tokenizes the rendered prompt as a whole, always (the
old way: content may contain control tokens).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from gateway.chat_template import ChatTemplateError
from gateway.errors import invalid
from gateway.tokenizer import Encoded, Tokenizer

MARKER = "\ufdd0"  # a Unicode noncharacter: never part of a model's own template text
_FIRST = 0xF0000  # supplementary private-use area A: one character per replaced string
_PLACEHOLDER = re.compile(MARKER + "([\U000f0000-\U000ffffd])")


class SpecialText:
    """The special-token strings of one tokenizer, and a copy of it that encodes them as
    text. Built once per tokenizer (`for_tokenizer`)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        specials = [s for i in tok.all_special_ids if (s := tok.id_to_token(i))]
        self.strings = [*sorted(set(specials), key=len, reverse=True), MARKER]
        self.index = {s: k for k, s in enumerate(self.strings)}
        self.pattern = re.compile("|".join(re.escape(s) for s in self.strings))
        self.special_ids = frozenset(tok.all_special_ids)
        plain = HFTokenizer.from_str(tok.backend.to_str())
        plain.encode_special_tokens = True  # special-token strings are split like any text
        self.plain = plain

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer) -> SpecialText:
        cached = tok.derived.get(cls.__name__)
        if not isinstance(cached, cls):
            cached = tok.derived[cls.__name__] = cls(tok)
        return cached

    def mask(self, value: Any) -> tuple[Any, bool]:
        """`value` (strings, lists, dicts, nested) with every special-token string replaced
        by its placeholder; and whether any was."""
        found = False

        def sub(text: str) -> str:
            nonlocal found
            if not self.pattern.search(text):
                return text
            found = True
            return self.pattern.sub(lambda m: MARKER + chr(_FIRST + self.index[m.group(0)]), text)

        def walk(v: Any) -> Any:
            if isinstance(v, str):
                return sub(v)
            if isinstance(v, Mapping):
                return {walk(k): walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [walk(x) for x in v]
            return v

        return walk(value), found

    def unmask(self, text: str) -> str:
        return _PLACEHOLDER.sub(lambda m: self.strings[ord(m.group(1)) - _FIRST], text)

    def encode_masked(self, rendered: str, add_special_tokens: bool) -> list[int]:
        """Step 3: split at the template's special tokens, the rest as text."""
        enc = self.tok.backend.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        start = 0
        for token_id, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            if token_id in self.special_ids and b > a:
                ids += self._plain(rendered[start:a])
                ids.append(token_id)
                start = b
        ids += self._plain(rendered[start:])
        if add_special_tokens:
            prefix, suffix = self._post_processor_tokens()
            ids = [*prefix, *ids, *suffix]
        return ids

    def _plain(self, piece: str) -> list[int]:
        if not piece:
            return []
        return list(self.plain.encode(self.unmask(piece), add_special_tokens=False).ids)

    def _post_processor_tokens(self) -> tuple[list[int], list[int]]:
        """What the tokenizer's post-processor adds before and after a text (e.g. BOS)."""
        bare = self.tok.encode("a", add_special_tokens=False)
        full = self.tok.encode("a", add_special_tokens=True)
        for i in range(len(full) - len(bare) + 1):
            if full[i:i + len(bare)] == bare:
                return full[:i], full[i + len(bare):]
        return [], []


def encode_chat(
    tok: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_special_tokens: bool = False,
    special_tokens_in_content: bool = False,
    limit: int | None = None,
) -> Encoded:
    """The prompt ids of a chat (at most `limit`, else only the count). A template that
    fails in any way: APIError 400 on `messages`."""
    extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
    masked = False
    special = None
    if not special_tokens_in_content:
        special = SpecialText.for_tokenizer(tok)
        messages, found_m = special.mask(list(messages))
        found_t = False
        if tools:
            extra["tools"], found_t = special.mask(list(tools))
        masked = found_m or found_t
    try:
        text = tok.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, **extra)
    except ChatTemplateError as e:
        raise invalid("messages", f"cannot apply the chat template: {str(e)[:200]}", "invalid_messages") from None
    if not masked or MARKER not in text:
        return tok.encode_bounded(text, add_special_tokens, limit)
    assert special is not None
    ids = special.encode_masked(text, add_special_tokens)
    if limit is not None and len(ids) > limit:
        return Encoded(None, len(ids))
    return Encoded(ids, len(ids))
