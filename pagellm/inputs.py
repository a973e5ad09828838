"""The prompt dictionaries `generate` takes, under vLLM's names (`vllm.inputs`), so code
that builds them carries over; at run time they are plain dicts."""

from __future__ import annotations

from typing import TypedDict


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A prompt as text, tokenized by the engine; `cache_salt` keys its cached blocks
    (requests with different salts never share them)."""

    cache_salt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids; `prompt` is its text, if known, echoed in the output;
    `cache_salt` as in TextPrompt."""

    prompt: str
    cache_salt: str
