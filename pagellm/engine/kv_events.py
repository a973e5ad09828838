"""The prefix cache's events, fanned out to subscribers that may join at any time.

A router that sends each request to the engine already holding its prefix needs that
engine's cached blocks, kept current. Events alone serve only a subscriber that was there
from the start, so the hub also keeps the set they describe: a subscriber's first batch
is a snapshot (a clear, then every block cached now, parents first), and the events after
it apply to exactly that state. A subscriber that falls behind by `max_pending` batches is
dropped rather than buffered without bound; it reconnects and gets a new snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagellm.core.block_hash import BlockHash
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step (or a snapshot), numbered: `seq` grows by one per
    published batch, and a snapshot carries the number of the last batch it includes."""

    seq: int
    timestamp: float
    events: tuple[KVCacheEvent, ...]


class KVEventSubscription:
    """One subscriber's queue of batches, read on its event loop; None ends it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: asyncio.Queue[KVEventBatch | None] = asyncio.Queue()

    @property
    def pending(self) -> int:
        """Batches put and not yet read (some may still be on their way to the loop)."""
        return self._pending

    def put(self, batch: KVEventBatch | None) -> None:
        """From any thread."""
        with self._lock:
            self._pending += 1
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody reads it
            self.loop.call_soon_threadsafe(self._queue.put_nowait, batch)

    async def get(self) -> KVEventBatch | None:
        """The next batch; None once the hub dropped this subscriber (it fell behind)."""
        batch = await self._queue.get()
        with self._lock:
            self._pending -= 1
        return batch


class KVEventHub:
    """Thread-safe: the engine thread publishes, event loops subscribe."""

    def __init__(self, max_pending: int = 4096) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._blocks: dict[BlockHash, BlockStored] = {}
        self._seq = 0
        self._subscribers: list[KVEventSubscription] = []
        self._closed = False

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if not events:
            return
        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self._blocks[event.block_hash] = event
                elif isinstance(event, BlockRemoved):
                    self._blocks.pop(event.block_hash, None)
                else:
                    self._blocks.clear()
            self._seq += 1
            batch = KVEventBatch(self._seq, time.time(), tuple(events))
            for subscriber in list(self._subscribers):
                if subscriber.pending >= self.max_pending:
                    self._drop(subscriber)
                else:
                    subscriber.put(batch)

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> KVEventSubscription:
        """A subscription whose first batch is the snapshot of the cache now."""
        subscription = KVEventSubscription(loop)
        with self._lock:
            snapshot: tuple[KVCacheEvent, ...] = (AllBlocksCleared(), *self._parents_first())
            subscription.put(KVEventBatch(self._seq, time.time(), snapshot))
            if self._closed:
                subscription.put(None)
            else:
                self._subscribers.append(subscription)
        return subscription

    def _parents_first(self) -> list[BlockStored]:
        """The cached blocks, each after its parent where that is cached too (a parent
        evicted and stored again comes after its children in storing order)."""
        ordered: list[BlockStored] = []
        seen: set[BlockHash] = set()
        for block in self._blocks.values():
            chain: list[BlockStored] = []
            current: BlockStored | None = block
            while current is not None and current.block_hash not in seen:
                seen.add(current.block_hash)
                chain.append(current)
                current = (None if current.parent_hash is None
                           else self._blocks.get(current.parent_hash))
            ordered.extend(reversed(chain))
        return ordered

    def close(self) -> None:
        """The engine stopped: every subscription ends, and later ones end at once."""
        with self._lock:
            self._closed = True
            for subscriber in list(self._subscribers):
                self._drop(subscriber)

    def unsubscribe(self, subscription: KVEventSubscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _drop(self, subscriber: KVEventSubscription) -> None:
        self._subscribers.remove(subscriber)
        subscriber.put(None)
