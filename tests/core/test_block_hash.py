"""Chained block hashes: DESIGN "Hash" rule and the hashing PITFALLS."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.core.block_hash import BlockHasher

ALGORITHMS = ["sha256", "fast"]
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_chained_any_earlier_token_changes_every_later_block(algorithm: str) -> None:
    hasher = BlockHasher(4, algorithm)  # type: ignore[arg-type]
    tokens = list(range(100, 116))  # 4 full blocks
    base = hasher.hash_blocks(tokens)
    assert len(base) == 4
    for pos in range(len(tokens)):
        changed = list(tokens)
        changed[pos] += 1
        other = hasher.hash_blocks(changed)
        block = pos // 4
        assert other[:block] == base[:block], "blocks before the change must still match"
        for i in range(block, 4):
            assert other[i] != base[i], f"block {i} must differ when token {pos} differs"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_same_block_tokens_after_different_prefix_differ(algorithm: str) -> None:
    # Hashing each block alone would make block 1 of both sequences match.
    hasher = BlockHasher(2, algorithm)  # type: ignore[arg-type]
    a = hasher.hash_blocks([1, 2, 7, 8])
    b = hasher.hash_blocks([3, 4, 7, 8])
    assert a[1] != b[1]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_partial_blocks_are_never_hashed(algorithm: str) -> None:
    hasher = BlockHasher(4, algorithm)  # type: ignore[arg-type]
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert len(hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7])) == 1
    with pytest.raises(ValueError, match="only full blocks"):
        hasher.hash_block(hasher.root(), [1, 2])
    with pytest.raises(ValueError, match="only full blocks"):
        hasher.hash_block(hasher.root(), [1, 2, 3, 4, 5])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_zero_padding_never_matches(algorithm: str, make_request) -> None:
    """`[a, b]` (a partial block, unhashed) must never be found as `[a, b, 0, 0]`."""
    hasher = BlockHasher(4, algorithm)  # type: ignore[arg-type]
    padded = hasher.hash_blocks([5, 6, 0, 0])
    assert hasher.hash_blocks([5, 6]) == []
    # A request for [5, 6] has no full block, so it cannot hit the padded block.
    request = make_request([5, 6], 4, algorithm=algorithm)  # type: ignore[arg-type]
    assert request.block_hashes == []
    # ...and once its block fills with other tokens, the key differs from the padded one.
    request.append_output_token(9)
    request.append_output_token(9)
    assert request.block_hashes != padded


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_extend_is_incremental_and_matches_from_scratch(algorithm: str) -> None:
    hasher = BlockHasher(3, algorithm)  # type: ignore[arg-type]
    tokens = list(range(20))
    root = hasher.root("salt")
    hashes: list[bytes] = []
    for end in range(len(tokens) + 1):
        hasher.extend(hashes, root, tokens[:end])
        assert len(hashes) == end // 3
    assert hashes == hasher.hash_blocks(tokens, cache_salt="salt")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_request_hashes_output_tokens_as_they_arrive(algorithm: str, make_request) -> None:
    request = make_request([1, 2, 3, 4, 5], 4, algorithm=algorithm)  # type: ignore[arg-type]
    assert len(request.block_hashes) == 1
    for token in (6, 7):
        request.append_output_token(token)
        assert len(request.block_hashes) == 1
    request.append_output_token(8)
    assert len(request.block_hashes) == 2
    hasher = BlockHasher(4, algorithm)  # type: ignore[arg-type]
    assert request.block_hashes == hasher.hash_blocks(list(range(1, 9)))


def test_sha256_is_the_default_and_is_sha256() -> None:
    hasher = BlockHasher(2)
    assert hasher.algorithm == "sha256"
    root = hasher.root()
    block = hasher.hash_block(root, [1, 2])
    assert len(root) == len(block) == 32
    expected = hashlib.sha256(root + (1).to_bytes(4, "little") + (2).to_bytes(4, "little"))
    assert block == expected.digest()


def test_unknown_algorithm_and_bad_block_size_rejected() -> None:
    with pytest.raises(ValueError, match="hash algorithm"):
        BlockHasher(4, "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)


def test_algorithms_disagree() -> None:
    tokens = list(range(8))
    assert BlockHasher(4, "sha256").hash_blocks(tokens) != BlockHasher(4, "fast").hash_blocks(
        tokens)


@pytest.mark.parametrize(
    ("salt_a", "adapter_a", "salt_b", "adapter_b"),
    [
        ("tenant-a", None, "tenant-b", None),
        (None, None, "tenant-a", None),
        (None, "lora-1", None, "lora-2"),
        (None, None, None, "lora-1"),
        ("ab", None, "a", "b"),  # field boundaries must be encoded
        (None, "x", "x", None),  # salt and adapter are different fields
        ("", None, None, None),  # empty salt is not "no salt"
    ],
)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_extra_keys_change_every_block(
    algorithm: str, salt_a: str | None, adapter_a: str | None, salt_b: str | None,
    adapter_b: str | None,
) -> None:
    hasher = BlockHasher(4, algorithm)  # type: ignore[arg-type]
    tokens = list(range(12))
    a = hasher.hash_blocks(tokens, salt_a, adapter_a)
    b = hasher.hash_blocks(tokens, salt_b, adapter_b)
    assert all(x != y for x, y in zip(a, b, strict=True))
    assert hasher.hash_blocks(tokens, salt_a, adapter_a) == a  # but deterministic


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 5), min_size=4, max_size=16),
    b=st.lists(st.integers(0, 5), min_size=4, max_size=16),
)
def test_equal_hash_iff_equal_prefix(a: list[int], b: list[int]) -> None:
    """Property: block i's hashes are equal exactly when tokens [0, (i+1)*bs) are equal."""
    for algorithm in ALGORITHMS:
        hasher = BlockHasher(2, algorithm)  # type: ignore[arg-type]
        ha, hb = hasher.hash_blocks(a), hasher.hash_blocks(b)
        for i in range(min(len(ha), len(hb))):
            same_prefix = a[: 2 * (i + 1)] == b[: 2 * (i + 1)]
            assert (ha[i] == hb[i]) == same_prefix


_CHILD = """
import json, sys
from pagellm.core.block_hash import BlockHasher
out = {}
for algorithm in ("sha256", "fast"):
    h = BlockHasher(4, algorithm)
    out[algorithm] = [x.hex() for x in h.hash_blocks(list(range(1000, 1016)), "tenant", "lora")]
print(json.dumps(out))
"""


def test_hashes_are_deterministic_across_processes() -> None:
    """A per-process seeded hash would make two engines never agree (hit rate 0)."""
    import json

    results = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
            timeout=60, check=True)
        results.append(json.loads(proc.stdout))
    assert results[0] == results[1]
    # ...and equal to this process's hashes too.
    for algorithm in ALGORITHMS:
        here = BlockHasher(4, algorithm).hash_blocks(  # type: ignore[arg-type]
            list(range(1000, 1016)), "tenant", "lora")
        assert [x.hex() for x in here] == results[0][algorithm]
