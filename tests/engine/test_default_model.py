"""The default model (SmolLM2-135M-Instruct) on real text: exact against transformers,
the prefix cache used across chat turns, stop strings and detokenization."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from pagellm import SamplingParams
from pagellm.engine.chat_template import (
    ChatError,
    load_chat_template,
    render_chat,
    use_chat_template,
)
from pagellm.engine.text import bad_words_token_ids
from tests.engine.conftest import assert_greedy_equal, assert_idle, hf_greedy

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous travel assistant. You answer questions about cities, "
          "museums, food and transport in Europe with short, factual sentences, and you "
          "always mention one practical tip for visitors at the end of your answer.")
QUESTIONS = ["What should I see in Paris?", "How do I get around Berlin?",
             "Which food is typical in Rome?"]


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_chat_matches_reference_and_reuses_system_prompt(default_llm: Any,
                                                         default_hf_model: Any) -> None:
    llm = default_llm
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.chat(_chat(QUESTIONS[0]), params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    rest = llm.chat([_chat(q) for q in QUESTIONS[1:]], params, use_tqdm=False)
    system_tokens = len(llm.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False))
    for out in rest:
        assert out.num_cached_tokens >= (system_tokens // 16 - 1) * 16 > 0
    for out in [first, *rest]:
        ref = hf_greedy(default_hf_model, out.prompt_token_ids, 24)
        assert_greedy_equal(default_hf_model, out.prompt_token_ids,
                            out.outputs[0].token_ids, ref, "default model chat")
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids,
                                                           skip_special_tokens=True)
        # The rendered conversation, as vLLM's chat reports it.
        assert out.prompt is not None and out.prompt.endswith("<|im_start|>assistant\n")
        assert llm.tokenizer.encode(out.prompt) == out.prompt_token_ids
    assert_idle(llm.llm_engine)


def test_prefix_caching_off_gives_identical_tokens(default_llm: Any) -> None:
    from pagellm import LLM

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [_chat(q) for q in QUESTIONS]
    on = [o.outputs[0].token_ids for o in default_llm.chat(prompts, params, use_tqdm=False)]
    off_llm = LLM(enable_prefix_caching=False, kv_cache_memory_bytes=16 << 20)
    off = [o.outputs[0].token_ids for o in off_llm.chat(prompts, params, use_tqdm=False)]
    assert on == off
    assert off_llm.llm_engine.get_stats().prefix_cache_hits == 0


def test_stop_string_cuts_text(default_llm: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=40)
    base = default_llm.chat(_chat(QUESTIONS[1]), params, use_tqdm=False)[0].outputs[0]
    words = base.text.split()
    assert len(words) > 3, base.text
    stop = words[2]
    out = default_llm.chat(_chat(QUESTIONS[1]), SamplingParams(temperature=0, max_tokens=40,
                                                               stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    assert_idle(default_llm.llm_engine)


def test_text_prompt_and_finish_reasons(default_llm: Any) -> None:
    out = default_llm.generate("The capital of France is",
                               SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 5
    assert out.prompt == "The capital of France is"
    eos = default_llm.chat(_chat("Say hi."), SamplingParams(temperature=0, max_tokens=200),
                           use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop"
    assert_idle(default_llm.llm_engine)


def test_stopping_token_adds_no_text_unless_asked(default_llm: Any) -> None:
    """As in vLLM: EOS or a stop token id ends the request, stays in token_ids, and adds
    its text only with include_stop_str_in_output."""
    tokenizer = default_llm.get_tokenizer()
    base = default_llm.generate("The capital of France is",
                                SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0].outputs[0]
    stop_token = next(t for t in base.token_ids[1:] if tokenizer.decode([t]).strip())
    first = base.token_ids.index(stop_token)
    for include in (False, True):
        out = default_llm.generate(
            "The capital of France is",
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token],
                           include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[: first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_token
        shown = out.token_ids if include else out.token_ids[:-1]
        assert out.text == tokenizer.decode(shown)
    eos = default_llm.chat(_chat("Say hi."),
                           SamplingParams(temperature=0, max_tokens=200,
                                          skip_special_tokens=False),
                           use_tqdm=False)[0].outputs[0]
    assert eos.finish_reason == "stop" and eos.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token not in eos.text
    assert eos.text == tokenizer.decode(eos.token_ids[:-1], skip_special_tokens=False)
    assert_idle(default_llm.llm_engine)


def test_stop_string_in_the_last_token_is_the_finish_reason(default_llm: Any) -> None:
    """max_tokens and a stop string reached on the same token: the text is cut at the
    stop string, so that is the reason reported."""
    tokenizer = default_llm.get_tokenizer()
    base = default_llm.generate("The capital of France is",
                                SamplingParams(temperature=0, max_tokens=16),
                                use_tqdm=False)[0].outputs[0]
    k, stop = next(
        (k, tokenizer.decode([base.token_ids[k - 1]]).strip()) for k in range(2, 17)
        if tokenizer.decode([base.token_ids[k - 1]]).strip()
        and tokenizer.decode([base.token_ids[k - 1]]).strip()
        not in tokenizer.decode(base.token_ids[: k - 1]))
    out = default_llm.generate("The capital of France is",
                               SamplingParams(temperature=0, max_tokens=k, stop=[stop]),
                               use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == k
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]


def test_output_ending_mid_character_leaves_that_character_out(default_llm: Any) -> None:
    """When max_tokens cuts a character in half, the text is the tokens' whole characters,
    as vLLM's: no U+FFFD at the end for a client to show."""
    tokenizer = default_llm.get_tokenizer()
    prompt = "日本語で自己紹介してください。"
    base = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24),
                                use_tqdm=False)[0].outputs[0]
    cut = [k for k in range(1, 25)
           if tokenizer.decode(base.token_ids[:k]).endswith("\ufffd")]
    assert cut, tokenizer.decode(base.token_ids)
    out = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=cut[0]),
                               use_tqdm=False)[0].outputs[0]
    assert tokenizer.decode(out.token_ids).endswith("\ufffd")
    assert out.text == tokenizer.decode(out.token_ids).rstrip("\ufffd")
    assert base.text.startswith(out.text)


