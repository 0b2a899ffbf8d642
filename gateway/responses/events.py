"""The streamed Responses API: chat deltas in, OpenAI's event sequence out.

    response.created, response.in_progress
    per message item:  response.output_item.added, response.content_part.added,
                       response.output_text.delta ..., response.output_text.done,
                       response.content_part.done, response.output_item.done
    per function call: response.output_item.added, response.function_call_arguments.delta ...,
                       response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut it off)

Every event carries a `sequence_number` counting from 0. The shapes are those of
`openai.types.responses` (checked by the tests against the package's own models).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.responses.output import (
    ResponseShell,
    call_item,
    message_item,
    new_id,
    status_of,
    text_part,
)


@dataclass
class _Open:
    """The output item being streamed."""

    index: int
    item: dict[str, Any]
    chunks: list[str] = field(default_factory=list)


@dataclass
class ResponseEvents:
    shell: ResponseShell
    _seq: int = 0
    _items: list[dict[str, Any]] = field(default_factory=list)  # finished output items
    _open: _Open | None = None
    _calls: dict[int, _Open] = field(default_factory=dict)  # tool-call index -> its item

    @property
    def output(self) -> list[dict[str, Any]]:
        return self._items

    def start(self) -> list[dict[str, Any]]:
        body = self.shell.body("in_progress", [], None)
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def delta(self, chat_delta: dict[str, Any], finish_reason: str | None) -> list[dict[str, Any]]:
        """Events for one chat chunk's delta of choice 0."""
        out: list[dict[str, Any]] = []
        text = chat_delta.get("content")
        if text:
            out += self._text(text)
        for call in chat_delta.get("tool_calls") or []:
            out += self._call(call)
        if finish_reason is not None:
            status = "incomplete" if finish_reason == "length" else "completed"
            if not self._items and self._open is None:
                out += self._open_message()  # an empty answer is still one message item
            out += self._close(status)
        return out

    def finish(self, usage_obj: dict[str, Any]) -> dict[str, Any]:
        status = status_of(self._items)
        body = self.shell.body(status, self._items, usage_obj)
        return self._event("response.completed" if status == "completed" else "response.incomplete", response=body)

    def error(self, err: dict[str, Any]) -> dict[str, Any]:
        e = err.get("error", {})
        return self._event("error", code=e.get("code"), message=e.get("message", ""), param=e.get("param"))

    # -- items ----------------------------------------------------------------

    def _text(self, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open.item["type"] != "message":
            out += self._close("completed") + self._open_message()
        assert self._open is not None
        self._open.chunks.append(text)
        out.append(self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[]))
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        self._open = _Open(len(self._items), message_item(new_id("msg"), "", "in_progress"))
        return [self._event("response.output_item.added", output_index=self._open.index, item=self._open.item),
                self._event("response.content_part.added", **self._where(), part=text_part(""))]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        fn = call.get("function") or {}
        if call.get("id") is not None:  # a call's first delta: a new item
            out += self._close("completed")
            item = call_item(new_id("fc"), call["id"], fn.get("name", ""), "", "in_progress")
            self._open = self._calls[call["index"]] = _Open(len(self._items), item)
            out.append(self._event("response.output_item.added", output_index=self._open.index, item=dict(item)))
        current = self._calls.get(call["index"])
        args = fn.get("arguments") or ""
        if current is not None and current is self._open and args:
            current.chunks.append(args)
            out.append(self._event("response.function_call_arguments.delta", item_id=current.item["id"],
                                   output_index=current.index, delta=args))
        return out

    def _close(self, status: str) -> list[dict[str, Any]]:
        """Finish the open item (if any) with its done events."""
        cur, self._open = self._open, None
        if cur is None:
            return []
        text = "".join(cur.chunks)
        out = []
        if cur.item["type"] == "message":
            where = {"item_id": cur.item["id"], "output_index": cur.index, "content_index": 0}
            out.append(self._event("response.output_text.done", **where, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", **where, part=text_part(text)))
            item = message_item(cur.item["id"], text, status)
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=cur.item["id"],
                                   output_index=cur.index, name=cur.item["name"], arguments=text))
            item = call_item(cur.item["id"], cur.item["call_id"], cur.item["name"], text, status)
        self._items.append(item)
        out.append(self._event("response.output_item.done", output_index=cur.index, item=item))
        return out

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open.item["id"], "output_index": self._open.index, "content_index": 0}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event
