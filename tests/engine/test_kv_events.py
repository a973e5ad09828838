"""KV cache events: replaying them gives exactly the engine's cached blocks, through
eviction and reset; the hub's snapshot lets a subscriber join late; the server's JSON
groups them as vLLM does."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from pagellm import LLM, SamplingParams
from pagellm.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagellm.engine.kv_events import SNAPSHOT_BATCH_BLOCKS, KVEventBatch, KVEventHub
from pagellm.entrypoints.openai.serving_kv_events import batch_json
from tests.engine.conftest import assert_idle

BLOCK = 8


def _replay(events: list[KVCacheEvent], held: dict[bytes, BlockStored]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            assert event.block_hash not in held, "stored twice without a removal"
            held[event.block_hash] = event
        elif isinstance(event, BlockRemoved):
            assert held.pop(event.block_hash, None) is not None, "removed an unknown block"
        else:
            held.clear()


def _tokens_of(block_hash: bytes, held: dict[bytes, BlockStored]) -> list[int]:
    """The whole prefix a block keys, walking its parents (all still held here)."""
    chain: list[BlockStored] = []
    current: bytes | None = block_hash
    while current is not None:
        chain.append(held[current])
        current = held[current].parent_hash
    return [token for event in reversed(chain) for token in event.token_ids]


def test_replayed_events_are_the_engine_cache(tiny: Path) -> None:
    """A pool of 12 blocks under 6 prompts of 5 blocks each: blocks are stored, evicted
    and found again, and after every batch the replayed set is the pool's."""
    llm = LLM(str(tiny), skip_tokenizer_init=True, block_size=BLOCK,
              kv_cache_memory_bytes=12 * BLOCK * 512, enable_kv_cache_events=True)
    engine = llm.llm_engine
    rng = random.Random(7)
    shared = [rng.randrange(2, 384) for _ in range(2 * BLOCK)]
    prompts = [shared + [rng.randrange(2, 384) for _ in range(3 * BLOCK + 2)] for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    held: dict[bytes, BlockStored] = {}
    for batch in (prompts[:2], prompts[2:4], prompts[4:], prompts[:1]):
        llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        _replay(engine.take_kv_cache_events(), held)
        assert set(held) == set(engine.kv_manager.pool.cached)
        for block_hash in held:  # every block keys a prompt's prefix (no output is cached)
            tokens = _tokens_of(block_hash, held)
            assert len(tokens) % BLOCK == 0
            assert any(p[:len(tokens)] == tokens for p in prompts)
    assert engine.get_stats().num_evictions > 0
    llm.generate({"prompt_token_ids": prompts[0], "cache_salt": "tenant-a"}, params,
                 use_tqdm=False)
    salted = [e for e in engine.take_kv_cache_events() if isinstance(e, BlockStored)]
    assert [e.extra_keys for e in salted] == [("tenant-a",)] + [()] * (len(salted) - 1)
    assert salted[0].parent_hash is None and salted[0].token_ids == tuple(prompts[0][:BLOCK])
    assert llm.reset_prefix_cache()
    assert engine.take_kv_cache_events() == [AllBlocksCleared()]
    assert engine.take_kv_cache_events() == []
    assert_idle(engine)


def test_events_are_off_by_default(tiny: Path) -> None:
    llm = LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="enable_kv_cache_events=True"):
        llm.llm_engine.take_kv_cache_events()


def _stored(block: int, parent: int | None) -> BlockStored:
    return BlockStored(bytes([block]), None if parent is None else bytes([parent]),
                       (block, block), block)


def test_a_late_subscriber_starts_from_a_snapshot() -> None:
    async def scenario() -> None:
        hub = KVEventHub()
        loop = asyncio.get_running_loop()
        early = hub.subscribe(loop)
        hub.publish([_stored(1, None), _stored(2, 1), _stored(3, 2)])
        hub.publish([BlockRemoved(bytes([3]), 3)])
        late = hub.subscribe(loop)
        hub.publish([_stored(4, 2)])
        snapshot = await late.get()
        assert snapshot is not None and snapshot.seq == 2
        assert snapshot.events == (AllBlocksCleared(), _stored(1, None), _stored(2, 1))
        after = await late.get()
        assert after is not None and after.seq == 3 and after.events == (_stored(4, 2),)
        early_held: dict[bytes, BlockStored] = {}
        for _ in range(4):  # its empty snapshot, then the three batches
            batch = await early.get()
            assert batch is not None
            _replay(list(batch.events), early_held)
        late_held: dict[bytes, BlockStored] = {}
        _replay([*snapshot.events, *after.events], late_held)
        assert early_held == late_held == {bytes([b]): _stored(b, p)
                                           for b, p in ((1, None), (2, 1), (4, 2))}
        hub.unsubscribe(early)
        hub.unsubscribe(late)
        assert hub.num_subscribers == 0

    asyncio.run(scenario())


