"""Responses kept in memory for `previous_response_id`: each id -> the conversation up to and
including its output, in OpenAI's chat shape; the least recently used go beyond `capacity`."""
from __future__ import annotations

import threading
from collections import OrderedDict

DEFAULT_CAPACITY = 1024


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, messages: list[dict]) -> None:
        with self._lock:
            self._items[response_id] = messages
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict] | None:
        with self._lock:
            messages = self._items.get(response_id)
            if messages is not None:
                self._items.move_to_end(response_id)
            return messages
