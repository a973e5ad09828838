"""The engine's per-token logprobs in the two shapes OpenAI uses.

The legacy completions API lists tokens, their logprobs, a {token: logprob} map of the
alternatives and character offsets; chat lists one object per token with its UTF-8
bytes, since a single token can be part of a multi-byte character.
"""

from __future__ import annotations

import math
from typing import Any

from pagellm.engine.outputs import Logprob
from pagellm.entrypoints.openai.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

# JSON has no -Infinity and clients' parsers reject it, yet a token blocked by min_tokens
# has logprob -inf; it is reported as this instead, as vLLM does.
BLOCKED_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else BLOCKED_LOGPROB


class TokenText:
    """Token id -> its text, decoded once per id (logprobs repeat the same alternatives)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


def completion_logprobs(entries: list[Logprob], token_text: TokenText,
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """The completions-API block for `entries`, starting at character `text_offset`;
    returns it and the offset after the last token (for the next streamed chunk)."""
    block = CompletionLogprobs()
    for entry in entries:
        token = token_text(entry.token_id)
        block.tokens.append(token)
        block.token_logprobs.append(_finite(entry.logprob))
        top = {token_text(t): _finite(lp) for t, lp in entry.top_logprobs}
        top.setdefault(token, _finite(entry.logprob))
        block.top_logprobs.append(top)
        block.text_offset.append(text_offset)
        text_offset += len(token)
    return block, text_offset


def chat_logprobs(entries: list[Logprob], token_text: TokenText) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = token_text(entry.token_id)
        content.append(ChatTokenLogprob(
            token=token, logprob=_finite(entry.logprob), bytes=list(token.encode()),
            top_logprobs=[TopLogprob(token=token_text(t), logprob=_finite(lp),
                                     bytes=list(token_text(t).encode()))
                          for t, lp in entry.top_logprobs]))
    return ChatLogprobs(content=content)
