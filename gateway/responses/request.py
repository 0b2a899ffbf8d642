"""A `POST /v1/responses` body -> the chat request it means, plus what the Response
object echoes back.

The Responses API is a chat request in another dress: `input` (text, or items:
messages, `function_call`, `function_call_output`) becomes `messages` after the stored
conversation of `previous_response_id` and after `instructions` as a system message;
`max_output_tokens` is `max_tokens`; `text.format` is `response_format`; function
`tools` (flat: name, parameters at the top) and `tool_choice` take the chat shapes.
The chat body is then validated by the chat path itself (gateway/validation.py), and
an error it raises is renamed to the Responses parameter it came from.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError, excerpt, invalid
from gateway.responses.store import StoredResponse
from gateway.validation import text_content

# Responses fields that map onto chat fields of the same meaning.
_SAME = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stream", "parallel_tool_calls", "user",
         "priority", "presence_penalty", "frequency_penalty", "repetition_penalty")
_OWN = {"input", "instructions", "max_output_tokens", "store", "previous_response_id", "text", "tools",
        "tool_choice", "metadata"}
# Accepted only when absent, null or one of these neutral values.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",), "reasoning": ({},), "include": ([],), "background": (False,),
    "top_logprobs": (0,), "max_tool_calls": (), "prompt": (), "conversation": (), "service_tier": ("auto", "default"),
}
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_PARTS_REFUSED = ("only input_text and output_text parts are supported", "unsupported_value")
# Chat parameter prefix -> the Responses parameter it came from (error messages).
_RENAMES = (("max_tokens", "max_output_tokens"), ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format", "text.format"), ("tool_choice.function.name", "tool_choice.name"),
            ("messages", "input"))


@dataclass(frozen=True)
class ResponsesRequest:
    """`chat_body`: the equivalent chat completion body. `conversation`: the chat
    messages of this turn without instructions (stored for the next one). `echo`:
    the request fields the Response object reports."""

    chat_body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]
    echo: dict[str, Any]
    store: bool
    stream: bool


def translate(body: Mapping[str, Any], lookup: Callable[[str], StoredResponse | None]) -> ResponsesRequest:
    """Raises APIError: 400 naming the Responses parameter, 404 for an unknown
    `previous_response_id`."""
    _check_fields(body)
    previous = _previous(body.get("previous_response_id"), lookup)
    turn = _input(body.get("input"))
    conversation = (*previous, *turn)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", "instructions must be a string", "invalid_type")
    system = ({"role": "system", "content": instructions},) if instructions else ()
    chat: dict[str, Any] = {k: body[k] for k in _SAME if body.get(k) is not None}
    chat["messages"] = [*system, *conversation]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise invalid("store", "store must be a boolean", "invalid_type")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise invalid("metadata", "metadata must be an object of strings", "invalid_type")
    echo = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "metadata": metadata or {}, "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "tool_choice": body.get("tool_choice", "auto"), "tools": list(body.get("tools") or []),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}}, "user": body.get("user"),
    }
    return ResponsesRequest(chat, tuple(conversation), echo, store, bool(body.get("stream", False)))


def renamed(e: APIError) -> APIError:
    """A chat-path error named with the Responses parameter it came from."""
    if e.param is None:
        return e
    for chat, ours in _RENAMES:
        if e.param == chat or e.param.startswith((chat + ".", chat + "[")):
            e.param = ours + e.param[len(chat):] if chat != "messages" else "input"
            e.message = e.message.replace(chat, ours)
            break
    tools = e.param.startswith("tools[") and ".function" in e.param
    if tools:
        e.param = e.param.replace(".function", "")
    return e


def _check_fields(body: Mapping[str, Any]) -> None:
    for key, value in body.items():
        if key in _SAME or key in _OWN:
            continue
        if key in _NEUTRAL:
            if value is None or value in _NEUTRAL[key]:
                continue
            raise invalid(key, f"{key} is not supported by this server", "unsupported_parameter")
        raise invalid(key, f"Unrecognized request argument supplied: {excerpt(key, 40)}", "unknown_parameter")


def _previous(rid: Any, lookup: Callable[[str], StoredResponse | None]) -> tuple[dict[str, Any], ...]:
    if rid is None:
        return ()
    if not isinstance(rid, str):
        raise invalid("previous_response_id", "previous_response_id must be a string", "invalid_type")
    stored = lookup(rid)
    if stored is None:
        raise APIError(404, f"Previous response with id {excerpt(rid)} not found.", param="previous_response_id",
                       code="previous_response_not_found", reason="invalid")
    return stored.conversation


def _input(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise invalid("input", "input is required", "missing_required_parameter")
    if isinstance(value, str):
        if not value:
            raise invalid("input", "input must not be empty", "empty_prompt")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input", "input must be a string or a non-empty array of items", "invalid_type")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        _item(item, f"input[{i}]", out)
    return out


def _item(item: Any, where: str, out: list[dict[str, Any]]) -> None:
    if not isinstance(item, dict):
        raise invalid(where, f"{where} must be an object", "invalid_type")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise invalid(f"{where}.role", f"role must be one of {', '.join(_ROLES)}", "invalid_value")
        # developer is the Responses API's name for system turns; chat templates know system.
        role = "system" if role == "developer" else role
        out.append({"role": role, "content": text_content(item.get("content"), f"{where}.content", _TEXT_PARTS, *_PARTS_REFUSED)})
    elif kind == "function_call":
        call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
        if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(args, str)):
            raise invalid(where, "a function_call item needs call_id, name and arguments strings", "invalid_type")
        try:
            json.loads(args)
        except ValueError:
            raise invalid(f"{where}.arguments", "arguments must be JSON text") from None
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str):
            raise invalid(f"{where}.call_id", "a function_call_output item needs a call_id string", "invalid_type")
        out.append({"role": "tool", "tool_call_id": call_id, "content": text_content(output, f"{where}.output", _TEXT_PARTS, *_PARTS_REFUSED)})
    else:
        raise invalid(f"{where}.type", f"input items of type {excerpt(kind, 40)} are not supported; use message, "
                      "function_call or function_call_output", "unsupported_value")


def _text_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise invalid("text", "text must be an object with a format", "invalid_type")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid("text.format.type", "text.format.type must be text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    if not isinstance(fmt.get("name", ""), str):
        raise invalid("text.format.name", "name must be a string", "invalid_type")
    if "schema" not in fmt:
        raise invalid("text.format.schema", "a json_schema format needs a schema", "missing_required_parameter")
    return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}


def _tools(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise invalid("tools", "tools must be an array", "invalid_type")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise invalid(f"tools[{i}]", "only function tools are supported", "unsupported_value")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value
