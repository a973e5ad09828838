"""The engine's per-token logprobs in the two shapes OpenAI uses.

The legacy completions API lists tokens, their logprobs, a {token: logprob} map of the
alternatives and character offsets; chat lists one object per token with its UTF-8
bytes, since a single token can be part of a multi-byte character.
"""

from __future__ import annotations

import math
import re
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


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the other 68 are shifted to U+0100 onwards."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in alphabet.values())
    alphabet.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return alphabet


_BYTE_LEVEL = _byte_level_alphabet()


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(tokenizer: Any) -> str:
    """The fast tokenizer's decoder description (its JSON, a few hundred bytes; the whole
    tokenizer's JSON is megabytes), or "" without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return ""
    return bytes(decoder.__getstate__()).decode()


class TokenText:
    """Token id -> its text and its UTF-8 bytes, each worked out once per id (logprobs
    repeat the same alternatives).

    A token that holds part of a character decodes to U+FFFD; its real bytes are what
    chat's `bytes` field is for, so a client can join tokens into text. They are read
    from the vocabulary: byte-level BPE pieces map one character to one byte, and
    SentencePiece byte-fallback pieces are written `<0xE6>` (with `▁` for a space).
    Other tokenizers fall back to the text's bytes. With `as_token_ids` (vLLM's
    `return_tokens_as_token_ids`) a token's text is `token_id:N`, which no two tokens
    share.
    """

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self._as_ids = as_token_ids
        self._kinds: tuple[bool, bool] | None = None  # read on the first `bytes` call
        self._text: dict[int, str] = {}
        self._decoded: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self._as_ids
                    else self.tokenizer.decode([token_id]))
            self._text[token_id] = text
        return text

    def decoded(self, token_id: int) -> str:
        """The token's text even with `as_token_ids`: vLLM's `decoded_token` in
        prompt_logprobs, which that option leaves alone."""
        if not self._as_ids:
            return self(token_id)
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own UTF-8 bytes (see the class docstring)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._vocabulary_bytes(token_id)
            if raw is None:
                raw = list(self.tokenizer.decode([token_id]).encode())
            self._bytes[token_id] = raw
        return raw

    def _vocabulary_bytes(self, token_id: int) -> list[int] | None:
        """Bytes spelled by the vocabulary piece (an added token is written as itself);
        None for a tokenizer of another kind."""
        if self._kinds is None:
            decoder = _decoder_kinds(self.tokenizer)
            self._kinds = ('"ByteLevel"' in decoder, '"ByteFallback"' in decoder)
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).get(token_id)
        if added is not None:
            return list(str(added.content).encode())
        byte_level, byte_fallback = self._kinds
        if not (byte_level or byte_fallback):
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str) or not piece:
            return None
        if byte_level and all(c in _BYTE_LEVEL for c in piece):
            return [_BYTE_LEVEL[c] for c in piece]
        if byte_fallback:
            byte = _BYTE_PIECE.fullmatch(piece)
            if byte is not None:
                return [int(byte.group(1), 16)]
            return list(piece.replace("\u2581", " ").encode())
        return None


def _top(entry: Logprob, token: str, token_text: TokenText, num_top: int | None = None
         ) -> dict[str, float]:
    """{text: logprob} of the scored token, first as in vLLM, then the (first `num_top`)
    alternatives. Distinct tokens can share a text (parts of characters all read U+FFFD):
    the most likely of them keeps the key, so that the largest value is the top
    token's, as lm-evaluation-harness reads it (a scored token below the top one is not
    greedy), and the scored token's own logprob stays in `token_logprobs`."""
    top = {token: _finite(entry.logprob)}
    for alternative, logprob in entry.top_logprobs[:num_top]:
        text = token_text(alternative)
        top[text] = max(top.get(text, -math.inf), _finite(logprob))
    return top


def echoed_prompt_logprobs(prompt_token_ids: list[int], scores: list[Logprob | None],
                           token_text: TokenText, text_length: int, num_top: int
                           ) -> CompletionLogprobs:
    """The completions-API block of an echoed prompt (`echo` with `logprobs` = `num_top`):
    its first token has no logprob, as in OpenAI's and vLLM's answers. Offsets add up the
    tokens' texts (their own, also where they are named `token_id:N`), capped at the
    echoed text's length."""
    block = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_token_ids, scores, strict=True):
        token = token_text(token_id)
        block.tokens.append(token)
        block.token_logprobs.append(None if entry is None else _finite(entry.logprob))
        block.top_logprobs.append(None if entry is None
                                  else _top(entry, token, token_text, num_top))
        block.text_offset.append(min(offset, text_length))
        offset += len(token_text.decoded(token_id))
    return block


def joined(first: CompletionLogprobs, second: CompletionLogprobs, shift: int
           ) -> CompletionLogprobs:
    """`second` after `first`, its offsets moved by `shift` characters."""
    return CompletionLogprobs(
        text_offset=first.text_offset + [offset + shift for offset in second.text_offset],
        token_logprobs=first.token_logprobs + second.token_logprobs,
        tokens=first.tokens + second.tokens,
        top_logprobs=first.top_logprobs + second.top_logprobs)


def prompt_logprobs_json(scores: list[Logprob | None], token_text: TokenText, num_top: int
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank,
    decoded_token}} for it (first, as in vLLM and the offline Logprob mapping) and its
    first `num_top` alternatives; None for the first token."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for entry in scores:
        if entry is None:
            result.append(None)
            continue
        ranked = {str(entry.token_id): {"logprob": _finite(entry.logprob), "rank": entry.rank,
                                        "decoded_token": token_text.decoded(entry.token_id)}}
        for rank, (t, lp) in enumerate(entry.top_logprobs[:num_top], 1):
            ranked.setdefault(str(t), {"logprob": _finite(lp), "rank": rank,
                                       "decoded_token": token_text.decoded(t)})
        result.append(ranked)
    return result


def completion_logprobs(entries: list[Logprob], token_text: TokenText,
                        text_length: int | None) -> CompletionLogprobs:
    """The completions-API block for `entries`. Offsets come from the detokenizer, so a
    character split over tokens does not push later ones off; `text_length`, given once
    the text is final, caps the offset of a token a stop string cut away."""
    block = CompletionLogprobs()
    for entry in entries:
        token = token_text(entry.token_id)
        block.tokens.append(token)
        block.token_logprobs.append(_finite(entry.logprob))
        block.top_logprobs.append(_top(entry, token, token_text))
        offset = entry.text_offset
        block.text_offset.append(offset if text_length is None else min(offset, text_length))
    return block


def chat_logprobs(entries: list[Logprob], token_text: TokenText) -> ChatLogprobs:
    content = []
    for entry in entries:
        token = token_text(entry.token_id)
        content.append(ChatTokenLogprob(
            token=token, logprob=_finite(entry.logprob), bytes=token_text.bytes(entry.token_id),
            top_logprobs=[TopLogprob(token=token_text(t), logprob=_finite(lp),
                                     bytes=token_text.bytes(t))
                          for t, lp in entry.top_logprobs]))
    return ChatLogprobs(content=content)
