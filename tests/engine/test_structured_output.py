"""Structured output on the default model: every format kind is followed, greedy under a
format is the reference's argmax among the tokens the format allows, and a format
changes nothing for the other requests of a batch, for the prefix cache, or across
preemptions."""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import numpy as np
import pytest
import torch

from pagellm import SamplingParams
from pagellm.core.sampling_params import StructuredOutputsParams
from pagellm.engine.structured_output import (
    FormatMatcher,
    _without_unknown_formats,
    allowed_tokens,
    grammar_spec,
    unpack_bitmask,
)
from tests.engine.conftest import NEAR_TIE, assert_idle

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def _prompt(llm: Any, question: str) -> str:
    rendered: str = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return rendered


def _greedy(fmt: StructuredOutputsParams, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=fmt)


def test_each_format_kind_is_followed(default_llm: Any) -> None:
    llm = default_llm
    cases: list[tuple[str, StructuredOutputsParams, Any]] = [
        ("Describe a person.", StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
         lambda text: set(json.loads(text)) == {"name", "age", "tags"}),
        ("Describe a cat as JSON.", StructuredOutputsParams(json=json.dumps(SCHEMA)),
         lambda text: 0 <= json.loads(text)["age"] <= 130),
        ("Give me a phone number.", StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
         lambda text: re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)),
        ("Is the sky blue?", StructuredOutputsParams(choice=["Yes, it is.", "No."]),
         lambda text: text in ("Yes, it is.", "No.")),
        ("Say hi.", StructuredOutputsParams(grammar='root ::= "hi" (" " name)?\n'
                                                    'name ::= [a-z]+'),
         lambda text: re.fullmatch(r"hi( [a-z]+)?", text)),
        ("Count.", StructuredOutputsParams(grammar='start: NUM ("," NUM)~1..3\n'
                                                   'NUM: /[1-9]/'),
         lambda text: re.fullmatch(r"[1-9](,[1-9]){1,3}", text)),
    ]
    outputs = llm.generate([_prompt(llm, q) for q, _, _ in cases],
                           [_greedy(fmt, 80) for _, fmt, _ in cases], use_tqdm=False)
    for (_, fmt, check), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (fmt, completion)
        assert check(completion.text), (fmt, completion.text)
    # Any JSON object: a small model may go on adding keys until max_tokens.
    (anything,) = llm.generate(_prompt(llm, "Give me JSON."), _greedy(
        StructuredOutputsParams(json_object=True, disable_any_whitespace=True), 80),
        use_tqdm=False)
    completion = anything.outputs[0]
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)
    else:
        assert completion.text.startswith("{") and len(completion.token_ids) == 80
    assert_idle(llm.llm_engine)


def _reference(model: Any, tokenizer: llguidance.LLTokenizer, spec: str, prompt: list[int],
               eos: set[int], max_tokens: int) -> list[int]:
    """transformers' greedy, each step the argmax among the tokens a fresh llguidance
    matcher allows (read from its own bitmask, not through our code)."""
    matcher = llguidance.LLMatcher(tokenizer, spec)
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].double()
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8),
                                 bitorder="little")[:logits.shape[0]]
            logits[torch.from_numpy(bits == 0)] = float("-inf")
            tokens.append(int(logits.argmax()))
            if tokens[-1] in eos:
                break
            assert matcher.consume_token(tokens[-1])
    return tokens


def test_greedy_under_a_format_is_the_reference_argmax_among_allowed_tokens(
        default_llm: Any, default_hf_model: Any) -> None:
    llm = default_llm
    engine = llm.llm_engine
    formats = [StructuredOutputsParams(json=SCHEMA),
               StructuredOutputsParams(regex=r"(Yes|No), because [a-z ]{1,30}\."),
               StructuredOutputsParams(choice=["red", "green", "blue", "light blue"])]
    prompt = llm.get_tokenizer().encode(_prompt(llm, "Answer in the format asked."))
    outputs = llm.generate([{"prompt_token_ids": prompt}] * 3,
                           [_greedy(fmt, 48) for fmt in formats], use_tqdm=False)
    compiler = engine._grammars
    for fmt, output in zip(formats, outputs, strict=True):
        ours = list(output.outputs[0].token_ids)
        ref = _reference(default_hf_model, compiler.tokenizer, grammar_spec(fmt), prompt,
                         set(engine.eos_token_ids), 48)
        if ours != ref:  # only a true near-tie may part them (see conftest)
            first = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b)
            with torch.no_grad():
                logprobs = default_hf_model(torch.tensor([prompt + ref[:first]])).logits[0, -1]
            logprobs = logprobs.log_softmax(-1)
            assert abs(float(logprobs[ours[first]] - logprobs[ref[first]])) < NEAR_TIE, (
                fmt, ours, ref)


