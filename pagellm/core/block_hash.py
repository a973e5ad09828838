"""Chained block hashes: the key under which a full block of KV is found again.

Block i of a token sequence is keyed by H(hash of block i-1, token ids of block i). The
request's extra keys (tenant `cache_salt`, adapter name) seed the chain as the parent of
block 0, so chaining carries them into every later block: identical tokens under a
different salt or adapter never produce the same key, and a hit on block i implies a hit
on every block before it.

SHA-256 over a canonical byte encoding is the default because a forged collision would let
one tenant read another's KV. The "fast" option uses Python's tuple hash over integers,
which is deterministic across processes (ints are not randomised by PYTHONHASHSEED) but
64-bit and non-cryptographic: use it only where every client is trusted.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Literal

BlockHash = bytes
HashAlgorithm = Literal["sha256", "fast"]

_ROOT_DOMAIN = b"pagellm/block-hash/v1"


def _encode_tokens(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 per token: canonical across machines and processes."""
    encoded = array("I", token_ids)
    if sys.byteorder != "little":
        encoded.byteswap()
    return encoded.tobytes()


def _encode_extra_keys(cache_salt: str | None, adapter: str | None) -> bytes:
    """Length-prefixed fields, so ("ab", None) and ("a", "b") can never encode alike."""
    parts = [_ROOT_DOMAIN]
    for field in (cache_salt, adapter):
        if field is None:
            parts.append(b"\xff\xff\xff\xff")
        else:
            raw = field.encode("utf-8")
            parts.append(struct.pack("<I", len(raw)))
            parts.append(raw)
    return b"".join(parts)


def _sha256_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.sha256(parent + _encode_tokens(token_ids)).digest()


def _fast_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    value = hash((int.from_bytes(parent[:8], "little"), tuple(token_ids)))
    return value.to_bytes(8, "little", signed=True)


_BLOCK_HASHERS: dict[str, Callable[[BlockHash, Sequence[int]], BlockHash]] = {
    "sha256": _sha256_block,
    "fast": _fast_block,
}


class BlockHasher:
    """Hashes the full blocks of token sequences with one algorithm and block size."""

    def __init__(self, block_size: int, algorithm: HashAlgorithm = "sha256") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if algorithm not in _BLOCK_HASHERS:
            raise ValueError(
                f"hash algorithm must be one of {sorted(_BLOCK_HASHERS)}, got {algorithm!r}"
            )
        self.block_size = block_size
        self.algorithm = algorithm
        self._hash_block = _BLOCK_HASHERS[algorithm]

    def root(self, cache_salt: str | None = None, adapter: str | None = None) -> BlockHash:
        """The parent of block 0: encodes every key that changes what identical tokens mean."""
        return hashlib.sha256(_encode_extra_keys(cache_salt, adapter)).digest()

    def hash_block(self, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        if len(token_ids) != self.block_size:
            raise ValueError(
                f"only full blocks are hashed: got {len(token_ids)} tokens, "
                f"block_size is {self.block_size}"
            )
        return self._hash_block(parent, token_ids)

    def extend(
        self, hashes: list[BlockHash], root: BlockHash, token_ids: Sequence[int]
    ) -> None:
        """Appends the hashes of the full blocks of `token_ids` not yet in `hashes`.

        Incremental by design: a request calls this as tokens arrive and each block is
        hashed exactly once.
        """
        size = self.block_size
        parent = hashes[-1] if hashes else root
        start = len(hashes) * size
        hash_block = self._hash_block
        for begin in range(start, len(token_ids) - size + 1, size):
            parent = hash_block(parent, token_ids[begin : begin + size])
            hashes.append(parent)

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        adapter: str | None = None,
    ) -> list[BlockHash]:
        """All full-block hashes of a sequence, from scratch."""
        hashes: list[BlockHash] = []
        self.extend(hashes, self.root(cache_salt, adapter), token_ids)
        return hashes
