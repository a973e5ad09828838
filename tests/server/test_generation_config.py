"""A server started with generation-config defaults (vLLM's `--generation-config` and
`--override-generation-config`) fills the fields a request leaves unset from them, on
every endpoint, and a field the request sets wins; an operator's max_new_tokens caps
every request, as vLLM's server does."""

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
                           json.dumps({"max_new_tokens": 4, "temperature": 0, "top_p": 0.5,
                                       "top_k": 10**6}))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_the_defaults_are_logged_at_start(server: Server) -> None:
    assert "take them from" in server.log_text
    assert "'max_tokens': 4" in server.log_text
    assert "every request stops at 4 tokens at most" in server.log_text


def test_unset_fields_take_the_defaults_and_set_ones_win(client: openai.OpenAI,
                                                         server: Server) -> None:
    unset = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION,
                                           extra_body={"ignore_eos": True})
    assert unset.usage.completion_tokens == 4
    assert unset.choices[0].finish_reason == "length"
    greedy = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, temperature=0,
                                            top_p=0.5, max_tokens=4,
                                            extra_body={"ignore_eos": True, "top_k": 10**6})
    assert unset.choices[0].message.content == greedy.choices[0].message.content
    shorter = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=2,
                                             extra_body={"ignore_eos": True})
    assert shorter.usage.completion_tokens == 2
    # The operator's max_new_tokens caps what a request asks for (completions' default
    # of 16 included), ending it with "length".
    capped = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=9,
                                            extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 4 and capped.choices[0].finish_reason == "length"
    sixteen = client.completions.create(model=MODEL_NAME, prompt="Colours:",
                                        extra_body={"ignore_eos": True})
    assert sixteen.usage.completion_tokens == 4
    response = client.responses.create(model=MODEL_NAME, input="Name a colour.")
    assert response.usage.output_tokens <= 4
    # Responses echo the sampling the request ran with, as vLLM's do.
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0, 0.5, 4)
    server.wait_idle()


def test_beam_search_is_not_refused_for_the_models_sampling_defaults(
        client: openai.OpenAI, server: Server) -> None:
    """The default top_p and top_k are the model's, not the client's: beam search ignores
    them, and a client's neutral value (SDKs send top_p=1) is no sampling option either."""
    for top_p in (None, 1.0):
        result = client.chat.completions.create(
            model=MODEL_NAME, messages=QUESTION, n=2, top_p=top_p,
            extra_body={"use_beam_search": True, "ignore_eos": True})
        assert len(result.choices) == 2
        assert result.usage.completion_tokens == 8  # the operator's cap holds for beams
    completion = client.completions.create(model=MODEL_NAME, prompt="Colours:", n=2,
                                           extra_body={"use_beam_search": True})
    assert len(completion.choices) == 2
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, n=2, top_p=0.8,
                                       extra_body={"use_beam_search": True})
    server.wait_idle()


def test_min_tokens_above_the_cap_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="min_tokens is 6, but the server's "
                                                     "max_new_tokens"):
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20,
                                       extra_body={"min_tokens": 6})


def test_the_models_own_max_new_tokens_is_a_default_not_a_cap(tmp_path: Path) -> None:
    """A generation_config.json beside the weights (here the default model's files with
    max_new_tokens 5 added) gives requests that leave max_tokens unset 5; a request may
    still ask for more, as in vLLM."""
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model.resolve import resolve_model_path

    source = resolve_model_path(None, resolve_cache_dir())
    model = tmp_path / "model"
    model.mkdir()
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (model / item.name).symlink_to(item)
    generation = json.loads((source / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation,
                                                              "max_new_tokens": 5}))
    running = start_server(tmp_path, "--model", str(model), "--served-model-name", MODEL_NAME)
    try:
        own = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused")
        unset = own.chat.completions.create(model=MODEL_NAME, messages=QUESTION,
                                            extra_body={"ignore_eos": True})
        assert unset.usage.completion_tokens == 5
        more = own.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=7,
                                           extra_body={"ignore_eos": True})
        assert more.usage.completion_tokens == 7
        null = own.completions.create(model=MODEL_NAME, prompt="Colours:",
                                      extra_body={"ignore_eos": True, "max_tokens": None})
        assert null.usage.completion_tokens == 5
        running.wait_idle()
    finally:
        running.stop()


def test_a_bad_override_stops_the_server_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="override_generation_config: temperature = -1"):
        start_server(tmp_path, "--override-generation-config", '{"temperature": -1}')
