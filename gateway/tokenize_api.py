"""`POST /tokenize` and `POST /detokenize`, in vLLM's request and response shapes.

tokenize:   {"model"?, "prompt": str, "add_special_tokens"?: true, "return_token_strs"?: false}
        or  {"model"?, "messages": [...], "add_generation_prompt"?: true,
             "add_special_tokens"?: false, "return_token_strs"?: false}
         -> {"count", "max_model_len", "tokens", "token_strs"}
detokenize: {"model"?, "tokens": [int, ...]} -> {"prompt"}

The chat form renders the chat template exactly as `/v1/chat/completions` does, so `count`
is the prompt length a chat request would have. Detokenizing keeps special tokens (vLLM's
`tokenizer.decode(tokens)`). Body limits, the model check (404 `model_not_found`) and bad
input (a 400 naming the parameter) are the completions endpoints' own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.body import json_body
from gateway.chat_prompt import encode_chat
from gateway.config import GatewayConfig
from gateway.errors import excerpt, invalid
from gateway.fields import bool_field
from gateway.prompts import text_chars
from gateway.state import STATE
from gateway.tokenizer import Tokenizer
from gateway.validation import check_model, parse_messages

_PROMPT_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"}
_DETOKENIZE_FIELDS = {"model", "tokens"}


@dataclass(frozen=True)
class TokenizeRequest:
    prompt: str | None  # the prompt form
    messages: tuple[dict[str, Any], ...] | None  # the chat form
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    req = parse_tokenize(await json_body(request, config), config)
    chars = text_chars(req.prompt) + text_chars(req.messages)
    ids = await state.prompts.run(chars, lambda: tokenize_ids(req, state.tokenizer, config.special_tokens_in_content))
    strs = [state.tokenizer.id_to_token(i) or "" for i in ids] if req.return_token_strs else None
    return _json({"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids, "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tokens = parse_detokenize(await json_body(request, state.config), state.config, state.tokenizer.vocab_size)
    return _json({"prompt": state.tokenizer.decode(tokens, skip_special_tokens=False)})


def parse_tokenize(body: Mapping[str, Any], config: GatewayConfig) -> TokenizeRequest:
    """Validate a /tokenize body. Raises APIError."""
    chat = "messages" in body
    if chat and "prompt" in body:
        raise invalid("prompt", "give either prompt or messages, not both", "invalid_value")
    _check_fields(body, _CHAT_FIELDS if chat else _PROMPT_FIELDS)
    check_model(body.get("model"), config)
    messages, prompt = None, None
    if chat:
        messages = parse_messages(body["messages"], config.limits)
    else:
        prompt = body.get("prompt")
        if prompt is None:
            raise invalid("prompt", "prompt or messages is required", "missing_required_parameter")
        if not isinstance(prompt, str):
            raise invalid("prompt", "prompt must be a string", "invalid_type")
    return TokenizeRequest(
        prompt=prompt,
        messages=messages,
        add_special_tokens=bool_field(body, "add_special_tokens", not chat),
        add_generation_prompt=bool_field(body, "add_generation_prompt", True),
        return_token_strs=bool_field(body, "return_token_strs", False),
    )


def tokenize_ids(req: TokenizeRequest, tok: Tokenizer, special_tokens_in_content: bool = False) -> list[int]:
    if req.prompt is not None:
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    assert req.messages is not None
    ids = encode_chat(tok, req.messages, add_generation_prompt=req.add_generation_prompt,
                      add_special_tokens=req.add_special_tokens,
                      special_tokens_in_content=special_tokens_in_content).ids
    assert ids is not None
    return ids


def parse_detokenize(body: Mapping[str, Any], config: GatewayConfig, vocab_size: int) -> list[int]:
    """Validate a /detokenize body; its token ids. Raises APIError."""
    _check_fields(body, _DETOKENIZE_FIELDS)
    check_model(body.get("model"), config)
    tokens = body.get("tokens")
    if tokens is None:
        raise invalid("tokens", "tokens is required", "missing_required_parameter")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid("tokens", "tokens must be an array of token ids", "invalid_type")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise invalid("tokens", f"token ids must be in [0, {vocab_size})", "invalid_token_id")
    return tokens


def _check_fields(body: Mapping[str, Any], known: set[str]) -> None:
    for key in body:
        if key not in known:
            raise invalid(key, f"Unrecognized request argument supplied: {excerpt(key, 40)}", "unknown_parameter")


def _json(obj: Any) -> web.Response:
    return web.Response(body=json.dumps(obj).encode(), content_type="application/json")
