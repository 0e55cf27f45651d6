"""Stored responses of the Responses API: what `previous_response_id` continues from, and
what GET / DELETE /v1/responses/{id} read.

Bounded in memory (least recently used out first) with a time to live, so a client that
never deletes cannot grow the server: a response stays as long as both allow. Nothing
survives a restart; a follow-up to a forgotten response is a 404 naming it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object as returned
    conversation: list[dict[str, Any]]  # its chat messages, its own output last
    stored_at: float


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 ttl_s: float = DEFAULT_TTL_S) -> None:  # fmt: skip
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()  # handlers run on the event loop; tests poke from threads

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[body["id"]] = StoredResponse(body, conversation, time.monotonic())
            self._items.move_to_end(body["id"])
            while len(self._items) > self.max_responses:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is None:
                return None
            if time.monotonic() - item.stored_at > self.ttl_s:
                del self._items[response_id]
                return None
            self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
