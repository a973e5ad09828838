"""Shared helpers for the pure-Python core tests."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from pagellm.core.block_hash import BlockHasher, HashAlgorithm
from pagellm.core.block_pool import BlockPool
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.sampling_params import SamplingParams

_ids = itertools.count()

def make_request(
    tokens: list[int],
    block_size: int = 4,
    *,
    algorithm: HashAlgorithm = "sha256",
    hasher: BlockHasher | None = None,
    cache_salt: str | None = None,
    adapter: str | None = None,
    request_id: str | None = None,
) -> Request:
    return Request(
        request_id if request_id is not None else f"r{next(_ids)}",
        list(tokens),
        SamplingParams(),
        hasher if hasher is not None else BlockHasher(block_size, algorithm),
        cache_salt=cache_salt,
        adapter=adapter,
    )


def admit(manager: KVCacheManager, request: Request) -> int:
    """Scheduler-style admission: look up, allocate the rest of the prompt, mark the hits
    computed. Returns the number of hit tokens; fails the test if it does not fit."""
    hits, num_hit = manager.find_cached_prefix(request)
    new = manager.allocate(request, request.num_tokens - num_hit, hits)
    assert new is not None, "admission unexpectedly did not fit"
    request.num_computed_tokens = num_hit
    request.num_cached_tokens = num_hit
    return num_hit


def compute_all(manager: KVCacheManager, request: Request) -> None:
    """Pretend the model ran over every allocated token, then publish the full blocks."""
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)


def run_prompt(manager: KVCacheManager, request: Request) -> int:
    num_hit = admit(manager, request)
    compute_all(manager, request)
    return num_hit


def check_pool(pool: BlockPool) -> None:
    """Structural invariants of a pool that hold after every public operation."""
    in_queue = list(pool.free_queue)
    ids = [b.block_id for b in in_queue]
    assert len(ids) == len(set(ids)) == pool.free_queue.num_free
    for block in in_queue:
        assert block.ref_count == 0
    in_queue_ids = set(ids)
    for block in pool.blocks:
        assert block.ref_count >= 0
        if block.ref_count == 0:
            assert block.block_id in in_queue_ids, f"{block} is free but not in the queue"
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    for block in pool.blocks:
        if block.block_hash is not None:
            assert pool.cached.get(block.block_hash) is block
    if pool._index_children:  # each cached block under its parent, and nothing else
        indexed = [h for by_first in pool._children.values() for children in by_first.values()
                   for h in children]
        assert sorted(indexed) == sorted(pool.cached) == sorted(pool._parent_of)
        assert all(by_first and all(by_first.values()) for by_first in pool._children.values())


# tests/ has no __init__.py files, so helpers are handed out as (session-scoped) fixtures
# rather than imported from this module.


@pytest.fixture(scope="session", name="make_request")
def _make_request_fixture() -> Callable[..., Request]:
    return make_request


@pytest.fixture(scope="session", name="admit")
def _admit_fixture() -> Callable[[KVCacheManager, Request], int]:
    return admit


@pytest.fixture(scope="session", name="run_prompt")
def _run_prompt_fixture() -> Callable[[KVCacheManager, Request], int]:
    return run_prompt


@pytest.fixture(scope="session", name="check_pool")
def _check_pool_fixture() -> Callable[[BlockPool], None]:
    return check_pool


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=16, block_size=4, enable_events=True)
