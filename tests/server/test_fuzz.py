"""Property-based fuzzing of the HTTP API: whatever a client sends, never a 5xx.

Bodies mix plausible values with arbitrary JSON in every field, so most are invalid in
one way or another and the valid ones exercise odd combinations (n with stop strings,
token-id prompts with penalties, ...). Generation is kept to a few tokens: `max_tokens`
is always either tiny or invalid. Derandomized, so CI runs the same examples every time.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import MODEL_NAME, Server

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers() | st.floats()
           | st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
# max_tokens is always tiny or invalid: never a valid long generation.
tiny_max_tokens = st.integers(1, 3)
bad_max_tokens = (st.integers(max_value=0) | st.integers(min_value=10**5) | st.floats()
                  | st.text(max_size=4) | st.booleans() | st.lists(st.integers(), max_size=2))
token_ids = st.lists(st.integers(0, 49_151), min_size=1, max_size=6)
# JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer accepts.
surrogates = st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1,
                     max_size=2)
text = st.text(min_size=1, max_size=16) | surrogates

# Values a real client might send: mostly valid, some just past a limit.
COMMON: dict[str, Any] = {
    "model": st.just(MODEL_NAME),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50) | st.integers(min_value=10**6),
    "min_p": st.floats(0, 1),
    "seed": st.integers(),
    "stop": st.text(max_size=4) | st.lists(text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 49_151) | st.integers(min_value=0), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.01, 5),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "cache_salt": text,
    "user": st.text(max_size=8),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
prompts = text | st.lists(text, min_size=1, max_size=3) | token_ids | st.lists(
    token_ids, min_size=1, max_size=2)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]),
     "content": text | st.lists(st.fixed_dictionaries(
         {"type": st.just("text"), "text": text}), min_size=1, max_size=2)}),
    min_size=1, max_size=3)

plausible_completions = st.fixed_dictionaries(
    {"prompt": prompts, "max_tokens": tiny_max_tokens},
    optional={**COMMON, "logprobs": st.integers(0, 5)})
plausible_chats = st.fixed_dictionaries(
    {"messages": messages, "max_tokens": tiny_max_tokens},
    optional={**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)})


def mutated(bodies: st.SearchStrategy[dict[str, Any]], fields: list[str]
            ) -> st.SearchStrategy[dict[str, Any]]:
    """A plausible body with one field (or an unknown one) set to arbitrary JSON, so every
    field's validation runs with everything else valid."""
    def replace(body: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
        return {**body, field: value}

    return st.builds(replace, bodies, st.sampled_from(fields), junk) | st.builds(
        replace, bodies, st.sampled_from(["max_tokens", "max_completion_tokens"]),
        bad_max_tokens)


FIELDS = [*COMMON, "logprobs", "unknown_field"]
completion_bodies = plausible_completions | mutated(plausible_completions, [*FIELDS, "prompt"])
chat_bodies = plausible_chats | mutated(plausible_chats, [*FIELDS, "messages", "top_logprobs"])


def check(server: Server, path: str, body: bytes) -> None:
    """No 5xx; errors carry OpenAI's body; streams end with [DONE] and no error event."""
    response = httpx.post(f"{server.url}{path}", content=body, timeout=120,
                          headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert set(error) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text
        assert '"error"' not in response.text, (body, response.text)
    else:
        assert response.json()["choices"] is not None


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(server: Server, body: dict[str, Any]) -> None:
    check(server, "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat_completions(server: Server, body: dict[str, Any]) -> None:
    check(server, "/v1/chat/completions", json.dumps(body).encode())


@settings(FUZZ, max_examples=30)
@given(body=st.binary(max_size=64) | junk.map(lambda value: json.dumps(value).encode()))
def test_fuzz_raw_bodies(server: Server, body: bytes) -> None:
    check(server, "/v1/completions", body)


def test_fuzzing_leaves_the_server_healthy(server: Server) -> None:
    assert server.wait_idle()["pagellm_kv_cache_usage"] == 0
    assert httpx.get(f"{server.url}/health").status_code == 200