def test_the_snapshot_puts_parents_first() -> None:
    """A parent evicted and stored again while its child stayed cached."""
    async def scenario() -> list[KVCacheEvent]:
        hub = KVEventHub()
        hub.publish([_stored(1, None), _stored(2, 1), _stored(3, 2),
                     BlockRemoved(bytes([1]), 1), _stored(1, None)])
        batch = await hub.subscribe(asyncio.get_running_loop()).get()
        assert batch is not None
        return list(batch.events)

    assert asyncio.run(scenario()) == [AllBlocksCleared(), _stored(1, None), _stored(2, 1),
                                       _stored(3, 2)]


def test_a_subscriber_that_falls_behind_is_dropped_and_close_ends_the_rest() -> None:
    """An end is at once, not after the backlog: a follower that fell behind has no use
    for it, and a stopping server should not wait on it."""
    async def scenario() -> None:
        hub = KVEventHub(max_pending=3)
        loop = asyncio.get_running_loop()
        slow = hub.subscribe(loop)  # the snapshot is its first pending item
        hub.publish([_stored(1, None)])
        hub.publish([_stored(2, 1)])
        hub.publish([_stored(3, 2)])  # 3 pending: dropped here
        assert hub.num_subscribers == 0
        assert await slow.get() is None
        kept = hub.subscribe(loop)
        first = await kept.get()
        assert first is not None and len(first.events) == 4  # the clear, 3 blocks
        hub.publish([_stored(4, 3)])
        hub.close()
        assert hub.closed and await kept.get() is None
        assert await hub.subscribe(loop).get() is None

    asyncio.run(scenario())


def test_a_large_snapshot_comes_in_parts() -> None:
    async def scenario() -> list[KVEventBatch]:
        hub = KVEventHub()
        chain = [_stored(1, None)] + [
            BlockStored(i.to_bytes(4, "big"), (i - 1).to_bytes(4, "big") if i > 2 else bytes([1]),
                        (i,), i) for i in range(2, SNAPSHOT_BATCH_BLOCKS + 601)]
        hub.publish(chain)
        subscription = hub.subscribe(asyncio.get_running_loop())
        hub.publish([BlockRemoved(bytes([1]), 1)])
        parts = [await subscription.get() for _ in range(3)]
        assert all(part is not None for part in parts)
        return [part for part in parts if part is not None]

    snapshot_a, snapshot_b, after = asyncio.run(scenario())
    assert (snapshot_a.seq, snapshot_b.seq, after.seq) == (1, 1, 2)
    assert (snapshot_a.snapshot_part, snapshot_b.snapshot_part, after.snapshot_part) == (
        (1, 2), (2, 2), None)
    assert batch_json(snapshot_b, 16)["snapshot"] == {"part": 2, "parts": 2}
    assert "snapshot" not in batch_json(after, 16)
    assert len(snapshot_a.events) == SNAPSHOT_BATCH_BLOCKS
    assert snapshot_a.events[0] == AllBlocksCleared()
    assert len(snapshot_a.events) + len(snapshot_b.events) == 1 + 1 + (SNAPSHOT_BATCH_BLOCKS + 599)
    assert after.events == (BlockRemoved(bytes([1]), 1),)


def test_publishing_to_a_closed_loop_does_not_raise() -> None:
    """The engine thread publishes; a subscriber whose loop is gone must not stop it."""
    hub = KVEventHub()
    loop = asyncio.new_event_loop()
    hub.subscribe(loop)
    loop.close()
    hub.publish([_stored(1, None)])


def test_json_groups_chains_and_removals_as_vllm_does() -> None:
    salted = BlockStored(bytes([7]), None, (7, 7), 7, ("tenant-a",))
    events = (AllBlocksCleared(), _stored(1, None), _stored(2, 1), _stored(5, None),
              BlockRemoved(bytes([2]), 2), BlockRemoved(bytes([5]), 5), _stored(6, 1),
              salted, BlockStored(bytes([8]), bytes([7]), (8, 8), 8))
    body = batch_json(KVEventBatch(9, 1.5, events), block_size=2)
    vllm_fields = {"block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert body == {"seq": 9, "ts": 1.5, "events": [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": ["01", "02"], "parent_block_hash": None,
         "token_ids": [1, 1, 2, 2], "extra_keys": None, **vllm_fields},
        {"type": "BlockStored", "block_hashes": ["05"], "parent_block_hash": None,
         "token_ids": [5, 5], "extra_keys": None, **vllm_fields},
        {"type": "BlockRemoved", "block_hashes": ["02", "05"], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": ["06"], "parent_block_hash": "01",
         "token_ids": [6, 6], "extra_keys": None, **vllm_fields},
        {"type": "BlockStored", "block_hashes": ["07", "08"], "parent_block_hash": None,
         "token_ids": [7, 7, 8, 8], "extra_keys": [["tenant-a"], None], **vllm_fields},
    ]}
