"""`GET /kv_cache_events`: the prefix cache's changes as server-sent events.

A prefix-aware router keeps, per engine, the blocks it holds, and sends a request where
the most of its prefix is cached. vLLM publishes the same events over ZeroMQ in msgpack
(`--kv-events-config`); here they are a plain HTTP stream of JSON, with vLLM's event and
field names, so any HTTP client can follow them. The first events are a snapshot of the
cache (see `KVEventHub`), so a router may connect, or reconnect, at any time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from pagellm.core.events import AllBlocksCleared, BlockStored
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.kv_events import KVEventBatch
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.transport import EventStreamResponse, sse

# An SSE comment this often on a quiet stream, so that proxies that cut idle
# connections (nginx after 60 s) leave a follower connected.
KEEP_ALIVE_S = 15.0


# vLLM's name for the tier of the engine's own KV cache, whatever its device.
MEDIUM = "GPU"


def batch_json(batch: KVEventBatch, block_size: int) -> dict[str, Any]:
    """vLLM's `KVEventBatch` as JSON, hashes in hex, with its fields (`lora_id` and
    `lora_name` null: no adapters here). As in vLLM, one `BlockStored` holds a run of
    blocks, each the parent of the next (`token_ids` are theirs, concatenated; a run's
    first block, if it is a chain's first, has its cache salt in `extra_keys`), and one
    `BlockRemoved` a run of removals. A snapshot's parts also carry `snapshot`: which
    part of how many."""
    events: list[dict[str, Any]] = []
    for event in batch.events:
        last = events[-1] if events else None
        if isinstance(event, BlockStored):
            parent = None if event.parent_hash is None else event.parent_hash.hex()
            if (last is not None and last["type"] == "BlockStored"
                    and last["block_hashes"][-1] == parent):
                last["block_hashes"].append(event.block_hash.hex())
                last["token_ids"].extend(event.token_ids)
                if last["extra_keys"] is not None:
                    last["extra_keys"].append(None)
            else:
                events.append({"type": "BlockStored", "block_hashes": [event.block_hash.hex()],
                               "parent_block_hash": parent, "token_ids": list(event.token_ids),
                               "block_size": block_size, "lora_id": None, "medium": MEDIUM,
                               "lora_name": None,
                               "extra_keys": ([list(event.extra_keys)] if event.extra_keys
                                              else None)})
        elif isinstance(event, AllBlocksCleared):
            events.append({"type": "AllBlocksCleared"})
        elif last is not None and last["type"] == "BlockRemoved":
            last["block_hashes"].append(event.block_hash.hex())
        else:
            events.append({"type": "BlockRemoved", "block_hashes": [event.block_hash.hex()],
                           "medium": MEDIUM})
    body: dict[str, Any] = {"seq": batch.seq, "ts": batch.timestamp, "events": events}
    if batch.snapshot_part is not None:
        part, parts = batch.snapshot_part
        body["snapshot"] = {"part": part, "parts": parts}
    return body


def kv_events_stream(engine: AsyncLLMEngine) -> EventStreamResponse:
    """The stream of one subscriber: the snapshot, then each step's events, until the
    client leaves or the engine stops (or the client fell too far behind: it reconnects
    and starts from a new snapshot)."""
    hub = engine.kv_events
    if hub is None:
        raise APIError(404, "KV cache events are off: start the server with "
                            "--enable-kv-cache-events", code="not_found")
    if hub.closed or not engine.is_running:
        raise APIError(503, "The engine is not running.")
    block_size = engine.engine.config.block_size

    async def events() -> AsyncGenerator[str, None]:
        subscription = hub.subscribe(asyncio.get_running_loop())
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(subscription.get(), KEEP_ALIVE_S)
                except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
                    yield ": keep-alive\n\n"
                    continue
                if batch is None:
                    return
                yield sse(batch_json(batch, block_size))
        finally:
            hub.unsubscribe(subscription)

    return EventStreamResponse(events())
