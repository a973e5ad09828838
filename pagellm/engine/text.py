"""Text to token ids, for every way text reaches the engine (prompts, rendered chats).

JSON and Python strings can carry lone UTF-16 surrogates, which no tokenizer accepts; that
is the caller's error, so it becomes a ValueError naming the field, never a TypeError from
deep inside the tokenizer.
"""

from __future__ import annotations

import weakref
from typing import Any


class TextTooLong(ValueError):
    """Text too long for any prompt the context holds, known from its length alone."""


def check_unicode(text: str, name: str) -> None:
    """A ValueError naming `name` where `text` holds a lone surrogate, which neither a
    tokenizer nor UTF-8 (a block hash, a JSON reply) accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode text (lone surrogate?)") from None


_MAX_CHARS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters one token of `tokenizer` spells: its longest vocabulary entry
    (a byte-level entry is at least as long as the text it decodes to). None where no
    such bound holds: a special token that strips the whitespace beside it swallows a
    run of any length. Kept beside the tokenizer, not keeping it alive."""
    if tokenizer not in _MAX_CHARS:
        added = getattr(tokenizer, "added_tokens_decoder", {}).values()
        strips = any(getattr(token, "lstrip", False) or getattr(token, "rstrip", False)
                     for token in added)
        _MAX_CHARS[tokenizer] = (None if strips else
                                 max(len(token) for token in tokenizer.get_vocab()))
    return _MAX_CHARS[tokenizer]


def encode_text(tokenizer: Any, text: str, name: str, add_special_tokens: bool,
                max_model_len: int | None = None) -> list[int]:
    """The token ids of `text`; `name` is the field it came from, for the error.

    With `max_model_len`, text longer than `max_model_len - 1` tokens could spell is
    refused (TextTooLong) before it is tokenized, as vLLM refuses it: a few megabytes
    take seconds to encode, on the thread every request's tokens wait for, only to be
    refused as too long. (Characters the tokenizer drops, a few control characters for
    the default model's, count toward the bound, as in vLLM.)"""
    chars = None if max_model_len is None else max_chars_per_token(tokenizer)
    if max_model_len is not None and chars is not None:
        limit = (max_model_len - 1) * chars
        if len(text) > limit:
            raise TextTooLong(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"the {name} text is {len(text)} characters long (more than {limit}, the most "
                f"that {max_model_len - 1} tokens of at most {chars} characters spell, "
                f"leaving one token to generate). Please shorten it.")
    check_unicode(text, name)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token sequences that spell each bad word: alone and after a space, since a
    word mid-text usually tokenizes with its leading space (" hello" is one token, not
    " " and "hello"). vLLM keeps the after-a-space spelling only when it has as many
    tokens as the bare one; here it is always kept, since " Paris" may be one token
    where "Paris" is two, and that is how the word appears mid-sentence."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = encode_text(tokenizer, text, "bad_words", add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
