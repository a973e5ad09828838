"""More of vLLM's deployment flags, on a server listening on a Unix domain socket: load
tracking, the response role, request logs with the generated text, access-log filters,
and tools left out of the prompt when they may not be called."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator

import openai
import pytest

from tests.server.conftest import MODEL_NAME, Server, start_server

MAX_LOG_LEN = 8
KEEP_ALIVE_S = 0.05
# SmolLM2's own template shows no tools; this one does.
TEMPLATE = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("unix-server")
    socket_path = tmp / "pagellm.sock"
    server = start_server(
        tmp, "--enable-server-load-tracking", "--response-role", "bot",
        "--enable-log-outputs", "--max-log-len", str(MAX_LOG_LEN),
        "--uvicorn-log-level", "debug", "--disable-access-log-for-endpoints",
        "/health,/metrics", "--exclude-tools-when-tool-choice-none",
        "--task", "generate", "--runner", "auto", "--chat-template", TEMPLATE,
        "--sse-keep-alive-interval", str(KEEP_ALIVE_S), "--device", "cpu",
        uds=socket_path)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.log_text
    assert not socket_path.exists()  # the socket file goes with the server


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         http_client=server.http(timeout=120))


def _chat(client: openai.OpenAI, **kwargs: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(  # type: ignore[call-overload, no-any-return]
        model=MODEL_NAME, **{"max_tokens": 6, "temperature": 0, **kwargs})


def test_served_on_the_unix_socket(server: Server, client: openai.OpenAI) -> None:
    assert f"serving {MODEL_NAME} on http://unix:{server.uds}" in server.log_text
    assert server.uds is not None and server.uds.is_socket()
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_response_role(client: openai.OpenAI) -> None:
    hello = [{"role": "user", "content": "Say hello."}]
    assert _chat(client, messages=hello).choices[0].message.role == "bot"
    first = next(iter(_chat(client, messages=hello, stream=True)))
    assert first.choices[0].delta.role == "bot"
    # An answer that continues the last message takes that message's role (vLLM's).
    continued = _chat(client, messages=[*hello, {"role": "assistant", "content": "Hel"}],
                      extra_body={"add_generation_prompt": False,
                                  "continue_final_message": True})
    assert continued.choices[0].message.role == "assistant"


def test_load_counts_generation_requests_until_their_last_byte(
        server: Server, client: openai.OpenAI) -> None:
    with server.http() as http:
        def load() -> int:
            value = http.get(f"{server.url}/load").json()["server_load"]
            assert isinstance(value, int)
            return value

        def settles_to_zero(why: str) -> None:
            """A handler returns just after its last byte is sent, so the count drops soon
            after the client has read everything, not before."""
            deadline = time.monotonic() + 30
            while load() != 0:
                assert time.monotonic() < deadline, why
                time.sleep(0.05)

        assert load() == 0
        streams = [client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": f"Count to {n}."}],
            max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True})
            for n in (3, 5)]
        firsts = [next(iter(stream)) for stream in streams]
        assert all(first.choices[0].delta.role == "bot" for first in firsts)
        assert load() == 2  # both open: counted while their streams are read
        for stream in streams:
            for _ in stream:
                pass
        settles_to_zero("the load stayed up after both streams ended")
        left = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Count to 9."}],
            max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True})
        next(iter(left))
        assert load() == 1
        left.close()  # the client leaves mid-answer: its handler ends soon after
        settles_to_zero("the load stayed up after the client left")
        client.models.list()
        http.post(f"{server.url}/tokenize", json={"prompt": "x"})
        assert load() == 0  # only the requests that run the model count
    server.wait_idle()


def test_request_log_holds_the_generated_text_cut(server: Server,
                                                  client: openai.OpenAI) -> None:
    text = _chat(client, messages=[{"role": "user", "content": "Name a colour."}],
                 max_tokens=12).choices[0].message.content
    assert text and len(text) > MAX_LOG_LEN
    server.wait_idle()
    assert f"output 0: {text[:MAX_LOG_LEN]!r}" in server.log_text
    assert re.search(r"request chatcmpl-\S+ received: \d+ prompt tokens", server.log_text)


def test_access_log_leaves_out_the_probed_paths(server: Server,
                                                client: openai.OpenAI) -> None:
    client.models.list()
    server.wait_idle()  # /metrics, which is left out
    with server.http() as http:
        assert http.get(f"{server.url}/health?probe=1").status_code == 200
    log = server.log_text
    assert '"GET /v1/models HTTP/1.1" 200' in log
    assert "GET /health" not in log and "GET /metrics" not in log


def test_tools_left_out_of_the_prompt_when_they_may_not_be_called(
        client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    plain = _chat(client, messages=ask)
    assert plain.usage is not None
    none = _chat(client, messages=ask, tools=[WEATHER_TOOL], tool_choice="none")
    forced = _chat(client, messages=ask, tools=[WEATHER_TOOL], tool_choice="required")
    assert none.usage is not None and forced.usage is not None
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert forced.usage.prompt_tokens > plain.usage.prompt_tokens


def test_load_is_not_counted_for_a_refused_request(server: Server) -> None:
    """A 400 or 404 ends its count too: the counter must not drift up under bad traffic."""
    with server.http() as http:
        assert http.post(f"{server.url}/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": "not a list"}).status_code == 400
        assert http.post(f"{server.url}/v1/completions", json={
            "model": "other", "prompt": "x"}).status_code == 404
        assert http.get(f"{server.url}/load").json() == {"server_load": 0}


def test_keep_alive_comments_while_a_long_prompt_is_computed(
        server: Server, client: openai.OpenAI) -> None:
    """A stream's first event comes after the prefill, which for ~450 new tokens takes
    several keep-alive intervals on the CPU; clients skip the comments."""
    prompt = " ".join(f"w{uuid.uuid4().hex[:6]}" for _ in range(75))
    with server.http(timeout=120) as http:
        assert http.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()[
            "count"] > 400
        with http.stream("POST", f"{server.url}/v1/completions", json={
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": 3,
                "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
    assert lines[0] == ": keep-alive"
    data = [line for line in lines if not line.startswith(":")]
    assert len(data) == 4 and data[-1] == "data: [DONE]"
    # The SDK reads such a stream as if the comments were not there.
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=prompt + " again",
                                              max_tokens=3, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices)
