"""Every kind of bad request gets its status and an OpenAI-style error body, and the
server goes on serving everyone else with no KV block left behind."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MAX_REQUEST_BYTES, MODEL_NAME, Server

USER = [{"role": "user", "content": "Hi"}]
DEEP_SCHEMA: dict[str, object] = {"type": "object"}
for _ in range(100):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}
LONG_TEXT = "hello " * (MAX_MODEL_LEN + 50)

# (name, path, raw body or JSON value, expected status, expected `param`, text in message)
CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None, "JSON"),
    ("not an object", "/v1/completions", [1, 2], 400, None, "JSON object"),
    ("empty body", "/v1/completions", b"", 400, None, "empty"),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt", "Missing"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages", "Missing"),
    ("string temperature", "/v1/completions", {"prompt": "x", "temperature": "0.5"}, 400,
     "temperature", "temperature"),
    ("bool n", "/v1/completions", {"prompt": "x", "n": True}, 400, "n", "n"),
    ("float max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400,
     "max_tokens", "max_tokens"),
    ("wrong prompt type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt", "prompt"),
    ("role not a string", "/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]},
     400, "messages[0].role", "role"),
    ("content not text", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, "messages[0].content", "content"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model",
     "gpt-4"),
    ("unknown chat model", "/v1/chat/completions", {"messages": USER, "model": "nope"}, 404,
     "model", "nope"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt", "empty"),
    ("empty token list", "/v1/completions", {"prompt": [[]]}, 400, "prompt", "empty"),
    ("token out of vocab", "/v1/completions", {"prompt": [10**9]}, 400, "prompt", "prompt"),
    ("negative token", "/v1/completions", {"prompt": [-1]}, 400, "prompt", "prompt"),
    ("lone surrogate in prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt",
     "unicode"),
    ("lone surrogate in messages", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages", "unicode"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("lone surrogate in a tool name", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", '
     b'"tools": [{"type": "function", "function": {"name": "f\\ud800"}}]}', 400,
     "tools[0].function.name", "unicode"),
    ("prompt too long", "/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 1}, 400,
     "prompt", "maximum context length"),
    ("prompt fills the context", "/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}, 400,
     "prompt", f"{MAX_MODEL_LEN} in the prompt"),
    ("min_tokens beyond what the context leaves", "/v1/completions",
     {"prompt": [7] * (MAX_MODEL_LEN - 10), "max_tokens": 100, "min_tokens": 50}, 400,
     "min_tokens", "leaves 10"),
    ("truncate -1 beside a budget as large as the context", "/v1/completions",
     {"prompt": "x", "truncate_prompt_tokens": -1, "max_tokens": MAX_MODEL_LEN}, 400,
     "truncate_prompt_tokens", "leaves none"),
    ("truncate past the context", "/v1/completions",
     {"prompt": "x", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, 400,
     "truncate_prompt_tokens", "larger than the model's context"),
    ("fractional token id", "/v1/completions", {"prompt": [5, 7.5]}, 400, "prompt", "prompt"),
    ("negative logit_bias key", "/v1/completions",
     {"prompt": "x", "logit_bias": {"-5": 1}}, 400, "logit_bias", "token ids"),
    ("cache_salt with a lone surrogate", "/v1/completions",
     b'{"prompt": "x", "cache_salt": "a\\ud800"}', 400, "cache_salt", "lone surrogate"),
    ("content part type not a string", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, 400,
     "messages", "part without a type"),
    ("unknown model with a lone surrogate", "/v1/completions",
     b'{"prompt": "x", "model": "\\ud800"}', 404, "model", "\ud800"),
    ("zero max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400,
     "max_tokens", "max_tokens"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -0.5}, 400,
     "temperature", "temperature"),
    ("absurd temperature", "/v1/completions", {"prompt": "x", "temperature": 1e308}, 400,
     "temperature", "temperature"),
    ("NaN temperature", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400,
     "temperature", "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p", "top_p"),
    ("presence penalty", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400,
     "presence_penalty", "presence_penalty"),
    ("frequency penalty", "/v1/chat/completions", {"messages": USER, "frequency_penalty": -9},
     400, "frequency_penalty", "frequency_penalty"),
    ("repetition penalty", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400,
     "repetition_penalty", "repetition_penalty"),
    ("negative top_k", "/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k", "top_k"),
    ("min_p above one", "/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p", "min_p"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n"),
    ("n too large", "/v1/completions", {"prompt": "x", "n": 100000}, 400, "n", "[1, 128]"),
    ("chat n too large", "/v1/chat/completions", {"messages": USER, "n": 1000}, 400, "n",
     "[1, 128]"),
    ("too many choices", "/v1/completions", {"prompt": ["a"] * 100, "n": 3}, 400, "n",
     "limit"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 100}, 400,
     "logprobs", "logprobs"),
    ("top_logprobs too many", "/v1/chat/completions",
     {"messages": USER, "logprobs": True, "top_logprobs": 100}, 400, "top_logprobs",
     "top_logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("stop token outside the vocabulary", "/v1/completions",
     {"prompt": "x", "min_tokens": 1, "stop_token_ids": [10**6]}, 400, "stop_token_ids",
     "stop_token_ids"),
    ("stop token beyond int64", "/v1/completions",
     {"prompt": "x", "min_tokens": 1, "stop_token_ids": [10**30]}, 400, "stop_token_ids",
     "stop_token_ids"),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop",
     "stop"),
    ("stream_options without stream", "/v1/completions",
     {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("empty cache_salt", "/v1/completions", {"prompt": "x", "cache_salt": ""}, 400,
     "cache_salt", "cache_salt"),
    ("priority without the priority policy", "/v1/chat/completions",
     {"messages": USER, "priority": 3}, 400, "priority", "scheduling_policy='priority'"),
    ("priority not an integer", "/v1/completions", {"prompt": "x", "priority": "high"}, 400,
     "priority", "priority"),
    ("logit_bias key not a token id", "/v1/completions",
     {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "token ids"),
    ("logit_bias key outside the vocabulary", "/v1/chat/completions",
     {"messages": USER, "logit_bias": {"99999999": 1}}, 400, "logit_bias", "token ids"),
    ("logit_bias value NaN", "/v1/completions", b'{"prompt": "x", "logit_bias": {"5": NaN}}',
     400, "logit_bias", "NaN"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix",
     "not supported"),
    ("best_of above n", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of",
     "not supported"),
    ("prompt_logprobs too many", "/v1/completions", {"prompt": "x", "prompt_logprobs": 21},
     400, "prompt_logprobs", "prompt_logprobs"),
    ("prompt_logprobs in a streamed chat", "/v1/chat/completions",
     {"messages": USER, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     "stream"),
    ("response_format of an unknown type", "/v1/chat/completions",
     {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format",
     "'json_schema'"),
    ("json_schema response_format without a schema", "/v1/completions",
     {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format", "json_schema.schema"),
    ("a JSON schema that does not compile", "/v1/completions",
     {"prompt": "x", "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "a", "schema": {"type": 5}}}},
     400, "response_format", "response_format is not a valid JSON schema"),
    ("a regex that does not compile", "/v1/chat/completions",
     {"messages": USER, "structured_outputs": {"regex": "[0-9"}}, 400, "structured_outputs",
     "not a valid regular expression"),
    ("a grammar that does not parse", "/v1/completions",
     {"prompt": "x", "guided_grammar": "root ::= ("}, 400, "guided_grammar",
     "guided_grammar is not a valid grammar"),
    ("two formats in structured_outputs", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs", "exactly one"),
    ("a format given twice", "/v1/chat/completions",
     {"messages": USER, "guided_json": {"type": "object"},
      "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, 400,
     "response_format", "give one format"),
    ("an unknown structured_outputs key", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"regexp": "a"}}, 400,
     "structured_outputs", "keys must be among"),
    ("a structural tag", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, 400,
     "structured_outputs", "structural_tag is not supported"),
    ("a structural_tag response_format", "/v1/chat/completions",
     {"messages": USER, "response_format": {"type": "structural_tag", "format": {}}}, 400,
     "response_format", "'json_schema'"),
    ("an empty structured_outputs", "/v1/completions",
     {"prompt": "x", "structured_outputs": {}}, 400, "structured_outputs", "exactly one"),
    ("structured_outputs of nulls", "/v1/completions",
     {"prompt": "x", "structured_outputs": {"json": None, "regex": None}}, 400,
     "structured_outputs", "exactly one"),
    ("an empty guided_choice", "/v1/completions", {"prompt": "x", "guided_choice": []}, 400,
     "guided_choice", "non-empty list"),
    ("guided_choice not a list", "/v1/completions", {"prompt": "x", "guided_choice": "a"},
     400, "guided_choice", "list"),
    ("tools with the default (auto) tool_choice", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools", "needs a parser"),
    ("tools with auto tool_choice", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "auto"}, 400, "tool_choice", "needs a parser"),
    ("tool_choice naming a function not in tools", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
     "not in tools"),
    ("tool_choice naming a function that is not an object", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": "f"}}, 400, "tool_choice", "must be"),
    ("tool_choice of an unknown kind", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "sometimes"}, 400, "tool_choice", "must be"),
    ("tool_choice without tools", "/v1/chat/completions",
     {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice", "needs tools"),
    ("a tool without a name", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"parameters": {}}}],
      "tool_choice": "required"}, 400, "tools[0].function.name", "non-empty string"),
    ("a tool that is not a function", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "retrieval"}], "tool_choice": "required"}, 400,
     "tools[0]", "function"),
    ("tool parameters that are not an object", "/v1/chat/completions",
     {"messages": USER, "tool_choice": "required", "tools": [
         {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     400, "tools[0].function.parameters", "of an object"),
    ("two tools of one name", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}] * 2,
      "tool_choice": "required"}, 400, "tools[1].function.name", "given twice"),
    ("a schema nested too deeply", "/v1/chat/completions",
     {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
         "name": "deep", "schema": DEEP_SCHEMA}}}, 400, "response_format",
     "nested more than 64 levels deep"),
    ("forced tool parameters nested too deeply", "/v1/chat/completions",
     {"messages": USER, "tools": [{"type": "function", "function": {
         "name": "f", "parameters": DEEP_SCHEMA}}], "tool_choice": "required"}, 400,
     "tools[0].function.parameters", "nested more than 64 levels deep"),
    ("tool parameters that do not compile", "/v1/chat/completions",
     {"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}},
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {
          "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]},
     400, "tools[0].function.parameters", "tools[0].function.parameters is not a valid JSON"),
    ("functions", "/v1/chat/completions",
     {"messages": USER, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    ("request chat_template", "/v1/chat/completions",
     {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template",
     "not supported"),
    ("continue_final_message with add_generation_prompt", "/v1/chat/completions",
     {"messages": USER, "continue_final_message": True}, 400, "continue_final_message",
     "add_generation_prompt"),
    ("chat_template_kwargs setting a reserved name", "/v1/chat/completions",
     {"messages": USER, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", "tokenize"),
    ("allowed_token_ids outside the vocabulary", "/v1/completions",
     {"prompt": "x", "allowed_token_ids": [11, 10**7]}, 400, "allowed_token_ids",
     "token ids in [0,"),
    ("allowed_token_ids empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []},
     400, "allowed_token_ids", "empty"),
    ("allowed_token_ids only EOS under min_tokens", "/v1/completions",
     {"prompt": "x", "allowed_token_ids": [0], "stop_token_ids": [0], "min_tokens": 2}, 400,
     "allowed_token_ids", "leaves nothing to generate"),
    ("bad_words blank", "/v1/chat/completions", {"messages": USER, "bad_words": ["  "]}, 400,
     "bad_words", "non-blank"),
    ("bad_words not strings", "/v1/completions", {"prompt": "x", "bad_words": [3]}, 400,
     "bad_words", "valid string"),
    ("image content part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [
         {"type": "text", "text": "What is this?"},
         {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]},
     400, "messages", "messages[0].content[1]: only text content parts are supported"),
    ("beam search top_p", "/v1/completions",
     {"prompt": "x", "use_beam_search": True, "top_p": 0.5}, 400, "top_p",
     "not supported with use_beam_search"),
    ("beam search spaces between special tokens", "/v1/completions",
     {"prompt": "x", "use_beam_search": True, "spaces_between_special_tokens": False}, 400,
     "spaces_between_special_tokens", "not supported with use_beam_search"),
    ("beam search echo logprobs", "/v1/completions",
     {"prompt": "x", "use_beam_search": True, "echo": True, "logprobs": 1}, 400, "echo",
     "not supported with use_beam_search"),
    ("beam search too many logprobs", "/v1/chat/completions",
     {"messages": USER, "use_beam_search": True, "n": 2, "logprobs": True,
      "top_logprobs": 5}, 400, "top_logprobs",
     "top_logprobs must be at most 4 with beam_width 2"),
    ("beam search too many completion logprobs", "/v1/completions",
     {"prompt": "x", "use_beam_search": True, "n": 2, "logprobs": 5}, 400, "logprobs",
     "logprobs must be at most 4 with beam_width 2"),
    ("beam search format", "/v1/chat/completions",
     {"messages": USER, "use_beam_search": True, "response_format": {"type": "json_object"}},
     400, "response_format", "not supported with use_beam_search"),
    ("beam search temperature", "/v1/chat/completions",
     {"messages": USER, "use_beam_search": True, "temperature": 0.7}, 400, "temperature",
     "must be 0"),
    ("beam search too wide", "/v1/completions",
     {"prompt": "x", "use_beam_search": True, "n": 11}, 400, "n", "[1, 10]"),
    ("beam search length_penalty", "/v1/completions",
     {"prompt": "x", "use_beam_search": True, "length_penalty": "long"}, 400,
     "length_penalty", "valid number"),
    ("audio output", "/v1/chat/completions",
     {"messages": USER, "modalities": ["text", "audio"]}, 400, "modalities", "text"),
    ("audio options", "/v1/chat/completions", {"messages": USER, "audio": {"voice": "x"}},
     400, "audio", "not supported"),
    ("chat best_of", "/v1/chat/completions", {"messages": USER, "best_of": 2}, 400,
     "best_of", "not supported"),
    ("chat suffix", "/v1/chat/completions", {"messages": USER, "suffix": "y"}, 400, "suffix",
     "not supported"),
    ("chat add_special_tokens", "/v1/chat/completions",
     {"messages": USER, "add_special_tokens": True}, 400, "add_special_tokens", "template"),
    ("seed past 64 bits", "/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed",
     "less than or equal to 9223372036854775807"),
    ("seed past 64 bits in chat", "/v1/chat/completions",
     {"messages": USER, "seed": -(2**63) - 1}, 400, "seed", "greater than or equal"),
    ("truncation_side unknown", "/v1/completions",
     {"prompt": "x", "truncate_prompt_tokens": 1, "truncation_side": "middle"}, 400,
     "truncation_side", "'left' or 'right'"),
    ("truncate_prompt_tokens zero", "/v1/completions",
     {"prompt": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", ">= 1"),
    ("tokenize with neither prompt nor messages", "/tokenize", {}, 400, "prompt",
     "exactly one"),
    ("tokenize with both prompt and messages", "/tokenize",
     {"prompt": "x", "messages": USER}, 400, "messages", "exactly one"),
    ("tokenize a bad role", "/tokenize", {"messages": [{"role": "", "content": "x"}]},
     400, "messages", "role must be a non-empty string"),
    ("tokenize with a tool that is not a function", "/tokenize",
     {"messages": USER, "tools": [{"type": "function", "function": {"parameters": {}}}]},
     400, "tools[0].function.name", "non-empty string"),
    ("tokenize an unknown model", "/tokenize", {"prompt": "x", "model": "nope"}, 404, "model",
     "nope"),
    ("tokenize a lone surrogate", "/tokenize", b'{"prompt": "a\\ud800"}', 400, "prompt",
     "unicode"),
    ("tokenize messages with special tokens", "/tokenize",
     {"messages": USER, "add_special_tokens": True}, 400, "add_special_tokens", "template"),
    ("tokenize with a chat_template", "/tokenize",
     {"messages": USER, "chat_template": "{{ messages }}"}, 400, "chat_template",
     "not supported"),
    ("detokenize a token outside the vocabulary", "/detokenize", {"tokens": [10**6]}, 400,
     "tokens", "token ids"),
    ("detokenize a negative token", "/detokenize", {"tokens": [-1]}, 400, "tokens",
     "token ids"),
    ("detokenize text", "/detokenize", {"tokens": "hello"}, 400, "tokens", "tokens"),
    ("body not UTF-8", "/v1/completions", b'{"prompt": "caf\xe9"}', 400, None,
     "not UTF-8 text (byte 15)"),
    ("body gzipped", "/v1/chat/completions", gzip.compress(b'{"messages": []}'), 400, None,
     "compressed body"),
    ("body nested too deeply", "/v1/completions",
     b'{"prompt": "x", "logit_bias": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
     "nested too deeply"),
    ("body over the limit", "/v1/completions",
     json.dumps({"prompt": "a" * (MAX_REQUEST_BYTES + 10)}).encode(), 413, None, "too large"),
]


def post(server: Server, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content,
                      headers={"Content-Type": "application/json"}, timeout=60)


def assert_error_body(response: httpx.Response, status: int, param: str | None,
                      text: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert text.lower() in error["message"].lower(), error


@pytest.mark.parametrize(("name", "path", "body", "status", "param", "text"), CASES,
                         ids=[case[0] for case in CASES])
def test_bad_request(server: Server, name: str, path: str, body: Any, status: int,
                     param: str | None, text: str) -> None:
    assert_error_body(post(server, path, body), status, param, text)


def test_text_too_long_to_fit_is_refused_by_its_length(server: Server) -> None:
    """Refused before it is tokenized, as vLLM refuses it: megabytes of text took seconds
    on the tokenizer thread every request waits for. A prompt to be truncated may be any
    length."""
    huge = "a" * (MAX_REQUEST_BYTES // 2)
    for path, body, param in (("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": huge}]}, "messages")):
        response = post(server, path, body)
        assert_error_body(response, 400, param, "characters long (more than")
        assert response.json()["error"]["code"] == "context_length_exceeded"
    cut = post(server, "/v1/completions", {"prompt": "hello " * 10_000, "max_tokens": 1,
                                           "truncate_prompt_tokens": 8})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 8


def test_a_budget_beyond_the_context_is_cut_to_fit(server: Server) -> None:
    """As vLLM does: max_tokens past what the prompt leaves of the context is cut to
    what is left, and the completion ends with "length"; only a budget past the whole
    context (or a prompt that leaves no room) is refused."""
    prompt = [7] * (MAX_MODEL_LEN - 3)
    cut = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_MODEL_LEN,
                                           "ignore_eos": True})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["completion_tokens"] == 3
    assert cut.json()["choices"][0]["finish_reason"] == "length"
    default = post(server, "/v1/completions", {"prompt": prompt, "ignore_eos": True})
    assert default.json()["usage"]["completion_tokens"] == 3  # of the default 16
    chat = post(server, "/v1/chat/completions", {"messages": USER, "ignore_eos": True,
                                                 "max_completion_tokens": MAX_MODEL_LEN})
    assert chat.status_code == 200, chat.text
    assert sum(chat.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens")) \
        == MAX_MODEL_LEN
    for path, body, param in (
            ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
            ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 10**6},
             "max_completion_tokens"),
            ("/v1/chat/completions", {"messages": USER, "max_tokens": 10**6}, "max_tokens"),
            ("/v1/responses", {"input": "x", "max_output_tokens": 10**6},
             "max_output_tokens")):
        assert_error_body(post(server, path, body), 400, param,
                          f"cannot be greater than max_model_len={MAX_MODEL_LEN}")
    # Anthropic's clients send their own large max_tokens (Claude Code's 32,000): cut.
    message = post(server, "/v1/messages", {"messages": USER, "max_tokens": 32_000,
                                            "model": MODEL_NAME})
    assert message.status_code == 200, message.text


def test_what_vllm_accepts_is_accepted(server: Server) -> None:
    """Clients that send every field (nulls for the unset), any role the template takes,
    the other APIs' text parts, plain string parts, a text part without text (skipped),
    an assistant's refusal, top_logprobs 0 without logprobs, an empty model name."""
    nulls = post(server, "/v1/chat/completions", {
        "messages": USER, "max_tokens": 2, "stream": None, "n": None, "logprobs": None,
        "temperature": None, "stop": None, "stream_options": None, "tools": None})
    assert nulls.status_code == 200, nulls.text
    assert len(nulls.json()["choices"]) == 1
    echo = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "echo": None,
                                            "n": None, "stream": None, "model": ""})
    assert echo.status_code == 200, echo.text
    messages = [
        {"role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": ["Hi", {"type": "text"}, {"type": "text", "text": "!"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "ipython", "content": [{"type": "output_text", "text": "42"}]},
        {"role": "user", "content": "ok"}]
    parts = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                                  "top_logprobs": 0})
    assert parts.status_code == 200, parts.text
    rendered = httpx.post(f"{server.url}/tokenize", timeout=60, json={
        "messages": messages, "return_token_strs": False}).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", timeout=60,
                      json={"tokens": rendered}).json()["prompt"]
    for piece in ("Be brief.", "Hi\n!", "No.", "ipython\n42"):
        assert piece in text, text


