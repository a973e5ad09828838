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
    (Control characters aside: this tokenizer drops a few, \x04 and \x16 among them, so
    a text of those could be refused though it fits; vLLM's bound is the same.)"""
    ids = encode_text(tokenizer, text, "prompt", add_special_tokens=False)
    chars = max_chars_per_token(tokenizer)
    assert chars is not None and len(ids) * chars >= len(text)


def test_text_past_the_bound_is_refused_and_text_within_it_encoded(tokenizer: Any) -> None:
    chars = max_chars_per_token(tokenizer)
    assert chars == 81
    limit = 9 * chars
    with pytest.raises(TextTooLong, match=f"the prompt text is {limit + 1} characters long"):
        encode_text(tokenizer, " " * (limit + 1), "prompt", False, max_model_len=10)
    assert encode_text(tokenizer, " " * limit, "prompt", False, max_model_len=10)
    assert encode_text(tokenizer, "x" * 10 * limit, "prompt", False)  # no bound asked


def test_no_bound_where_a_special_token_swallows_whitespace(default_model_dir: Path) -> None:
    """A special token that strips the spaces beside it is one token for any run of them:
    no length bound holds, so none is applied."""
    from transformers import AddedToken

    from pagellm.model.loader import load_tokenizer

    stripping = load_tokenizer(default_model_dir)
    stripping.add_tokens([AddedToken("<x>", rstrip=True, special=True)])
    assert max_chars_per_token(stripping) is None
    text = "<x>" + " " * 5000
    assert len(encode_text(stripping, text, "prompt", False, max_model_len=40)) < 40
