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