def test_a_beam_cut_in_the_middle_of_a_character_leaves_it_out(default_llm: Any) -> None:
    """beam_search's text (prompt and continuation decoded together) follows generate's
    rule: no U+FFFD for a character the search cut in half."""
    from pagellm import BeamSearchParams

    tokenizer = default_llm.get_tokenizer()
    prompt = "Emoji party: 🎉🎉🥳🥳🎉"
    cut = 0
    for max_tokens in (1, 2, 3):
        for beam in default_llm.beam_search(
                [prompt], BeamSearchParams(beam_width=2, max_tokens=max_tokens))[0].sequences:
            whole = tokenizer.decode(beam.tokens, skip_special_tokens=True)
            cut += whole.endswith("\ufffd")
            assert beam.text == whole.rstrip("\ufffd")
    assert cut, "the prompt must make a beam end inside a character"


def test_chat_refuses_bad_conversations_and_options(default_llm: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=2)
    bad = [([[]], "empty"),
           ([{"role": 5, "content": "hi"}], r"messages\[0\]\.role"),
           ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
           ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts"),
           ([{"role": "user", "content": "x", "name": 5}], r"messages\[0\]\.name"),
           ([{"role": "assistant", "content": "", "tool_calls": "abc"}],
            r"messages\[0\]\.tool_calls")]
    for messages, message in bad:
        with pytest.raises(ValueError, match=message):
            default_llm.chat(messages, params, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is not valid Unicode"):
        default_llm.generate("a\ud800b", params, use_tqdm=False)
    # One conversation that cannot run raises, as one prompt does in generate.
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.chat(_chat("word " * 9000), params, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        default_llm.chat(_chat("Hi"), SamplingParams(logit_bias={10**7: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        default_llm.chat(_chat("Hi"), params, continue_final_message=True, use_tqdm=False)
    assert_idle(default_llm.llm_engine)


def test_chat_continues_the_final_message(default_llm: Any) -> None:
    tokenizer = default_llm.get_tokenizer()
    messages = [*_chat("What is 2 + 2?"), {"role": "assistant", "content": "The answer is"}]
    out = default_llm.chat(messages, SamplingParams(temperature=0, max_tokens=5),
                           continue_final_message=True, add_generation_prompt=False,
                           use_tqdm=False)[0]
    assert tokenizer.decode(out.prompt_token_ids).endswith("assistant\nThe answer is")
    parts = default_llm.chat(
        [*_chat("What is 2 + 2?"), {"role": "assistant",
                                     "content": [{"type": "text", "text": "The answer is"}]}],
        SamplingParams(temperature=0, max_tokens=5), continue_final_message=True,
        add_generation_prompt=False, use_tqdm=False)[0]
    assert parts.prompt_token_ids == out.prompt_token_ids
    assert parts.outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_continues_a_final_user_message(default_llm: Any) -> None:
    """As in vLLM and transformers, continue_final_message leaves any role's message
    open: the model completes the user's half-written text."""
    tokenizer = default_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5)
    out = default_llm.chat(_chat("The capital of France is"), params,
                           continue_final_message=True, add_generation_prompt=False,
                           use_tqdm=False)[0]
    assert tokenizer.decode(out.prompt_token_ids).endswith("user\nThe capital of France is")
    same = default_llm.generate({"prompt_token_ids": out.prompt_token_ids}, params,
                                use_tqdm=False)[0]
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    assert_idle(default_llm.llm_engine)


def test_second_chat_turn_hits_the_first_turn_and_its_answer(default_llm: Any) -> None:
    """The multi-turn case PITFALLS warns about: if the template re-rendered an earlier
    turn differently, or generated tokens' blocks were not cached, the hit would stop at
    the system prompt. It must reach into the first answer."""
    llm = default_llm
    llm.reset_prefix_cache()
    block = llm.llm_engine.kv_manager.block_size
    params = SamplingParams(temperature=0, max_tokens=40)
    conversation = _chat(QUESTIONS[2])
    first = llm.chat(conversation, params, use_tqdm=False)[0]
    answer = first.outputs[0]
    conversation += [{"role": "assistant", "content": answer.text},
                     {"role": "user", "content": "And which drink goes with it?"}]
    second = llm.chat(conversation, params, use_tqdm=False)[0]
    computed = first.prompt_token_ids + answer.token_ids[:-1]  # the last token is never fed
    common = next((i for i, (a, b) in enumerate(zip(computed, second.prompt_token_ids,
                                                    strict=False)) if a != b),
                  min(len(computed), len(second.prompt_token_ids)))
    assert common > len(first.prompt_token_ids) + block, "the re-rendered answer must match"
    assert second.num_cached_tokens == common // block * block
    assert_idle(llm.llm_engine)


def test_logprobs_read_as_vllm_dicts(default_llm: Any) -> None:
    """vLLM code reads each position as {token id: Logprob(logprob, rank, decoded_token)},
    the chosen token first: that runs unchanged on PageLLM's records."""
    tokenizer = default_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    (out,) = default_llm.generate("The capital of France is", params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=True):
        assert next(iter(position)) == token_id and len(position) in (3, 4)
        entry = position[token_id]
        assert entry.logprob == position.logprob and entry.rank == 1  # greedy
        assert entry.decoded_token == tokenizer.decode([token_id])
        ranks = sorted(e.rank for e in position.values())
        assert ranks == list(range(1, len(position) + 1))
        assert dict(position.items()) == {t: position[t] for t in position} == position
        assert repr(position) == repr(dict(position.items()))  # printed as vLLM's dict
    assert sum(p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs,
                                             strict=True)) == pytest.approx(
        completion.cumulative_logprob)
    prompt_logprobs = out.prompt_logprobs
    assert prompt_logprobs is not None and prompt_logprobs[0] is None
    for token_id, position in zip(out.prompt_token_ids[1:], prompt_logprobs[1:], strict=True):
        assert position is not None and token_id in position
        assert position[token_id].decoded_token == tokenizer.decode([token_id])
        assert len(position) in (2, 3)


def test_detokenize_false_and_truncate_prompt_tokens(default_llm: Any) -> None:
    """vLLM's two SamplingParams: token ids without text, and only a prompt's tail."""
    prompt = "The capital of France is"
    base = dict(temperature=0, max_tokens=5, ignore_eos=True)
    (text_run,) = default_llm.generate(prompt, SamplingParams(**base, logprobs=1),
                                       use_tqdm=False)
    (ids_run,) = default_llm.generate(prompt, SamplingParams(**base, logprobs=1,
                                                             detokenize=False),
                                      use_tqdm=False)
    assert ids_run.outputs[0].token_ids == text_run.outputs[0].token_ids
    assert text_run.outputs[0].text and ids_run.outputs[0].text == ""
    position = ids_run.outputs[0].logprobs[0]
    assert position[position.token_id].decoded_token is None

    (tail,) = default_llm.generate(prompt, SamplingParams(**base, truncate_prompt_tokens=3),
                                   use_tqdm=False)
    ids = default_llm.get_tokenizer().encode(prompt)
    assert tail.prompt_token_ids == ids[-3:] and tail.prompt is None
    (same,) = default_llm.generate({"prompt_token_ids": ids[-3:]}, SamplingParams(**base),
                                   use_tqdm=False)
    assert tail.outputs[0].token_ids == same.outputs[0].token_ids


def test_a_numpy_array_of_strings_is_a_batch(default_llm: Any) -> None:
    """A dataset column of texts runs as its prompts (a numeric 1-D array is one prompt)."""
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    texts = ["The capital of France is", "One, two, three,"]
    column = default_llm.generate(np.array(texts), params, use_tqdm=False)
    listed = default_llm.generate(texts, params, use_tqdm=False)
    assert [o.prompt for o in column] == texts
    assert [o.outputs[0].token_ids for o in column] == [o.outputs[0].token_ids for o in listed]


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_and_allowed_token_ids(default_llm: Any) -> None:
    """vLLM's two vocabulary limits: a banned word is never generated in either spelling
    (alone or after a space), and allowed_token_ids is all a request can draw from."""
    llm = default_llm
    prompt = "Q: What is the capital of France?\nA: The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (base,) = llm.generate(prompt, params, use_tqdm=False)
    assert base.outputs[0].text.startswith(" Paris")
    spellings = bad_words_token_ids(llm.get_tokenizer(), ["Paris", "New York"])
    assert len(spellings) == 4  # "Paris", " Paris", "New York", " New York"
    banned, other = llm.generate([prompt, prompt], [params.clone(bad_words=["Paris", "New York"]),
                                                    params], use_tqdm=False)
    assert other.outputs[0].token_ids == base.outputs[0].token_ids  # no leak across rows
    tokens = list(banned.outputs[0].token_ids)
    assert tokens != list(base.outputs[0].token_ids)
    assert not any(_contains(tokens, word) for word in spellings)
    assert "Paris" not in banned.outputs[0].text
    (paris,) = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)
    with pytest.raises(ValueError, match="leaves nothing to generate"):
        llm.generate(prompt, params.clone(allowed_token_ids=[paris], bad_words=["Paris"]),
                     use_tqdm=False)

    allowed = llm.get_tokenizer().encode(" the cat sat on a mat.", add_special_tokens=False)
    runs = llm.generate([prompt] * 3, [SamplingParams(temperature=1.5, seed=s, max_tokens=12,
                                                      allowed_token_ids=allowed)
                                       for s in range(3)], use_tqdm=False)
    drawn = {t for run in runs for t in run.outputs[0].token_ids}
    assert drawn <= set(allowed) and len(drawn) > 1
    (greedy,) = llm.generate(prompt, params.clone(allowed_token_ids=allowed), use_tqdm=False)
    assert set(greedy.outputs[0].token_ids) <= set(allowed)
    assert_idle(llm.llm_engine)


def test_a_chat_template_given_at_start_replaces_the_models(default_llm: Any,
                                                            tmp_path: Path) -> None:
    """`--chat-template`: a template or the file holding one, checked by rendering before
    it is used; a model left without one says so instead of a template error."""
    tokenizer = copy.deepcopy(default_llm.get_tokenizer())
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert load_chat_template(template) == template
    (tmp_path / "t.jinja").write_text(template)
    assert load_chat_template(str(tmp_path / "t.jinja")) == template
    with pytest.raises(ValueError, match="missing.jinja"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="neither a file nor a template"):
        load_chat_template("")
    (tmp_path / "{odd}.jinja").write_text(template)  # a file first, as vLLM looks
    assert load_chat_template(str(tmp_path / "{odd}.jinja")) == template
    use_chat_template(tokenizer, template)
    assert render_chat(tokenizer, [{"role": "user", "content": "Hi"}]) == tokenizer.encode(
        "<user>Hi", add_special_tokens=False)
    with pytest.raises(ValueError, match="--chat-template"):
        use_chat_template(tokenizer, "{% for m in messages %}")
    assert tokenizer.chat_template == template
    tokenizer.chat_template = None
    with pytest.raises(ChatError, match="no chat template"):
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}])


