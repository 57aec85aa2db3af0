"""Responses kept in memory for `previous_response_id` and GET/DELETE /v1/responses/{id}: each id ->
the conversation up to and including its output (OpenAI's chat shape) and the response object;
the least recently used go beyond `capacity`."""
from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_CAPACITY = 1024


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict], response: dict) -> None:
        with self._lock:
            self._items[response_id] = (messages, response)
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict], dict] | None:
        """(conversation, response object), or None."""
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None
