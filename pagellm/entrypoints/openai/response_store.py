"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`.

OpenAI stores every response unless told `store: false`; a client then continues a
conversation by naming the last response instead of sending it again. Here the store is
in memory and bounded by size: the least recently used responses are forgotten first, so
a long-running server cannot grow without limit (vLLM's store, behind an environment
variable, never forgets). Continuing from a stored response is where the prefix cache
pays: the earlier turns render to the same tokens, whose KV blocks are still cached.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pagellm.entrypoints.openai.json_text import dumps_utf8
from pagellm.entrypoints.openai.responses_protocol import ResponseObject

DEFAULT_STORE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    """A response, kept as its JSON (a tenth of the memory of its objects when it has
    logprobs), and the conversation that continuing from it starts with: its input
    messages (without the instructions, which do not carry over, as in OpenAI's API) and
    its answer."""

    response_json: bytes
    conversation: list[dict[str, Any]]
    input_items_json: bytes  # its input, as items with ids (GET .../input_items)
    size: int
    item_ids: tuple[str, ...]  # of its items that item references may name
    cache_salt: str | None = None  # its request's, which a continuation inherits

    @property
    def response(self) -> ResponseObject:
        return ResponseObject.model_validate(json.loads(self.response_json))

    @property
    def input_items(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = json.loads(self.input_items_json)
        return items

    def item(self, item_id: str) -> dict[str, Any] | None:
        """One of its input or output items, as the client would send it back."""
        output: list[dict[str, Any]] = json.loads(self.response_json)["output"]
        return next((item for item in [*self.input_items, *output]
                     if item.get("id") == item_id), None)


class ResponseStore:
    """Responses by id, least recently used first out once `max_bytes` is exceeded
    (a response bigger than the whole store is not kept).

    A response's size is its JSON's and its whole conversation's. The earlier messages
    are the same objects as in the response it continued, but evicting that one leaves
    them alive here, so each entry counts all it holds: a bound, never an
    underestimate."""

    def __init__(self, max_bytes: int = DEFAULT_STORE_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        # Item id: the responses holding it, oldest first (a response's input may list
        # an item of an earlier one again, under its id).
        self._item_owners: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]],
            client_ids: frozenset[str] = frozenset(), cache_salt: str | None = None
            ) -> None:
        """Keeps `response`, the conversation that continuing from it starts with, and
        its input items.

        References find only the ids the server issued: its output items' and the ids it
        gave input items (or that a reference brought back). `client_ids`, those the
        client wrote on its own items, are listed but never found: anyone may write any
        id, so another client's `msg_1`, or one copying this client's output id, would
        otherwise stand in for this client's item."""
        response_json = dumps_utf8(response.model_dump(mode="json"))
        items_json = dumps_utf8(input_items)
        size = len(response_json) + len(items_json) + len(dumps_utf8(conversation))
        self.delete(response.id)
        if size > self.max_bytes:
            return
        item_ids = tuple(item["id"] for item in input_items
                         if item["id"] not in client_ids) + tuple(
            item.id for item in response.output)
        self._entries[response.id] = StoredResponse(response_json, conversation, items_json,
                                                    size, item_ids, cache_salt)
        for item_id in item_ids:
            self._item_owners.setdefault(item_id, []).append(response.id)
        self.used_bytes += size
        while self.used_bytes > self.max_bytes:
            self.delete(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def item(self, item_id: str) -> dict[str, Any] | None:
        """A stored item by id (an `item_reference`'s), from the newest response that
        holds it."""
        owners = self._item_owners.get(item_id)
        return None if not owners else self._entries[owners[-1]].item(item_id)

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.used_bytes -= entry.size
        for item_id in entry.item_ids:
            owners = self._item_owners[item_id]
            owners.remove(response_id)
            if not owners:
                del self._item_owners[item_id]
        return True