def test_a_tokenizer_past_the_models_vocabulary_is_refused_per_prompt(
        default_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A tokenizer that does not fit its model (found by an outside run: 49,152 tokens
    beside a 384-token embedding) is named at start, and a prompt it encodes past the
    vocabulary is refused alone, not an IndexError in the model run."""
    import shutil

    from pagellm import LLM
    from tests.engine.conftest import make_tiny_model

    path = make_tiny_model(tmp_path / "small")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    with caplog.at_level("WARNING", logger="pagellm"):
        llm = LLM(str(path), num_threads=1)
    assert "the tokenizer has 49152 tokens, the model's vocabulary 384" in caplog.text
    refused, fine = llm.generate(["Hello world, how are you today?", [5, 6, 7]],
                                 SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert "past the model's vocabulary of 384" in (refused.error or "")
    assert len(fine.outputs[0].token_ids) == 2
    assert_idle(llm.llm_engine)


def test_chat_takes_vllms_arguments_in_vllms_order(default_llm: Any) -> None:
    """`chat(messages, params, use_tqdm, lora_request, priority, chat_template,
    chat_template_content_format, ...)` as in vLLM; a template that loops over a
    message's content gets OpenAI's parts under "auto", as vLLM's detection gives them."""
    template = ("{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}"
                "[{{ part.text }}]{% endfor %}{% endfor %}<assistant>")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                             {"type": "text", "text": "there"}]}]
    params = SamplingParams(temperature=0, max_tokens=2)
    tokenizer = default_llm.get_tokenizer()
    auto = default_llm.chat(messages, params, False, None, 0, template)[0]
    assert tokenizer.decode(auto.prompt_token_ids) == "<user>[Hi][there]<assistant>"
    openai = default_llm.chat(messages, params, False, None, 0, template, "openai")[0]
    assert openai.prompt_token_ids == auto.prompt_token_ids
    string = default_llm.chat(messages, params, use_tqdm=False, chat_template=template,
                              chat_template_content_format="string")[0]
    assert tokenizer.decode(string.prompt_token_ids) == "<user>[][][][][][][][]<assistant>"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        default_llm.chat(messages, params, use_tqdm=False,
                         chat_template_content_format="parts")
    assert default_llm.chat(messages, params, use_tqdm=False, tokenization_kwargs={},
                            mm_processor_kwargs=None)[0].outputs[0].token_ids
    assert default_llm.chat([], params) == []  # no conversations, as in vLLM
    with pytest.raises(ValueError, match="text-only"):
        default_llm.generate("Hi", params, use_tqdm=False, mm_processor_kwargs={"a": 1})


