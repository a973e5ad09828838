"""GET /kv_cache_events on a real server: a router following the stream knows exactly the
blocks the server caches, whether it joined before or after they were stored."""

from __future__ import annotations

import json
import queue
import random
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, Server

BLOCK_SIZE = 16  # the server's default


class Follower:
    """A router's view: reads the stream on a thread and replays it into `blocks`
    (hash -> that block's tokens) as batches are taken with `until`."""

    def __init__(self, server: Server) -> None:
        self.batches: queue.Queue[dict[str, Any]] = queue.Queue()
        self.blocks: dict[str, list[int]] = {}
        self.parents: dict[str, str | None] = {}
        self.extra_keys: dict[str, list[str] | None] = {}
        self.seq = -1
        self._client = httpx.Client(timeout=httpx.Timeout(10, read=None))
        self._stream = self._client.stream("GET", f"{server.url}/kv_cache_events")
        self.response = self._stream.__enter__()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self.response.iter_lines():
                if line.startswith("data: "):
                    self.batches.put(json.loads(line.removeprefix("data: ")))
        except httpx.HTTPError:
            pass

    def until(self, done: Any, timeout: float = 60) -> None:
        """Replays batches until `done(self)` holds."""
        while not done(self):
            batch = self.batches.get(timeout=timeout)
            assert batch["seq"] >= self.seq, "batches out of order"
            self.seq = batch["seq"]
            for event in batch["events"]:
                self._apply(event)

    def _apply(self, event: dict[str, Any]) -> None:
        if event["type"] == "AllBlocksCleared":
            self.blocks.clear()
            self.parents.clear()
        elif event["type"] == "BlockRemoved":
            for block_hash in event["block_hashes"]:
                del self.blocks[block_hash]
                del self.parents[block_hash]
        else:
            assert event["block_size"] == BLOCK_SIZE
            parent = event["parent_block_hash"]
            tokens = event["token_ids"]
            assert len(tokens) == BLOCK_SIZE * len(event["block_hashes"])
            extra_keys = event["extra_keys"] or [None] * len(event["block_hashes"])
            for i, block_hash in enumerate(event["block_hashes"]):
                self.blocks[block_hash] = tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
                self.parents[block_hash] = parent
                self.extra_keys[block_hash] = extra_keys[i]
                parent = block_hash

    def prefix(self, block_hash: str) -> tuple[list[int], list[str] | None]:
        """The tokens a cached block keys (its parents' and its own), and the extra keys
        (the cache salt) of its chain."""
        chain: list[str] = []
        current: str | None = block_hash
        while current is not None:
            chain.append(current)
            current = self.parents[current]
        tokens = [token for block in reversed(chain) for token in self.blocks[block]]
        return tokens, self.extra_keys[chain[-1]]

    def holds(self, tokens: list[int], salt: str | None = None) -> bool:
        keys = None if salt is None else [salt]
        return any(self.prefix(block_hash) == (tokens, keys) for block_hash in self.blocks)

    def close(self) -> None:
        self._stream.__exit__(None, None, None)
        self._client.close()


@pytest.fixture()
def follower(server: Server) -> Iterator[Follower]:
    follower = Follower(server)
    yield follower
    follower.close()


def test_followers_see_the_cached_blocks(server: Server, follower: Follower) -> None:
    assert follower.response.status_code == 200
    assert follower.response.headers["content-type"].startswith("text/event-stream")
    follower.until(lambda f: f.seq >= 0)  # the snapshot
    rng = random.Random(11)
    prompt = [rng.randrange(1000, 20000) for _ in range(2 * BLOCK_SIZE + 5)]
    reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    follower.until(lambda f: f.holds(prompt[:2 * BLOCK_SIZE]))
    assert follower.holds(prompt[:BLOCK_SIZE])
    assert not follower.holds(prompt[:BLOCK_SIZE], salt="tenant-b")
    salted = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"})
    assert salted.status_code == 200, salted.text
    follower.until(lambda f: f.holds(prompt[:2 * BLOCK_SIZE], salt="tenant-b"))

    late = Follower(server)
    try:
        late.until(lambda f: f.seq >= 0)
        assert late.holds(prompt[:2 * BLOCK_SIZE])
        follower.until(lambda f: f.seq >= late.seq)
        assert late.blocks == follower.blocks and late.parents == follower.parents
        server.wait_idle()
        assert httpx.post(f"{server.url}/reset_prefix_cache").json() == {"success": True}
        for f in (follower, late):
            f.until(lambda f: not f.blocks)
    finally:
        late.close()
