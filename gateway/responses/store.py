"""Stored responses (`store: true`), for `previous_response_id` and
`GET/DELETE /v1/responses/{id}`: a bounded in-memory map, least recently used out
first. What a later turn needs is kept beside the response object: the conversation
as chat messages (input turns and this response's output, without `instructions`,
which OpenAI does not carry over to the next turn).

Nothing here survives a gateway restart, and gateways do not share it: an id another
gateway answered is unknown here (404), as it would be after an eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was answered
    conversation: tuple[dict[str, Any], ...]  # chat messages, this response's output last


class ResponseStore:
    """At most `capacity` responses; `on_evict` is called once per response pushed out."""

    def __init__(self, capacity: int, on_evict: Callable[[], None] = lambda: None) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._on_evict = on_evict
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, item: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
            self._on_evict()

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