def test_tokenization_kwargs_cut_and_tokenize_prompts_as_vllm_0_32_does(
        default_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.32 cuts prompts through `tokenization_kwargs` (its SamplingParams lost
    truncate_prompt_tokens): the prompt keeps its last tokens, and the answer is the one
    those tokens alone give. Keys it would not honour are refused by name."""
    params = SamplingParams(temperature=0, max_tokens=4)
    prompt = "The capital of France is"
    whole = default_llm.get_tokenizer().encode(prompt)
    alone = default_llm.generate([whole[-3:]], params, use_tqdm=False)[0]
    for kwargs in ({"truncate_prompt_tokens": 3}, {"truncation": True, "max_length": 3},
                   {"truncation": "longest_first", "max_length": 3, "truncation_side": "left"}):
        cut = default_llm.generate(prompt, params, use_tqdm=False, tokenization_kwargs=kwargs)
        assert cut[0].prompt_token_ids == whole[-3:], kwargs
        assert cut[0].outputs[0].token_ids == alone.outputs[0].token_ids, kwargs
    start = default_llm.generate(prompt, params, use_tqdm=False, tokenization_kwargs={
        "truncate_prompt_tokens": 3, "truncation_side": "right"})[0]  # the server's too
    assert start.prompt_token_ids == whole[:3]
    assert start.outputs[0].token_ids == default_llm.generate(
        [whole[:3]], params, use_tqdm=False)[0].outputs[0].token_ids
    fits = default_llm.generate(prompt, params, use_tqdm=False,
                                tokenization_kwargs={"truncation": True})[0]
    assert fits.prompt_token_ids == whole  # cut only to what fits: nothing here
    messages = [{"role": "user", "content": "Name a city."}]
    chat = default_llm.chat(messages, params, use_tqdm=False,
                            tokenization_kwargs={"truncate_prompt_tokens": 5})[0]
    rendered = default_llm.apply_chat_template(messages)
    assert chat.prompt_token_ids == rendered[-5:]
    # SmolLM2's tokenizer adds no special token of its own: give it a BOS to add.
    tokenizer = default_llm.get_tokenizer()
    plain_encode = tokenizer.encode
    bos = 1

    def encode(text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        return [bos] * add_special_tokens + plain_encode(text, add_special_tokens=False,
                                                          **kwargs)

    monkeypatch.setattr(tokenizer, "encode", encode)
    assert default_llm.generate(prompt, params, use_tqdm=False)[0].prompt_token_ids == \
        [bos, *whole]
    plain = default_llm.generate([prompt, {"prompt": prompt}], params, use_tqdm=False,
                                 tokenization_kwargs={"add_special_tokens": False})
    assert [o.prompt_token_ids for o in plain] == [whole] * 2
    assert default_llm.chat(messages, params, use_tqdm=False)[0].prompt_token_ids == rendered
    with_special = default_llm.chat(messages, params, use_tqdm=False,
                                    tokenization_kwargs={"add_special_tokens": True})[0]
    assert with_special.prompt_token_ids == [bos, *rendered]
    monkeypatch.undo()
    for kwargs, message in (({"padding": "max_length"}, r"\['padding'\] are not supported"),
                            ({"truncation_side": "middle"}, "truncation_side must be"),
                            ({"max_length": 3}, "only with truncation=True"),
                            ({"truncation": "only_first"}, "truncation must be"),
                            ({"truncation": 1, "max_length": 3}, "truncation must be"),
                            ({"truncation": True, "max_length": 3, "truncate_prompt_tokens": 2},
                             "give one"),
                            ({"truncation": False, "truncate_prompt_tokens": 2}, "give one"),
                            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
                            ({"add_special_tokens": 1}, "add_special_tokens must be a bool")):
        with pytest.raises(ValueError, match=message):
            default_llm.generate(prompt, params, use_tqdm=False, tokenization_kwargs=kwargs)
    with pytest.raises(ValueError, match="give one"):
        default_llm.generate(prompt, params.clone(truncate_prompt_tokens=2), use_tqdm=False,
                             tokenization_kwargs={"truncate_prompt_tokens": 3})
    assert_idle(default_llm.llm_engine)