def test_a_format_changes_nothing_else(default_llm: Any) -> None:
    """The unconstrained request of a mixed batch gets its solo tokens; a constrained
    request gets the same tokens again from the prefix cache; sampled completions of
    n > 1 each follow the format."""
    llm = default_llm
    free_prompt = "The three largest cities of Europe are"
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (solo,) = llm.generate(free_prompt, free, use_tqdm=False)
    fmt = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    prompt = _prompt(llm, "Describe a person as JSON, with a long introduction first.")
    mixed = llm.generate([prompt, free_prompt], [_greedy(fmt), free], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == solo.outputs[0].token_ids
    (again,) = llm.generate(prompt, _greedy(fmt), use_tqdm=False)
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == mixed[0].outputs[0].token_ids

    (sampled,) = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=7,
                                                     max_tokens=80, structured_outputs=fmt),
                              use_tqdm=False)
    texts = [c.text for c in sampled.outputs]
    assert len(set(texts)) > 1
    for completion in sampled.outputs:
        if completion.finish_reason == "stop":
            assert set(json.loads(completion.text)) == {"name", "age", "tags"}
        else:  # cut by max_tokens: still a prefix of the format
            assert completion.text.startswith('{"')
    assert_idle(llm.llm_engine)


def test_a_preempted_request_keeps_its_format() -> None:
    """Preemption recomputes the tokens but keeps the matcher where it was: on a pool too
    small for the batch, every request still ends in the format with the tokens it gets
    alone."""
    from pagellm import LLM

    llm = LLM(kv_cache_memory_bytes=18 * 16 * 2 * 30 * 3 * 64 * 4, block_size=16,
              max_num_batched_tokens=512)
    prompts = [_prompt(llm, f"Describe person number {i} as JSON.") for i in range(6)]
    fmt = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    alone = [llm.generate(p, _greedy(fmt), use_tqdm=False)[0] for p in prompts]
    together = llm.generate(prompts, _greedy(fmt), use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    for a, b in zip(alone, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        if b.outputs[0].finish_reason == "stop":
            json.loads(b.outputs[0].text)
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("fmt, message", [
    (dict(regex="[0-9"), "structured_outputs.regex is not a valid regular expression"),
    (dict(json={"type": "nonsense"}), "structured_outputs.json is not a valid JSON schema"),
    (dict(json="{not json"), "structured_outputs.json is not a valid JSON schema"),
    (dict(json="[1, 2]"), "must be a JSON object"),
    (dict(grammar="root ::= ("), "structured_outputs.grammar is not a valid grammar"),
    (dict(grammar="?start: ("), "structured_outputs.grammar is not a valid grammar"),
    (dict(json={"type": "object"}, whitespace_pattern="[ "), "not a valid JSON schema"),
])
def test_a_format_that_does_not_compile_is_refused(default_llm: Any, fmt: dict[str, Any],
                                                   message: str) -> None:
    engine = default_llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request(None, "Hello", _greedy(StructuredOutputsParams(**fmt)))
    assert not engine.has_unfinished_requests()


def test_a_grammar_without_gbnf_rules_is_lark() -> None:
    """vLLM's rule: no `::=`, so Lark, whose inlined `?start:` (outlines' grammars begin
    so) llguidance's own guess would have sent to its GBNF converter."""
    grammar_spec(StructuredOutputsParams(grammar='?start: answer\nanswer: "yes" | "no"'))
    grammar_spec(StructuredOutputsParams(grammar='root ::= "yes" | "no"'))


def test_allowed_tokens_unpacks_the_bitmask_of_each_row(default_llm: Any) -> None:
    """Row by row, the bool mask holds exactly the tokens the matcher's bitmask holds."""
    compiler = default_llm.llm_engine._grammars
    vocab = default_llm.llm_engine.model_config.vocab_size
    formats = [StructuredOutputsParams(choice=["yes", "no"]),
               StructuredOutputsParams(regex=r"[0-9]+")]
    matchers = [compiler.matchers(fmt, 1)[0] for fmt in formats]
    mask = allowed_tokens(matchers, compiler.mask_words, vocab)
    for row, fmt in enumerate(formats):
        fresh = llguidance.LLMatcher(compiler.tokenizer, grammar_spec(fmt))
        bits = np.unpackbits(np.frombuffer(fresh.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:vocab]
        assert mask[row].tolist() == (bits == 1).tolist()
    text = default_llm.get_tokenizer()
    assert {text.decode([t]) for t in mask[0].nonzero().flatten().tolist()} >= {"yes", "no"}
    assert isinstance(matchers[0], FormatMatcher)


def test_unpack_bitmask_reads_every_bit_of_a_word() -> None:
    """Bit b of word w is token 32 w + b, the sign bit (token 31 of a word) included;
    tokens past the vocabulary are cut."""
    packed = np.array([[-2**31, 1], [-1, 0], [5, -2**31 + 1]], dtype=np.int32)
    mask = unpack_bitmask(packed, 60)
    assert mask.shape == (3, 60) and mask.dtype == torch.bool
    assert mask[0].nonzero().flatten().tolist() == [31, 32]
    assert mask[1].nonzero().flatten().tolist() == list(range(32))
    assert mask[2].nonzero().flatten().tolist() == [0, 2, 32]


def test_a_format_is_compiled_once_and_copied_per_completion(
        default_llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One compile per format, while it is among the last 64 used; each completion gets
    its own copy, whose state it does not share."""
    from pagellm.engine import structured_output

    compiler = default_llm.llm_engine._grammars
    compiles: list[str] = []
    real = llguidance.LLMatcher

    def counting(tokenizer: Any, spec: str, **kwargs: Any) -> Any:
        compiles.append(spec)
        return real(tokenizer, spec, **kwargs)

    for name in ("grammar_from_lark", "grammar_from_json_schema", "validate_grammar"):
        setattr(counting, name, getattr(real, name))
    monkeypatch.setattr(structured_output.llguidance, "LLMatcher", counting)
    fmt = StructuredOutputsParams(regex=r"[a-c]{2}")
    first = compiler.matchers(fmt, 3)
    again = compiler.matchers(StructuredOutputsParams(regex=r"[a-c]{2}"), 1)
    assert len(compiles) == 1 and len({id(m) for m in first + again}) == 4
    (a,) = default_llm.get_tokenizer().encode("a", add_special_tokens=False)
    first[0].accept(a)  # copies do not share their state
    masks = allowed_tokens(first[:2], compiler.mask_words, 49152)
    assert masks[0].sum() < masks[1].sum()
    for i in range(64):  # 64 other formats push the first out
        compiler.matchers(StructuredOutputsParams(choice=[f"word {i}"]), 1)
    compiler.matchers(fmt, 1)
    assert len(compiles) == 66 and compiles[-1] == compiles[0]


def test_objects_listing_properties_are_closed_unless_they_say_otherwise(
        default_llm: Any) -> None:
    """As vLLM's default backend (xgrammar, strict) reads a schema: a small model left
    free adds keys (LangChain's function-calling schemas leave additionalProperties
    out). `"additionalProperties": true` opens an object; disable_additional_properties
    (vLLM's guidance option) changes nothing."""
    llm = default_llm
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"]}
    prompt = _prompt(llm, "Describe a person as JSON with many fields.")
    plain, flagged, opened = llm.generate([prompt] * 3, [
        _greedy(StructuredOutputsParams(json=schema, disable_any_whitespace=True)),
        _greedy(StructuredOutputsParams(json=schema, disable_any_whitespace=True,
                                        disable_additional_properties=True)),
        _greedy(StructuredOutputsParams(json={**schema, "additionalProperties": True},
                                        disable_any_whitespace=True))],
        use_tqdm=False)
    assert set(json.loads(plain.outputs[0].text)) == {"name"}
    assert flagged.outputs[0].text == plain.outputs[0].text
    assert opened.outputs[0].text != plain.outputs[0].text  # the model adds fields when free


class _ByteTokenizer:
    """One token per byte, and an EOS: a matcher over it checks a text byte by byte."""

    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    eos_token_id = 256
    bos_token_id = None
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()), slices=[])


def _accepts(schema: dict[str, Any], text: str) -> bool:
    from pagellm.engine.structured_output import grammar_spec

    matcher = llguidance.LLMatcher(_BYTES, grammar_spec(StructuredOutputsParams(json=schema)),
                                   log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for byte in text.encode():
        matcher.consume_token(byte)
        if matcher.is_error():
            return False
    return bool(matcher.is_accepting())


BASE = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


@pytest.mark.parametrize(("schema", "texts"), [
    # Closed: a listed object, nested ones, a $ref'd definition, a lone allOf (pydantic's
    # way of describing a reference), a tuple.
    ({"type": "object", "properties": {"a": {"type": "string"}}},
     {'{"a": "x"}': True, '{"a": "x", "b": 1}': False}),
    ({"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/definitions/X"}]}},
      "definitions": {"X": {"type": "object", "properties": {"a": {"type": "string"}}}}},
     {'{"x": {"a": "s"}}': True, '{"x": {"a": "s", "z": 1}}': False}),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, {"[1]": True, "[1, 2]": False}),
    # Open: any object, an explicit true, and properties composed from elsewhere.
    ({"type": "object", "properties": {"meta": {"type": "object"}}},
     {'{"meta": {"k": 1}}': True}),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
     {'{"a": "x", "b": 1}': True}),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}},
                 "required": ["b"]}]},
     {'{"a": "x", "b": 1}': True, '{"a": "x"}': False}),
    ({"$defs": {"Base": BASE}, "allOf": [{"$ref": "#/$defs/Base"}, {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}]},
     {'{"id": 1, "name": "n"}': True, '{"id": 1}': False}),
    ({"type": "object", "properties": {"kind": {"enum": ["circle", "square"]}},
      "required": ["kind"],
      "oneOf": [{"properties": {"radius": {"type": "number"}}, "required": ["radius"]},
                {"properties": {"side": {"type": "number"}}, "required": ["side"]}]},
     {'{"kind": "circle", "radius": 1}': True, '{"kind": "square", "side": 2}': True,
      '{"kind": "circle"}': False}),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]},
     {'{"a": "x", "b": 1}': True, '{"a": "x"}': False}),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "patternProperties": {"^x-": {"type": "integer"}}, "required": ["a", "b"]},
     {'{"a": 1, "b": 2}': True}),
    # Extended through an alias (a definition that is a $ref, or an allOf of one), by an
    # escaped name, by a pointer that is not a definition's, by an absolute URI.
    ({"$defs": {"Base": BASE, "Mid": {"$ref": "#/$defs/Base"}},
      "allOf": [{"$ref": "#/$defs/Mid"}, {"properties": {"name": {"type": "string"}},
                                          "required": ["name"]}]},
     {'{"id": 1, "name": "x"}': True}),
    ({"$defs": {"Base": BASE, "Mid": {"allOf": [{"$ref": "#/$defs/Base"}]}},
      "allOf": [{"$ref": "#/$defs/Mid"}, {"properties": {"name": {"type": "string"}}}]},
     {'{"id": 1, "name": "x"}': True}),
    ({"$defs": {"a/b c": {"type": "object", "properties": {"x": {"type": "integer"}}}},
      "allOf": [{"$ref": "#/$defs/a~1b%20c"}, {"properties": {"y": {"type": "integer"}}}]},
     {'{"x": 1, "y": 2}': True}),
    ({"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"allOf": [{"$ref": "#/properties/a"}, {"properties": {"y": {"type": "integer"}}}]}}},
     {'{"a": {"x": 1}, "b": {"x": 1, "y": 2}}': True}),
    ({"$id": "https://example.com/s.json", "$defs": {"X": BASE},
      "allOf": [{"$ref": "https://example.com/s.json#/$defs/X"},
                {"properties": {"n": {"type": "string"}}}]},
     {'{"id": 1, "n": "x"}': True}),
    # Compositions nested in compositions, a $ref to one, an extended union, and extra
    # properties allowed beside branches: every part below stays open.
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
      "allOf": [{"anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}]},
     {'{"x": 1, "a": 2}': True}),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
      "anyOf": [{"allOf": [{"properties": {"a": {"type": "integer"}}}]}]},
     {'{"x": 1, "a": 2}': True}),
    ({"$defs": {"T": {"anyOf": [{"properties": {"a": {"type": "integer"}}},
                                {"properties": {"b": {"type": "integer"}}}]}},
      "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
      "$ref": "#/$defs/T"},
     {'{"x": 1, "a": 2}': True}),
    ({"$defs": {"Cat": {"type": "object", "properties": {"meow": {"type": "integer"}},
                        "required": ["meow"]},
                "Dog": {"type": "object", "properties": {"bark": {"type": "integer"}},
                        "required": ["bark"]},
                "Pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}},
      "allOf": [{"$ref": "#/$defs/Pet"}, {"properties": {"name": {"type": "string"}},
                                          "required": ["name"]}]},
     {'{"meow": 1, "name": "x"}': True}),
    ({"type": "object", "additionalProperties": {"type": "integer"},
      "oneOf": [{"properties": {"a": {"type": "integer"}}}]},
     {'{"a": 1, "b": 2}': True}),
    ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}},
      "anyOf": [{"properties": {"a": {"type": "integer"}}}]},
     {'{"a": 1, "x-1": 2}': True}),
    # Asked-for properties a closed part could never hold: `required` beside branches,
    # and minProperties / minItems beyond what is listed.
    ({"type": "object", "required": ["z"], "anyOf": [{"properties": {"a": {"type": "integer"}}}]},
     {'{"z": 1}': True}),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"], "minProperties": 2},
     {'{"a": 1, "b": 2}': True}),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2},
     {"[1, 2]": True}),
    # Any character may be written as a \u escape, as Python's json.dumps writes them.
    ({"type": "object", "properties": {"s": {"type": "string"}}},
     {'{"s": "Zo\\u00eb \\ud83d\\ude00"}': True}),
])
def test_closing_follows_the_schema_where_properties_are_composed(
        schema: dict[str, Any], texts: dict[str, bool]) -> None:
    """A schema that composes an object's properties (allOf, a $ref extended, branches
    under listed properties) compiles and means what it says: closing each part alone
    would refuse what another part lists (and turn `required` unsatisfiable)."""
    original = json.dumps(schema, sort_keys=True)
    assert {text: _accepts(schema, text) for text in texts} == texts
    assert json.dumps(schema, sort_keys=True) == original  # the request's own is untouched


