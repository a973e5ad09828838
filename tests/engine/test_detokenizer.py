"""IncrementalDetokenizer with the default model's real tokenizer (byte-level BPE, where
one character can take several tokens): the text always equals the decoded tokens, stop
strings respect min_tokens, and at the end the whole characters held back are written out
but a character the tokens left unfinished is not (vLLM's rule)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagellm.engine.detokenizer import IncrementalDetokenizer

PROMPT = "Say something:"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Any:
    from pagellm.model.loader import load_tokenizer

    return load_tokenizer(default_model_dir)


def _detokenizer(tokenizer: Any, stop: list[str] = (), min_tokens: int = 0,
                 include_stop: bool = False) -> IncrementalDetokenizer:
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    return IncrementalDetokenizer(tokenizer, prompt, list(stop), include_stop, True, min_tokens)


def _expected(tokenizer: Any, ids: list[int]) -> str:
    """What the output decodes to after the prompt, less the U+FFFD that stands for a
    character the tokens left unfinished (the detokenizer's contract)."""
    prompt = tokenizer.encode(PROMPT, add_special_tokens=False)
    text = str(tokenizer.decode(prompt + ids))[len(tokenizer.decode(prompt)):]
    return text.rstrip("\ufffd")


def test_text_ending_mid_character_keeps_only_whole_characters(tokenizer: Any) -> None:
    ids = tokenizer.encode(" Café 日本語 🎉", add_special_tokens=False)
    cut = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cut, "the test text must split a character across tokens"
    for k in cut:
        detok = _detokenizer(tokenizer)
        for token in ids[:k]:
            assert detok.add_token(token) is None
        held = detok.text
        assert detok.finish() is None
        assert detok.text == _expected(tokenizer, ids[:k]) == str(tokenizer.decode(ids[:k])).rstrip("\ufffd")
        assert detok.text.startswith(held) and not detok.text.endswith("\ufffd")
        assert detok.finish() is None and detok.text == _expected(tokenizer, ids[:k])


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1,
               max_size=24))
