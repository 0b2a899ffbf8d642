"""Input validation for the OpenAI endpoints: raw body -> `ParsedRequest`, or an `APIError`
(4xx, OpenAI envelope) naming the offending parameter.

Order of checks: content type (415), body size (413), UTF-8 and JSON (400), object
shape, unknown fields, model (404), then each parameter's type and range (400).
Checks that need the tokenizer (prompt length, token id range, context length) live in
`check_prompt`, called after tokenization.

Unknown top-level fields are rejected, like OpenAI does ("Unrecognized request
argument"), except a few that are harmless to ignore (`HARMLESS`). Fields whose
non-default value would silently change the meaning of the request (echo, logit_bias,
...) are accepted only at their neutral value. `response_format`, `structured_outputs`,
`tools` and `tool_choice` are read by gateway/structured.py.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from dataclasses import dataclass, replace
from typing import Any

from gateway.backend import PRIORITIES
from gateway.config import GatewayConfig, RequestLimits
from gateway.errors import APIError, excerpt, invalid
from gateway.fields import bool_field, float_field, int_field, opt_str_field
from gateway.structured import OutputShape, parse_output_shape, tool_message_fields
from pdserve.common.sampling_params import SamplingParams, SamplingParamsError

COMPLETION = "completion"
CHAT = "chat"

_SAMPLING = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "n", "stream", "stream_options",
    "ignore_eos", "user", "priority", "stop_token_ids", "skip_special_tokens",
    "include_stop_str_in_output", "response_format", "structured_outputs", "speculative", "prompt_logprobs",
}
_KNOWN = {
    COMPLETION: _SAMPLING | {"prompt", "logprobs", "echo"},
    CHAT: _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                       "parallel_tool_calls"},
}
# Ignored without effect on the output.
HARMLESS = {"store", "metadata", "service_tier", "reasoning_effort"}
# Accepted only when absent, null or equal to one of these neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,),  # chat; completions support it
    "suffix": ("",),
    "best_of": (1,),
    "logit_bias": ({},),
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "logprobs_mode": (),
}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
_MESSAGE_NEUTRAL: dict[str, tuple[Any, ...]] = {"refusal": (), "function_call": ()}


@dataclass(frozen=True)
class ParsedRequest:
    """A syntactically valid request; `params.max_tokens` is resolved by `check_prompt`."""

    kind: str  # COMPLETION | CHAT
    prompt_text: str | None  # completion prompt given as text
    prompt_token_ids: tuple[int, ...] | None  # completion prompt given as token ids
    messages: tuple[dict[str, Any], ...] | None  # chat messages, content flattened to text
    params: SamplingParams
    max_tokens: int | None  # as requested; None -> default
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    priority: str
    user: str | None
    skip_special_tokens: bool = True
    include_stop_str: bool = False
    shape: OutputShape = OutputShape()  # structured output and tools
    echo: bool = False  # completions: the prompt leads the text (and its logprobs the logprobs)
    model: str | None = None  # as requested: the served name, an alias or a LoRA adapter

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == CHAT else "prompt"


def check_content_type(content_type: str) -> None:
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise APIError(
            415, "Content-Type must be application/json", code="unsupported_media_type", reason="invalid"
        )


def decode_body(raw: bytes, limit: int) -> dict[str, Any]:
    """Bytes -> JSON object, rejecting bodies over `limit` bytes, invalid UTF-8, NaN/Infinity and non-objects."""
    if len(raw) > limit:
        raise too_large(limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise invalid(None, "request body is not valid UTF-8", "invalid_utf8") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError, RecursionError):
        raise invalid(None, "request body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, "request body must be a JSON object", "invalid_json")
    try:
        # JSON escapes can smuggle lone surrogates ("\ud800") past the UTF-8 check above;
        # they are not text and would crash the tokenizer.
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(None, "request body contains invalid Unicode (lone surrogates)", "invalid_utf8") from None
    return body


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes", code="request_too_large", reason="invalid")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_request(
    kind: str, body: Mapping[str, Any], config: GatewayConfig, header_priority: str | None = None,
    adapters: Container[str] = (),
) -> ParsedRequest:
    """Validate a decoded body of the `kind` endpoint (`adapters`: the LoRA adapter
    names a request's model may also be). Raises APIError."""
    limits = config.limits
    _check_fields(kind, body)
    check_model(body.get("model"), config, adapters)
    prompt_text, prompt_ids, messages = None, None, None
    if kind == CHAT:
        messages = parse_messages(body.get("messages"), limits)
    else:
        prompt_text, prompt_ids = _prompt(body.get("prompt"))
    max_tokens = _max_tokens(kind, body, limits)
    stream = bool_field(body, "stream", False)
    include_usage = _stream_options(body, stream)
    shape = parse_output_shape(body, kind == CHAT, config.tool_call_parser is not None)
    params = replace(_sampling(kind, body, config, max_tokens), structured=shape.constraint)
    return ParsedRequest(
        kind=kind,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_ids,
        messages=messages,
        params=params,
        max_tokens=max_tokens,
        stop=_stop(body.get("stop"), limits),
        stream=stream,
        include_usage=include_usage,
        priority=_priority(body.get("priority"), header_priority),
        user=_user(body, limits),
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        include_stop_str=bool_field(body, "include_stop_str_in_output", False),
        shape=shape,
        echo=bool(bool_field(body, "echo", False)),
        model=body.get("model"),
    )


def check_model(model: Any, config: GatewayConfig, adapters: Container[str] = ()) -> None:
    """A request's `model`: absent, the served name, one of its aliases or a served LoRA
    adapter; else a 404."""
    if model is not None and not isinstance(model, str):
        raise invalid("model", "model must be a string", "invalid_type")
    if model is not None and model not in config.served_model_names and model not in adapters:
        raise APIError(
            404, f"The model {excerpt(model)} does not exist.", param="model", code="model_not_found", reason="invalid"
        )


def check_prompt(req: ParsedRequest, prompt_len: int, vocab_size: int, config: GatewayConfig) -> ParsedRequest:
    """Checks needing the token count; returns `req` with `params.max_tokens` resolved."""
    param = req.prompt_param
    if prompt_len == 0:
        raise invalid(param, f"{param} must not be empty", "empty_prompt")
    if req.prompt_token_ids is not None and any(t >= vocab_size for t in req.prompt_token_ids):
        raise invalid(param, f"token ids must be in [0, {vocab_size})", "invalid_token_id")
    limit = config.limits.max_prompt_tokens
    if limit is not None and prompt_len > limit:
        raise invalid(param, f"prompt has {prompt_len} tokens, more than the limit of {limit}", "prompt_too_long")
    room = config.max_model_len - prompt_len
    if req.max_tokens is not None:
        max_tokens = req.max_tokens
    elif req.kind == COMPLETION:
        max_tokens = min(config.default_max_tokens, max(room, 1))
    else:
        max_tokens = max(room, 1)
        if config.limits.max_tokens is not None:
            max_tokens = min(max_tokens, config.limits.max_tokens)
    if prompt_len + max_tokens > config.max_model_len:
        raise invalid(
            param,
            f"This model's maximum context length is {config.max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
            "for the completion). Please reduce the prompt or max_tokens.",
            "context_length_exceeded",
        )
    return replace(req, params=replace(req.params, max_tokens=max_tokens))


def _check_fields(kind: str, body: Mapping[str, Any]) -> None:
    for key, value in body.items():
        if key in _KNOWN[kind] or key in HARMLESS:
            continue
        if key in _NEUTRAL:
            if value is None or value in _NEUTRAL[key]:
                continue
            if key == "best_of" and value == body.get("n", 1):
                continue
            raise invalid(key, f"{key} is not supported by this server", "unsupported_parameter")
        raise invalid(key, f"Unrecognized request argument supplied: {excerpt(key, 40)}", "unknown_parameter")


def parse_messages(value: Any, limits: RequestLimits) -> tuple[dict[str, Any], ...]:
    if value is None:
        raise invalid("messages", "messages is required", "missing_required_parameter")
    if not isinstance(value, list):
        raise invalid("messages", "messages must be an array", "invalid_type")
    if not value:
        raise invalid("messages", "messages must not be empty", "empty_array")
    if len(value) > limits.max_messages:
        raise invalid("messages", f"at most {limits.max_messages} messages are allowed", "too_many_messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))


def _message(m: Any, where: str) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise invalid(where, f"{where} must be an object", "invalid_type")
    for key, val in m.items():
        neutral = _MESSAGE_NEUTRAL.get(key)
        if key not in _MESSAGE_KEYS and (neutral is None or (val is not None and val not in neutral)):
            raise invalid(f"{where}.{excerpt(key, 40)}", f"unsupported message field {excerpt(key, 40)}", "unsupported_parameter")
    role = m.get("role")
    if role not in _ROLES:
        raise invalid(f"{where}.role", f"role must be one of {', '.join(_ROLES)}", "invalid_value")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""
    out: dict[str, Any] = {"role": role, "content": text_content(content, f"{where}.content")}
    out.update(tool_message_fields(m, where))
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise invalid(f"{where}.name", "name must be a string", "invalid_type")
        out["name"] = name
    return out


def text_content(content: Any, where: str, parts: Container[str] = ("text",),
                 refused: str = "only text content parts are supported", code: str = "invalid_value") -> str:
    """A message's content as one string: a string, or a non-empty array of text parts of
    the `parts` types, joined (another part: 400 `refused`, with `code`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid(where, "content must be a string or a non-empty array of text parts", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in parts or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}]", refused, code)
        texts.append(part["text"])
    return "".join(texts)


def _prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if value is None:
        raise invalid("prompt", "prompt is required", "missing_required_parameter")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise invalid("prompt", "prompt must not be empty", "empty_prompt")
        return value, None
    if isinstance(value, list):
        if not value:
            raise invalid("prompt", "prompt must not be empty", "empty_prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            if any(t < 0 for t in value):
                raise invalid("prompt", "token ids must be non-negative", "invalid_token_id")
            return None, tuple(value)
        if all(isinstance(t, (str, list)) for t in value):
            raise invalid("prompt", "batched prompts are not supported; send one prompt per request", "unsupported_value")
    raise invalid("prompt", "prompt must be a string or an array of token ids", "invalid_type")


def _max_tokens(kind: str, body: Mapping[str, Any], limits: RequestLimits) -> int | None:
    name = "max_tokens"
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    value = int_field(body, name, lo=1, hi=limits.max_tokens)
    return value


def _sampling(kind: str, body: Mapping[str, Any], config: GatewayConfig, max_tokens: int | None) -> SamplingParams:
    limits = config.limits
    n = int_field(body, "n", lo=1, hi=limits.max_n)
    top_k = int_field(body, "top_k", lo=-1)
    logprobs: int | None
    if kind == CHAT:
        want = bool_field(body, "logprobs", False)
        top = int_field(body, "top_logprobs", lo=0, hi=min(limits.max_logprobs, 20))
        if top is not None and not want:
            raise invalid("top_logprobs", "top_logprobs requires logprobs to be true")
        logprobs = (top or 0) if want else None
    else:
        logprobs = int_field(body, "logprobs", lo=0, hi=min(limits.max_logprobs, 20))
    prompt_logprobs = int_field(body, "prompt_logprobs", lo=0, hi=min(limits.max_logprobs, 20))
    if kind == COMPLETION and body.get("echo") and logprobs is not None and prompt_logprobs is None:
        prompt_logprobs = logprobs  # echo + logprobs: the prompt's tokens carry logprobs too (vLLM)
    stop_ids = _stop_token_ids(body.get("stop_token_ids"), limits)
    seed = int_field(body, "seed", lo=-(2**63), hi=2**64 - 1)
    kwargs: dict[str, Any] = {
        "max_tokens": max_tokens or 1,
        "temperature": float_field(body, "temperature", 0.0, 2.0),
        "top_p": float_field(body, "top_p", 0.0, 1.0, lo_open=True),
        "top_k": top_k,
        "min_p": float_field(body, "min_p", 0.0, 1.0),
        "presence_penalty": float_field(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": float_field(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": float_field(body, "repetition_penalty", 0.0, None, lo_open=True),
        "seed": seed,
        "stop_token_ids": stop_ids,
        "ignore_eos": bool_field(body, "ignore_eos", None),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "n": n,
        # false: this request never speculates (pdserve's own field; output is the same).
        "speculative": bool_field(body, "speculative", None),
    }
    for name, value in config.sampling_defaults.as_dict().items():  # the request's own value wins
        if kwargs[name] is None:
            kwargs[name] = value
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None}).validate()
    except SamplingParamsError as e:
        raise invalid(e.param, str(e)) from None


def _stop_token_ids(value: Any, limits: RequestLimits) -> frozenset[int]:
    """The distinct ids: at most `max_stop_token_ids` of them in the request (counted
    before deduplication, so the cap bounds the request's size too)."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise invalid("stop_token_ids", "stop_token_ids must be an array of token ids", "invalid_type")
    if len(value) > limits.max_stop_token_ids:
        raise invalid("stop_token_ids", f"at most {limits.max_stop_token_ids} stop_token_ids are allowed",
                      "too_many_stop_token_ids")
    return frozenset(value)


def _user(body: Mapping[str, Any], limits: RequestLimits) -> str | None:
    user = opt_str_field(body, "user")
    if user is not None and len(user) > limits.max_user_len:
        raise invalid("user", f"user must be at most {limits.max_user_len} characters", "string_above_max_length")
    return user


def _stop(value: Any, limits: RequestLimits) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "stop must be a string or an array of strings", "invalid_type")
    if len(stops) > limits.max_stop:
        raise invalid("stop", f"at most {limits.max_stop} stop sequences are allowed", "too_many_stop")
    for s in stops:
        if not s:
            raise invalid("stop", "stop sequences must not be empty")
        if len(s) > limits.max_stop_len:
            raise invalid("stop", f"stop sequences must be at most {limits.max_stop_len} characters")
    return tuple(stops)


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise invalid("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise invalid("stream_options", "stream_options must be an object", "invalid_type")
    unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise invalid(f"stream_options.{excerpt(sorted(unknown)[0], 40)}", "unknown stream option", "unknown_parameter")
    return bool(bool_field(opts, "include_usage", False))


def _priority(value: Any, header: str | None) -> str:
    if value is None:
        value, param = (header or "interactive"), "x-pdserve-priority"
    else:
        param = "priority"
    if value not in PRIORITIES:
        raise invalid(param, f"priority must be one of {', '.join(PRIORITIES)}")
    return str(value)
