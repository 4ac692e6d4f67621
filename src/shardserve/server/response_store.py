"""Stored responses (`store: true`): what GET /v1/responses/{id} answers and what previous_response_id
continues. Bounded in count and bytes (--responses-max-stored, --responses-max-stored-bytes), the
oldest dropped first; held in the API process's memory, so a restart forgets them (as vLLM's)."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class Stored:
    response: dict  # the Response object as it was answered
    history: list[dict]  # the conversation so far as chat messages (input and output, no instructions)
    size: int = 0


class ResponseStore:
    def __init__(self, max_count: int = 1024, max_bytes: int = 64 * 2**20):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.dropped = 0  # responses dropped to stay within the bounds

    def put(self, response: dict, history: list[dict]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(history))
        if size > self.max_bytes:
            log.warning("response %s (%d bytes) exceeds --responses-max-stored-bytes %d: not stored",
                        response["id"], size, self.max_bytes)
            return
        self.delete(response["id"])
        self._items[response["id"]] = Stored(response, history, size)
        self.bytes += size
        while len(self._items) > self.max_count or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
            self.dropped += 1

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None

    def __len__(self) -> int:
        return len(self._items)