def test_text_equals_decoded_tokens_at_every_finish(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for end in range(1, len(ids) + 1):
        detok = _detokenizer(tokenizer)
        for token in ids[:end]:
            detok.add_token(token)
        detok.finish()
        assert detok.text == _expected(tokenizer, ids[:end])


def test_stop_string_inside_min_tokens_is_ignored(tokenizer: Any) -> None:
    ids = tokenizer.encode(" one two three two one", add_special_tokens=False)
    words = [tokenizer.decode([t]) for t in ids]
    assert words == [" one", " two", " three", " two", " one"]
    # " two" first ends token 2; with min_tokens=2 only the second " two" (token 4) stops.
    detok = _detokenizer(tokenizer, stop=[" two"], min_tokens=2)
    results = [detok.add_token(token) for token in ids[:4]]
    assert results == [None, None, None, " two"]
    assert detok.text == " one two three"
    # min_tokens=1: the first " two" is the second token, past min_tokens, and stops.
    detok = _detokenizer(tokenizer, stop=[" two"], min_tokens=1)
    assert [detok.add_token(token) for token in ids[:2]] == [None, " two"]
    assert detok.text == " one"


def test_stop_string_straddling_min_tokens_is_found(tokenizer: Any) -> None:
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    detok = _detokenizer(tokenizer, stop=["one two"], min_tokens=1, include_stop=True)
    assert [detok.add_token(token) for token in ids[:2]] == [None, "one two"]
    assert detok.text == " one two"


def test_finish_finds_a_stop_string_in_held_text(tokenizer: Any) -> None:
    ids = tokenizer.encode("ab 日", add_special_tokens=False)
    partial = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    assert tokenizer.decode(ids[:partial]) == "ab \ufffd"  # " " and half of 日 in one token
    detok = _detokenizer(tokenizer, stop=[" "])
    assert all(detok.add_token(token) is None for token in ids[:partial])
    assert detok.finish() == " "
    assert detok.text == "ab"


def test_a_cut_off_character_never_matches_a_stop_string(tokenizer: Any) -> None:
    """U+FFFD at the end stands for bytes of a character the sample never finished: the
    model did not write it, so a stop string containing U+FFFD does not match it."""
    ids = tokenizer.encode("ab 日", add_special_tokens=False)
    for stop in ("\ufffd", " \ufffd"):
        detok = _detokenizer(tokenizer, stop=[stop])
        assert all(detok.add_token(token) is None for token in ids[:2])
        assert detok.finish() is None and detok.stopped_by is None
        assert detok.text == "ab "


def test_a_short_stop_string_inside_min_tokens_is_ignored_beside_a_long_one(
        tokenizer: Any) -> None:
    """Each stop string is looked for only where it would end in the new text: a long
    one in the list must not widen the search back into the first min_tokens tokens."""
    ids = tokenizer.encode(" one two three two", add_special_tokens=False)
    for stop in ([" two"], [" two", "XXXXXXXXXXXXXXXX"], ["XXXXXXXXXXXXXXXX", " two"]):
        detok = _detokenizer(tokenizer, stop=stop, min_tokens=2)
        assert [detok.add_token(token) for token in ids] == [None, None, None, " two"]
        assert detok.text == " one two three"


def test_stop_strings_that_begin_together_go_by_list_order(tokenizer: Any) -> None:
    ids = tokenizer.encode(" Paris", add_special_tokens=False)
    assert len(ids) == 1
    for stop in (["Paris", "Pa"], ["Pa", "Paris"]):
        detok = _detokenizer(tokenizer, stop=stop, include_stop=True)
        assert detok.add_token(ids[0]) == stop[0]
        assert detok.text == " " + stop[0]
    # The match that begins first cuts the text, whatever the list's order.
    detok = _detokenizer(tokenizer, stop=["aris", "Paris"])
    assert detok.add_token(ids[0]) == "Paris" and detok.text == " "


def test_a_character_split_between_prompt_and_output_is_the_outputs_first(
        tokenizer: Any) -> None:
    """A prompt of token ids can end inside a character: the output's text begins with
    the character its tokens complete (the prompt's text alone shows U+FFFD there)."""
    ids = tokenizer.encode("Emoji: 🤖💪💪", add_special_tokens=False)
    marker = len(tokenizer.encode("Emoji: 🤖", add_special_tokens=False))
    splits = [k for k in range(marker + 1, len(ids))
              if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert splits, "the text must split a character across tokens"
    for k in splits:
        whole = str(tokenizer.decode(ids))
        shown = str(tokenizer.decode(ids[:k])).rstrip("\ufffd")
        detok = IncrementalDetokenizer(tokenizer, ids[:k], [], False, True)
        for token in ids[k:]:
            detok.add_token(token)
        detok.finish()
        assert detok.text == whole[len(shown):]
        assert detok.text.startswith("💪")


def test_spaces_between_special_tokens_reaches_the_tokenizer() -> None:
    """A tokenizer that decodes token by token (a "slow" one) reads the flag; a
    tokenizer.json ignores it, as vLLM's fast path does."""

    class Slow:
        def decode(self, ids: list[int], skip_special_tokens: bool,
                   spaces_between_special_tokens: bool) -> str:
            return (" " if spaces_between_special_tokens else "").join(
                "<s>" if token == 0 else "a" for token in ids)

    for spaces, text in ((True, "<s> <s>"), (False, "<s><s>")):
        detok = IncrementalDetokenizer(Slow(), [], [], False, False,
                                       spaces_between_special_tokens=spaces)
        detok.add_token(0)
        detok.add_token(0)
        assert detok.text == text


@settings(max_examples=60, deadline=None)
@given(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc"),
                             exclude_characters="\ufffd"), min_size=1, max_size=16))
def test_a_prompt_cut_anywhere_gives_the_rest_of_the_text(tokenizer: Any, text: str) -> None:
    """Wherever a prompt of token ids ends, even inside a character, its output's text is
    the rest of the whole text (for text the tokenizer spells exactly: it writes unassigned
    code points as bytes that decode to U+FFFD)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = str(tokenizer.decode(ids))
    assume(whole == text)
    for k in range(1, len(ids)):
        detok = IncrementalDetokenizer(tokenizer, ids[:k], [], False, True)
        for token in ids[k:]:
            detok.add_token(token)
        detok.finish()
        shown = str(tokenizer.decode(ids[:k])).rstrip("\ufffd")
        assert detok.text == whole[len(shown):]
