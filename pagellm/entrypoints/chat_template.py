"""A conversation to prompt token ids through the model's chat template.

Shared by the server and the CLI so a conversation renders to the same tokens (and so
hits the same cached prefix) whichever way it arrives.
"""

from __future__ import annotations

from typing import Any

Message = dict[str, str]


def render_chat_text(tokenizer: Any, conversation: list[Message]) -> str:
    """`conversation` plus the opening of the assistant's turn, as template text."""
    return str(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                             tokenize=False))


def render_chat(tokenizer: Any, conversation: list[Message]) -> list[int]:
    """Token ids of `conversation` plus the opening of the assistant's turn.

    Rendered to text first and then encoded without special tokens: the template already
    wrote them, and adding a BOS again would change the prompt.
    """
    return list(tokenizer.encode(render_chat_text(tokenizer, conversation),
                                 add_special_tokens=False))
