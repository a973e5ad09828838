"""A server started with generation-config defaults (vLLM's `--generation-config` and
`--override-generation-config`) fills the fields a request leaves unset from them, on
every endpoint, and a field the request sets wins."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import MODEL_NAME, Server, start_server

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("genconf-server")
    running = start_server(tmp, "--override-generation-config",
                           json.dumps({"max_new_tokens": 4, "temperature": 0, "top_p": 0.5}))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_the_defaults_are_logged_at_start(server: Server) -> None:
    assert "take them from" in server.log_text
    assert "'max_tokens': 4" in server.log_text


def test_unset_fields_take_the_defaults_and_set_ones_win(client: openai.OpenAI,
                                                         server: Server) -> None:
    unset = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION,
                                           extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == 4
    assert unset.choices[0].finish_reason == "length"
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0,
                                            top_p=0.5, max_tokens=4,
                                            extra_body={"ignore_eos": True})
    assert unset.choices[0].message.content == greedy.choices[0].message.content
    longer = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=6,
                                            extra_body={"ignore_eos": True})
    assert longer.usage.completion_tokens == 6
    # Completions' max_tokens is 16 unless sent as null (OpenAI's default, as in vLLM).
    sixteen = client.completions.create(model=MODEL_NAME, prompt="Colours:",
                                        extra_body={"ignore_eos": True})
    assert sixteen.usage.completion_tokens == 16
    null = client.completions.create(model=MODEL_NAME, prompt="Colours:",
                                     extra_body={"ignore_eos": True, "max_tokens": None})
    assert null.usage.completion_tokens == 4
    response = client.responses.create(model=MODEL_NAME, input="Name a colour.")
    assert response.usage.output_tokens <= 4
    server.wait_idle()


def test_beam_search_is_not_refused_for_the_models_sampling_defaults(
        client: openai.OpenAI, server: Server) -> None:
    """The default top_p is the model's, not the client's: beam search ignores it."""
    result = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, n=2,
                                            extra_body={"use_beam_search": True})
    assert len(result.choices) == 2
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, n=2, top_p=0.8,
                                       extra_body={"use_beam_search": True})
    server.wait_idle()


def test_a_bad_override_stops_the_server_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="generation config: temperature"):
        start_server(tmp_path, "--override-generation-config", '{"temperature": -1}')