def test_integral_numbers_and_spaced_bias_keys_are_read_as_vllm_reads_them(server: Server
                                                                          ) -> None:
    """A Python client's computed `max_tokens` (8.0) and token ids, and logit_bias keys
    that int() reads (" 11", "+11"): the same answer as with plain integers."""
    plain = {"prompt": [504, 3458], "max_tokens": 4, "n": 2, "seed": 3, "temperature": 1,
             "logprobs": 1, "logit_bias": {"11": -100}}
    floats = {"prompt": [504.0, 3458.0], "max_tokens": 4.0, "n": 2.0, "seed": 3.0,
              "temperature": 1, "logprobs": 1.0, "logit_bias": {" 11": -100, "+11": -100}}
    expected, given = (post(server, "/v1/completions", body) for body in (plain, floats))
    assert given.status_code == 200, given.text
    assert [c["text"] for c in given.json()["choices"]] == \
        [c["text"] for c in expected.json()["choices"]]
    assert given.json()["usage"] == expected.json()["usage"]


def test_top_k_beyond_the_vocabulary_means_no_limit(server: Server) -> None:
    response = post(server, "/v1/completions", {"prompt": "x", "top_k": 10**30, "max_tokens": 1})
    assert response.status_code == 200, response.text


def test_streamed_bad_request_is_an_error_status(server: Server) -> None:
    """Validation happens before the stream starts, so a client sees a plain status."""
    response = post(server, "/v1/chat/completions",
                    {"messages": USER, "stream": True, "temperature": -1})
    assert_error_body(response, 400, "temperature", "temperature")


def test_unknown_route_and_method(server: Server) -> None:
    missing = httpx.post(f"{server.url}/v1/nothing", json={})
    assert missing.status_code == 404 and "error" in missing.json()
    wrong_method = httpx.get(f"{server.url}/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_chunked_body_over_the_limit(server: Server) -> None:
    """A body without Content-Length is counted as it arrives."""
    def chunks() -> Any:
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'"}'

    response = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 413


def test_server_still_serves_and_holds_no_blocks(server: Server) -> None:
    for case in CASES:
        post(server, case[1], case[2])
    response = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert server.wait_idle()["pagellm_kv_cache_usage"] == 0
