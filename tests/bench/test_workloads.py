"""The workload generators: same seed, same prompts; exact token counts; the structure
each workload promises (a shared prefix, growing conversations, a pool the prefixes
overflow, no sharing at all)."""

from __future__ import annotations

from typing import Any

import pytest

from pagellm.bench.compare import common_prefix
from pagellm.bench.text import TextGenerator
from pagellm.bench.workloads import (
    WORKLOAD_NAMES,
    ConversationState,
    build_workload,
    text_token_ids,
)


def test_text_generator_is_deterministic_and_reads_like_english() -> None:
    first, again, other = TextGenerator(7), TextGenerator(7), TextGenerator(8)
    text = first.paragraph(6)
    assert text == again.paragraph(6)
    assert text != other.paragraph(6)
    sentences = [s for s in text.split(". ") if s]
    assert len(sentences) >= 6
    assert all(s[0].isupper() for s in sentences)
    assert text.endswith(".")
    assert TextGenerator(3).question().endswith("?")


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_same_seed_same_workload_other_seed_other_prompts(tokenizer: Any, name: str) -> None:
    small = {"shared-prefix": dict(num_requests=3, prefix_len=64),
             "multi-turn": dict(num_conversations=2, num_turns=2, system_len=32, user_len=16),
             "few-shot": dict(num_requests=3, num_examples=2),
             "eviction": dict(num_requests=6, num_prefixes=4, prefix_len=64),
             "no-sharing": dict(num_requests=3, prompt_len=64)}[name]
    a = build_workload(name, tokenizer, seed=1, **small)
    b = build_workload(name, tokenizer, seed=1, **small)
    c = build_workload(name, tokenizer, seed=2, **small)
    assert a == b
    assert (a.prompts, a.conversations) != (c.prompts, c.conversations)


def test_text_token_ids_are_exact(tokenizer: Any) -> None:
    for count in (1, 17, 300):
        assert len(text_token_ids(TextGenerator(0), tokenizer, count)) == count


def _text_token_ids_plainly(gen: TextGenerator, tokenizer: Any, count: int) -> list[int]:
    """The definition: the shortest run of whole paragraphs whose text encodes to at
    least `count` ids, encoded whole, cut to `count`."""
    text = gen.paragraph()
    while len(ids := tokenizer.encode(text, add_special_tokens=False)) < count:
        text += " " + gen.paragraph()
    return list(ids[:count])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_token_ids_are_the_definitions_and_leave_the_generator_as_it(
        tokenizer: Any, seed: int) -> None:
    """Encoding the text whole only near the end gives the same ids as encoding it after
    every paragraph, and takes the same paragraphs from the generator (the next prompt's
    text is the same too), so workloads stay what they were for a seed."""
    fast, plain = TextGenerator(seed), TextGenerator(seed)
    for count in (5, 64, 200, 1024, 3000):
        assert text_token_ids(fast, tokenizer, count) == _text_token_ids_plainly(
            plain, tokenizer, count)
    assert fast.paragraph() == plain.paragraph()


def test_shared_prefix_has_the_requested_token_counts(tokenizer: Any) -> None:
    w = build_workload("shared-prefix", tokenizer, num_requests=4, prefix_len=128,
                       suffix_len=32, output_len=4)
    assert w.num_requests == 4 and w.output_len == 4
    assert all(len(p) == 160 for p in w.prompts)
    assert len({p[:128] for p in w.prompts}) == 1
    assert len({p[128:] for p in w.prompts}) == 4


def test_few_shot_shares_the_examples_and_differs_in_the_question(tokenizer: Any) -> None:
    w = build_workload("few-shot", tokenizer, num_requests=4, num_examples=3)
    prefix = w.params["prefix_len"]
    assert prefix > 50
    assert len({p[:prefix] for p in w.prompts}) == 1
    assert len({p[prefix:] for p in w.prompts}) == 4
    assert "Answer:" in tokenizer.decode(list(w.prompts[0][prefix:]))


def test_eviction_prefixes_are_more_than_twice_the_pool(tokenizer: Any) -> None:
    w = build_workload("eviction", tokenizer, num_requests=24, num_prefixes=12,
                       prefix_len=256, suffix_len=16, output_len=8)
    assert w.kv_cache_tokens is not None
    prefixes = {p[:256] for p in w.prompts}
    assert 1 < len(prefixes) <= 12
    assert 12 * 256 > 2 * w.kv_cache_tokens
    assert w.kv_cache_tokens >= 4 * (256 + 16 + 8)
    assert all(len(p) == 272 for p in w.prompts)


def test_no_sharing_prompts_share_no_first_block(tokenizer: Any) -> None:
    w = build_workload("no-sharing", tokenizer, num_requests=16, prompt_len=96)
    assert all(len(p) == 96 for p in w.prompts)
    longest = max(common_prefix(list(a), list(b)) for i, a in enumerate(w.prompts)
                  for b in w.prompts[i + 1:])
    assert longest < 16


def test_multi_turn_conversations_grow_turn_by_turn(tokenizer: Any) -> None:
    w = build_workload("multi-turn", tokenizer, num_conversations=3, num_turns=3,
                       system_len=32, user_len=16)
    assert w.is_multi_turn and w.num_requests == 9
    assert len({c.system for c in w.conversations}) == 1
    state = ConversationState(w.conversations[0])
    previous: list[int] = []
    for turn in range(3):
        prompt = state.next_prompt(tokenizer)
        assert len(prompt) > len(previous)
        assert prompt[: len(previous)] == previous
        state.record_answer(f"Answer number {turn}.")
        previous = prompt
    assert state.done
    assert [m["role"] for m in state.messages] == ["system"] + ["user", "assistant"] * 3
    assert "Answer number 1." in tokenizer.decode(previous)


def test_unknown_workload_or_option_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("everything", tokenizer)
    with pytest.raises(ValueError, match="does not take prefix_len"):
        build_workload("no-sharing", tokenizer, prefix_len=10)
    with pytest.raises(ValueError, match="positive"):
        build_workload("shared-prefix", tokenizer, prefix_len=0)
