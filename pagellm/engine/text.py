"""Text to token ids, for every way text reaches the engine (prompts, rendered chats).

JSON and Python strings can carry lone UTF-16 surrogates, which no tokenizer accepts; that
is the caller's error, so it becomes a ValueError naming the field, never a TypeError from
deep inside the tokenizer.
"""

from __future__ import annotations

from typing import Any


def encode_text(tokenizer: Any, text: str, name: str, add_special_tokens: bool) -> list[int]:
    """The token ids of `text`; `name` is the field it came from, for the error."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except (TypeError, UnicodeError) as error:
        raise ValueError(f"{name} is not valid Unicode text (lone surrogate?)") from error


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
