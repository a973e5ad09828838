"""The prefix cache's events, fanned out to subscribers that may join at any time.

A router that sends each request to the engine already holding its prefix needs that
engine's cached blocks, kept current. Events alone serve only a subscriber that was there
from the start, so the hub also keeps the set they describe: a subscriber starts from a
snapshot of it (a clear, then every block cached now, parents first), and the events after
it apply to exactly that state. A subscriber that falls behind by `max_pending` batches is
dropped rather than buffered without bound; it reconnects and gets a new snapshot.

The engine thread publishes, so it only ever copies: a snapshot is the map of cached
blocks copied under the lock, put in order and cut into batches by its reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagellm.core.block_hash import BlockHash
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# Events per batch of a snapshot (its opening clear among them): a large cache is sent
# as many modest events, not one line of many megabytes.
SNAPSHOT_BATCH_BLOCKS = 1024


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step (or a part of a snapshot), numbered: `seq` grows by
    one per published batch, and a snapshot's parts carry the number of the last batch
    they include."""

    seq: int
    timestamp: float
    events: tuple[KVCacheEvent, ...]
    # A snapshot's parts say which they are, (part, parts) counting from 1, so that a
    # follower knows when it has the whole cache.
    snapshot_part: tuple[int, int] | None = None


@dataclass(frozen=True)
class _Snapshot:
    seq: int
    timestamp: float
    blocks: dict[BlockHash, BlockStored]


class KVEventSubscription:
    """One subscriber's queue of batches, read on its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending = 0
        self._closed = False
        self._lock = threading.Lock()
        self._queue: asyncio.Queue[_Snapshot | KVEventBatch | None] = asyncio.Queue()
        self._snapshot_parts: Iterator[KVEventBatch] = iter(())

    @property
    def pending(self) -> int:
        """Batches put and not yet read (some may still be on their way to the loop)."""
        return self._pending

    def put(self, item: _Snapshot | KVEventBatch | None) -> None:
        """From any thread."""
        with self._lock:
            self._pending += 1
        with contextlib.suppress(RuntimeError):  # its loop has closed: nobody reads it
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def close(self) -> None:
        """From any thread: the reader gets None next, whatever is still queued."""
        self._closed = True
        self.put(None)

    async def get(self) -> KVEventBatch | None:
        """The next batch; None once the subscription is closed (the subscriber fell
        behind, or the engine stopped)."""
        while not self._closed:
            part = next(self._snapshot_parts, None)
            if part is not None:
                return part
            item = await self._queue.get()
            with self._lock:
                self._pending -= 1
            if isinstance(item, _Snapshot):
                self._snapshot_parts = _snapshot_batches(item)
            elif item is not None and not self._closed:
                return item
        return None


class KVEventHub:
    """Thread-safe: the engine thread publishes, event loops subscribe."""

    def __init__(self, max_pending: int = 4096) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._blocks: dict[BlockHash, BlockStored] = {}
        self._seq = 0
        self._subscribers: list[KVEventSubscription] = []
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

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
                    self._subscribers.remove(subscriber)
                    subscriber.close()
                else:
                    subscriber.put(batch)

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> KVEventSubscription:
        """A subscription whose first batches are the snapshot of the cache now; closed
        at once if the hub is."""
        subscription = KVEventSubscription(loop)
        with self._lock:
            subscription.put(_Snapshot(self._seq, time.time(), dict(self._blocks)))
            if self._closed:
                subscription.close()
            else:
                self._subscribers.append(subscription)
        return subscription

    def unsubscribe(self, subscription: KVEventSubscription) -> None:
        with self._lock:
            if subscription in self._subscribers:
                self._subscribers.remove(subscription)

    def close(self) -> None:
        """The engine stopped: every subscription ends, and later ones end at once."""
        with self._lock:
            self._closed = True
            for subscriber in self._subscribers:
                subscriber.close()
            self._subscribers.clear()

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)


def _snapshot_batches(snapshot: _Snapshot) -> Iterator[KVEventBatch]:
    """The snapshot as batches: a clear, then the blocks, each after its parent where
    that is cached too (a parent evicted and stored again comes after its children in
    storing order), at most SNAPSHOT_BATCH_BLOCKS a batch."""
    ordered: list[KVCacheEvent] = [AllBlocksCleared()]
    seen: set[BlockHash] = set()
    for block in snapshot.blocks.values():
        chain: list[BlockStored] = []
        current: BlockStored | None = block
        while current is not None and current.block_hash not in seen:
            seen.add(current.block_hash)
            chain.append(current)
            current = (None if current.parent_hash is None
                       else snapshot.blocks.get(current.parent_hash))
        ordered.extend(reversed(chain))
    starts = range(0, len(ordered), SNAPSHOT_BATCH_BLOCKS)
    for part, start in enumerate(starts, 1):
        yield KVEventBatch(snapshot.seq, snapshot.timestamp,
                           tuple(ordered[start:start + SNAPSHOT_BATCH_BLOCKS]),
                           (part, len(starts)))
