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
numbers = st.floats(-3, 3) | st.integers(-3, 3) | junk
# Tiny, or invalid in some way; never a valid long generation.
max_tokens = (st.integers(1, 3) | st.integers(max_value=0) | st.integers(min_value=10**5)
              | st.floats() | st.text(max_size=4) | st.booleans() | st.lists(st.integers(), max_size=2))
token_ids = st.lists(st.integers(-2, 50_000), max_size=6)

COMMON: dict[str, Any] = {
    "model": st.sampled_from([MODEL_NAME, "someone-else"]) | junk,
    "n": st.integers(-1, 3) | junk,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": st.integers() | junk,
    "min_p": numbers,
    "seed": st.integers() | junk,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | junk,
    "stop_token_ids": token_ids | junk,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "min_tokens": st.integers(-1, 4) | junk,
    "ignore_eos": st.booleans() | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | junk,
    "cache_salt": st.text(max_size=8) | junk,
    "user": st.text(max_size=8) | junk,
    "skip_special_tokens": st.booleans() | junk,
    "include_stop_str_in_output": st.booleans() | junk,
    "unknown_field": junk,
}

completion_bodies = st.fixed_dictionaries(
    {"max_tokens": max_tokens},
    optional={
        **COMMON,
        "prompt": (st.text(max_size=24) | st.lists(st.text(max_size=8), max_size=3) | token_ids
                   | st.lists(token_ids, max_size=3) | junk),
        "logprobs": st.integers(-1, 25) | junk,
    })

messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])},
    optional={"content": st.text(max_size=16) | st.none() | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                               "text": st.text(max_size=8)}), max_size=2) | junk,
              "name": st.text(max_size=4) | junk}), max_size=3)

chat_bodies = st.fixed_dictionaries(
    {"max_tokens": max_tokens},
    optional={**COMMON, "messages": messages | junk, "logprobs": st.booleans() | junk,
              "top_logprobs": st.integers(-1, 25) | junk,
              "max_completion_tokens": max_tokens})


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
