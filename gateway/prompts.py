"""A generation request's prompt as token ids: the checks that bound its cost first, then
the work itself (run in the prompt pool, gateway/prompt_pool.py).

1. `check_prompt_chars`, on the event loop, costs nothing: a prompt of more characters
   than `max_model_len` tokens can hold (`RequestLimits.max_prompt_chars`, by default
   `max_model_len` times the tokenizer's longest token) is refused with 400 before it is
   tokenized;
2. `encode_request`, in the pool: the chat template (gateway/chat_prompt.py, special
   tokens only where the template wrote them) and the tokenizer, stopping at the token
   limit: a prompt that cannot fit is counted, never materialized;
3. `check_prompt` (gateway/validation.py) then judges the count as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.chat_prompt import encode_chat
from gateway.config import GatewayConfig
from gateway.errors import invalid
from gateway.tokenizer import Encoded, Tokenizer
from gateway.validation import ParsedRequest


def text_chars(value: Any) -> int:
    """Characters of every string in `value` (nested lists and dicts, keys included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(text_chars(k) + text_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(text_chars(v) for v in value)
    return 0


def prompt_chars(parsed: ParsedRequest) -> int:
    """The characters the request asks to tokenize (0 for a prompt of token ids)."""
    if parsed.prompt_text is not None:
        return len(parsed.prompt_text)
    if parsed.messages is not None:
        return text_chars(parsed.messages) + text_chars(parsed.shape.template_tools)
    return 0


def max_prompt_chars(config: GatewayConfig, tok: Tokenizer) -> int:
    limit = config.limits.max_prompt_chars
    return limit if limit is not None else config.max_model_len * tok.max_token_chars


def check_prompt_chars(parsed: ParsedRequest, chars: int, config: GatewayConfig, tok: Tokenizer) -> None:
    limit = max_prompt_chars(config, tok)
    if chars > limit:
        raise invalid(parsed.prompt_param, f"prompt has {chars} characters, more than a prompt of this "
                      f"model's {config.max_model_len} tokens can hold ({limit} characters)", "prompt_too_long")


def token_limit(config: GatewayConfig) -> int:
    """The most prompt tokens any request could be served with (one output token at least)."""
    cap = config.limits.max_prompt_tokens
    room = config.max_model_len - 1
    return room if cap is None else min(room, cap)


def encode_request(parsed: ParsedRequest, tok: Tokenizer, config: GatewayConfig) -> Encoded:
    """The prompt's ids, or only their count past `token_limit` (check_prompt refuses it)."""
    limit = token_limit(config)
    if parsed.prompt_token_ids is not None:
        return Encoded(list(parsed.prompt_token_ids), len(parsed.prompt_token_ids))
    if parsed.prompt_text is not None:
        return tok.encode_bounded(parsed.prompt_text, True, limit)
    assert parsed.messages is not None
    return encode_chat(tok, parsed.messages, tools=parsed.shape.template_tools,
                       special_tokens_in_content=config.special_tokens_in_content, limit=limit)
