"""encode_text's length bound with the default model's real tokenizer: text it refuses
unread really is too long, whatever the text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.engine.text import TextTooLong, encode_text, max_chars_per_token


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from pagellm.model.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1,
                    max_size=400)
       | st.lists(st.sampled_from([" ", "\n", "\t", "a", "é", "💪", "的", "\u0301", "<|im_end|>",
                                   "    ", "ab" * 40]), min_size=1, max_size=200).map("".join))
def test_no_text_spells_more_characters_per_token_than_the_bound(tokenizer: Any,
                                                                 text: str) -> None:
    """The bound's premise: n tokens spell at most n * max_chars_per_token characters.
    (Control characters aside: this tokenizer drops them, so a text of them could be
    refused though it fits; vLLM's bound is the same.)"""
    ids = encode_text(tokenizer, text, "prompt", add_special_tokens=False)
    assert len(ids) * max_chars_per_token(tokenizer) >= len(text)


def test_text_past_the_bound_is_refused_and_text_within_it_encoded(tokenizer: Any) -> None:
    limit = 9 * max_chars_per_token(tokenizer)
    with pytest.raises(TextTooLong, match=f"prompt is {limit + 1} characters long"):
        encode_text(tokenizer, " " * (limit + 1), "prompt", False, max_model_len=10)
    assert encode_text(tokenizer, " " * limit, "prompt", False, max_model_len=10)
    assert encode_text(tokenizer, "x" * 10 * limit, "prompt", False)  # no bound asked
