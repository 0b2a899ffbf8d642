"""The Response object (openai.types.responses.Response) and its output items, built
from what the chat path produced: a message item with one `output_text` part, and a
`function_call` item per tool call.

A choice cut off by `max_output_tokens` makes the response `incomplete` with
`incomplete_details.reason = "max_output_tokens"`, as OpenAI reports it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
    """The output items of a chat choice's final message."""
    status = "incomplete" if finish_reason == "length" else "completed"
    calls = message.get("tool_calls") or []
    items = []
    if message.get("content") or not calls:
        items.append(message_item(new_id("msg"), message.get("content") or "", status))
    for c in calls:
        items.append(call_item(new_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"], "completed"))
    return items


def conversation_turns(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the chat messages a next turn continues from."""
    turns: list[dict[str, Any]] = []
    for item in items:
        if item["type"] == "message":
            turns.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        else:
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turns and turns[-1].get("tool_calls"):
                turns[-1]["tool_calls"].append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
    return turns


@dataclass
class ResponseShell:
    """The parts of a Response that do not depend on the output."""

    response_id: str
    model: str
    echo: dict[str, Any]
    store: bool
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage_obj: dict[str, Any] | None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": None, "incomplete_details": incomplete, "model": self.model, "output": output,
            "store": self.store, "truncation": "disabled", "usage": usage_obj, "reasoning": None,
            "background": False, "service_tier": "default", **self.echo,
        }


def status_of(items: list[dict[str, Any]]) -> str:
    return "incomplete" if any(i.get("status") == "incomplete" for i in items) else "completed"