def test_after_the_format_only_eos_follows(default_llm: Any) -> None:
    """min_tokens and ignore_eos keep a completed format generating: only EOS tokens
    follow it, which leave the text alone (they are special tokens)."""
    llm = default_llm
    eos = llm.llm_engine.eos_token_ids
    fmt = StructuredOutputsParams(choice=["yes", "no"])
    prompt = _prompt(llm, "Yes or no?")
    (plain,) = llm.generate(prompt, _greedy(fmt, 8), use_tqdm=False)
    longer = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=8, min_tokens=5, structured_outputs=fmt),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, structured_outputs=fmt)],
        use_tqdm=False)
    base = list(plain.outputs[0].token_ids)
    assert base[-1] in eos
    for output, length in zip(longer, (5, 6), strict=True):
        tokens = list(output.outputs[0].token_ids)
        assert tokens[:len(base) - 1] == base[:-1]
        assert all(t in eos for t in tokens[len(base) - 1:]) and len(tokens) == length
        assert output.outputs[0].text == plain.outputs[0].text
    assert_idle(llm.llm_engine)


def test_an_empty_regex_allows_only_the_empty_answer(default_llm: Any) -> None:
    """As vLLM's guidance backend takes it (and choice=[""]): EOS at once."""
    llm = default_llm
    prompt = _prompt(llm, "Say something.")
    for fmt in (StructuredOutputsParams(regex=""), StructuredOutputsParams(choice=[""])):
        (output,) = llm.generate(prompt, _greedy(fmt, 8), use_tqdm=False)
        completion = output.outputs[0]
        assert completion.text == "" and completion.finish_reason == "stop"
        assert len(completion.token_ids) == 1
        assert completion.token_ids[0] in llm.llm_engine.eos_token_ids
    with pytest.raises(ValueError, match="grammar must be a non-empty string"):
        StructuredOutputsParams(grammar="")
    assert_idle(llm.llm_engine)


