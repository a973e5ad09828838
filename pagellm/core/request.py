"""A generation request as the scheduler and the KV cache manager see it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from pagellm.core.block_hash import BlockHash, BlockHasher

if TYPE_CHECKING:
    from pagellm.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style reason ("stop", "length", "abort", "error"), None while live."""
        return self.value if self.is_finished else None


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


class Request:
    """Token state of one sequence, plus the hashes of its full blocks.

    `num_computed_tokens` counts tokens whose KV is in the request's blocks. During decode
    the last sampled token is not computed yet: it is the next step's input.

    Block hashes are extended as tokens arrive (prompt at creation, each output token
    after), so each block is hashed once and output blocks become reusable prefixes too
    (the next turn of a chat starts with this turn's answer).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        hasher: BlockHasher,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        adapter: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        # Under the "priority" policy, lower values run first (vLLM's convention).
        self.priority = priority
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.adapter = adapter
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens served from the prefix cache at first admission; -1 until looked up.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Later arrivals admitted before this request while it waited (see the scheduler's
        # cache-aware policy, which bounds it).
        self.num_overtaken = 0
        self.stop_reason: int | str | None = None
        self._hasher = hasher
        self._hash_root = hasher.root(cache_salt, adapter)
        self.block_hashes: list[BlockHash] = []
        hasher.extend(self.block_hashes, self._hash_root, self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self._hasher.block_size == 0:
            self._hasher.extend(self.block_hashes, self._hash_root, self.all_token_ids)

    @property
    def root_hash(self) -> BlockHash:
        """What the first block's hash chains from (the salt and adapter, hashed)."""
        return self._hash_root

    @property
    def extra_keys(self) -> tuple[str, ...]:
        """What seeds the block chain besides the tokens (see BlockStored)."""
        return tuple(key for key in (self.adapter, self.cache_salt) if key is not None)

    def parent_hash(self, block_index: int) -> BlockHash | None:
        return self.block_hashes[block_index - 1] if block_index > 0 else None

    def block_token_ids(self, block_index: int) -> tuple[int, ...]:
        size = self._hasher.block_size
        return tuple(self.all_token_ids[block_index * size : (block_index + 1) * size])

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )

    def fork(self, child_id: str, sampling_params: SamplingParams) -> Request:
        """A sibling with identical token state (for n > 1), sharing no mutable lists.

        The KV cache manager shares the blocks; this copies the token bookkeeping, including
        the block hashes, so nothing is hashed twice.
        """
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.request_id = child_id
        child.sampling_params = sampling_params
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        return child