def test_a_failed_matcher_ends_its_request_with_an_error(default_llm: Any) -> None:
    """A grammar past llguidance's parser limits (20,001 alternatives in one rule)
    compiles but fails after its first token: the completion ends with finish_reason
    "error" and the output's error set, instead of passing a cut text off as formatted;
    the other request of the step goes on."""
    llm = default_llm
    rule = " | ".join(f'"item {i}"' for i in range(20_001))
    failed, free = llm.generate(
        [_prompt(llm, "Pick an item."), "The sky is"],
        [_greedy(StructuredOutputsParams(grammar=f"start: {rule}")),
         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)], use_tqdm=False)
    assert failed.outputs[0].finish_reason == "error"
    assert failed.error is not None and failed.error.startswith("structured output failed: ")
    assert len(failed.error) < 600  # llguidance's message quotes the grammar: cut short
    assert free.error is None and len(free.outputs[0].token_ids) == 5
    assert_idle(llm.llm_engine)


def test_wide_schemas_and_grammars_are_followed(default_llm: Any) -> None:
    """Past llguidance's default of 2,000 items in a parser row, which these reach after
    their first token: an object of 600 optional properties, an enum of 2,100 objects, a
    rule of 2,100 alternatives."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    objects = {"enum": [{"k": i} for i in range(2100)]}
    rule = "start: " + " | ".join(f'"w{i}x"' for i in range(2100))
    outputs = default_llm.generate(
        [_prompt(default_llm, "Answer in the format asked.")] * 3,
        [_greedy(StructuredOutputsParams(json=wide), max_tokens=24),
         _greedy(StructuredOutputsParams(json=objects)),
         _greedy(StructuredOutputsParams(grammar=rule))], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "stop", "stop"]
    assert json.loads(outputs[1].outputs[0].text) in objects["enum"]
    assert re.fullmatch(r"w\d+x", outputs[2].outputs[0].text)
    assert_idle(default_llm.llm_engine)


def test_unknown_string_formats_are_annotations(default_llm: Any) -> None:
    """JSON Schema reads a format it does not know as an annotation: pydantic's bytes
    ("binary") or SecretStr ("password") constrain nothing, where llguidance would refuse
    the schema; known formats stay enforced, and a property named "format" is kept."""
    schema = {"type": "object", "properties": {
        "blob": {"type": "string", "format": "binary", "maxLength": 4},
        "format": {"type": "string", "format": "date"},
        "items": {"type": "array", "maxItems": 1,
                  "items": {"type": "string", "format": "password", "maxLength": 4}}},
        "required": ["blob", "format", "items"], "$defs": {"x": {"format": "int64"}},
        "default": {"format": "binary"}}
    assert _without_unknown_formats(schema) == {"type": "object", "properties": {
        "blob": {"type": "string", "maxLength": 4},
        "format": {"type": "string", "format": "date"},
        "items": {"type": "array", "maxItems": 1, "items": {"type": "string", "maxLength": 4}}},
        "required": ["blob", "format", "items"], "$defs": {"x": {}},
        "default": {"format": "binary"}}  # data, not a schema: untouched
    (output,) = default_llm.generate(
        _prompt(default_llm, "Answer in JSON."),
        _greedy(StructuredOutputsParams(json=schema, disable_any_whitespace=True),
                max_tokens=80), use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", json.loads(output.outputs[0].text)["format"])


def test_thousands_of_choices(default_llm: Any) -> None:
    """Choices are one lexer automaton, not parser alternatives: 2,001 of them work."""
    choices = [f"item {i}" for i in range(2001)]
    (output,) = default_llm.generate(
        _prompt(default_llm, "Pick an item."),
        _greedy(StructuredOutputsParams(choice=choices)), use_tqdm=False)
    assert output.outputs[0].finish_reason == "stop" and output.outputs[0].text in choices
    compiler = default_llm.llm_engine._grammars
    (matcher,) = compiler.matchers(StructuredOutputsParams(choice=["", "a", "ab", "a"]), 1)
    first = allowed_tokens([matcher], compiler.mask_words, 49152)[0]
    text = default_llm.get_tokenizer()
    allowed = {text.decode([t]) for t in first.nonzero().flatten().tolist()}
    assert allowed == {"a", "ab", "<|im_end|>"}  # the empty choice: EOS at once
