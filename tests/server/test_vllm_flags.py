"""vLLM's deployment flags on a server of their own, over HTTPS: a command copied from a
vLLM deployment runs unchanged and its flags do what they do there."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, Server, start_server

TEMPLATE = ("{{ greeting }}{% if reasoning_effort %} [{{ reasoning_effort }} {{ enable_thinking }}]"
            "{% endif %}{% for m in messages %} {{ m.content }}{% endfor %}")
KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificate")
    tmp = tmp_path_factory.mktemp("vllm-flags")
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True,
                   capture_output=True)
    server = start_server(
        tmp, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs",
        str(cert), "--ssl-cert-reqs", "1", "--root-path", "/llm", "--api-key", KEY,
        "--disable-fastapi-docs", "--return-tokens-as-token-ids",
        "--enable-force-include-usage", "--enable-prompt-tokens-details",
        "--disable-log-requests", "--uvicorn-log-level", "warning",
        "--enable-request-id-headers",
        "--disable-uvicorn-access-log", "--chat-template", TEMPLATE,
        "--default-chat-template-kwargs", json.dumps({"greeting": "Hello"}), https_ca=cert)
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.log_text


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                         http_client=httpx.Client(verify=server.verify, timeout=120))


def test_https_and_no_docs(server: Server) -> None:
    assert f"serving {MODEL_NAME} on {server.url}" in server.log_text
    assert server.url.startswith("https://")
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + page, verify=server.verify).status_code == 404
    with pytest.raises(httpx.ConnectError):  # the certificate is checked
        httpx.get(f"{server.url}/health")


def test_every_answer_carries_a_request_id(server: Server) -> None:
    """--enable-request-id-headers: the client's X-Request-Id back, else a new one, on
    answers, errors and refusals alike."""
    sent = httpx.get(f"{server.url}/health", verify=server.verify,
                     headers={"X-Request-Id": "trace-42"})
    assert sent.headers["x-request-id"] == "trace-42"
    refused = httpx.get(f"{server.url}/v1/models", verify=server.verify)
    assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 32


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_the_root_path_keeps_the_key_and_routes_both_ways(server: Server, prefix: str) -> None:
    """Behind a proxy that strips --root-path or one that passes it on, a route is
    reached, and the API key is still asked for (it once was not, with a root path)."""
    for path in ("/v1/models", "/reset_prefix_cache", "/tokenize"):
        method = "GET" if path == "/v1/models" else "POST"
        body = {"prompt": "hi"} if path == "/tokenize" else None
        refused = httpx.request(method, server.url + prefix + path, json=body,
                                verify=server.verify)
        assert refused.status_code == 401, (path, refused.text)
        allowed = httpx.request(method, server.url + prefix + path, json=body,
                                verify=server.verify, headers=AUTH)
        assert allowed.status_code == 200, (path, allowed.text)
    assert httpx.get(f"{server.url}{prefix}/health", verify=server.verify).status_code == 200


def test_logprob_tokens_are_ids_unless_the_request_says(client: openai.OpenAI) -> None:
    def tokens(**extra: object) -> list[str]:
        result = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            temperature=0, logprobs=True, top_logprobs=2, extra_body=extra)
        content = result.choices[0].logprobs.content  # type: ignore[union-attr]
        assert content is not None
        return [t.token for t in content] + [t.token for t in content[0].top_logprobs]

    as_ids = tokens()
    assert all(token.startswith("token_id:") for token in as_ids), as_ids
    as_text = tokens(return_tokens_as_token_ids=False)
    assert not any(token.startswith("token_id:") for token in as_text), as_text
    completion = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2,
                                           logprobs=1, temperature=0)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.tokens[0].startswith("token_id:")
    response = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=3,
                                       temperature=0, top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    scored = response.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert scored, response.output
    assert all(t.token.startswith("token_id:") for t in scored), scored
    assert all(a.token.startswith("token_id:") for t in scored for a in t.top_logprobs)


def test_usage_in_every_stream_and_on_each_chunk(client: openai.OpenAI,
                                                 server: Server) -> None:
    """--enable-force-include-usage: a stream that asked for no usage gets it on every
    chunk and in a last chunk, each with the prompt tokens served from the cache."""
    for create in (
            lambda: client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4, stream=True),
            lambda: client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4,
                                              stream=True)):
        chunks = list(create())
        assert all(c.usage is not None and c.usage.prompt_tokens_details is not None
                   for c in chunks)
        last = chunks[-1]
        assert last.choices == [] and last.usage is not None
        assert last.usage.completion_tokens == 4
    server.wait_idle()


def test_server_chat_template_kwargs_lie_under_the_requests(server: Server) -> None:
    """--default-chat-template-kwargs reach every rendering: chat, /tokenize, and the
    Messages API's token count."""
    def rendered(**extra: object) -> tuple[str, int]:
        body = {"messages": [{"role": "user", "content": "hi"}], **extra}
        encoded = httpx.post(f"{server.url}/tokenize", json=body, verify=server.verify,
                             headers=AUTH).json()
        text = httpx.post(f"{server.url}/detokenize", json={"tokens": encoded["tokens"]},
                          verify=server.verify, headers=AUTH).json()["prompt"]
        return str(text), int(encoded["count"])

    text, count = rendered()
    assert text == "Hello hi"
    assert rendered(chat_template_kwargs={"greeting": "Bye"})[0] == "Bye hi"
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", verify=server.verify,
                         headers=AUTH,
                         json={"model": MODEL_NAME,
                               "messages": [{"role": "user", "content": "hi"}]}).json()
    assert counted["input_tokens"] == count


def test_certificate_file_is_checked_before_the_model_loads(tmp_path: Path) -> None:
    from tests.test_cli import run_cli

    result = run_cli("serve", "--ssl-certfile", str(tmp_path / "missing.pem"))
    assert result.returncode == 2 and "not a readable file" in result.stderr


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(
        server: Server, client: openai.OpenAI) -> None:
    """OpenAI's `reasoning_effort` (Open WebUI, LibreChat and big-AGI send it) is the
    template's `reasoning_effort`, with `enable_thinking` unless the request sets it;
    the Responses API's `reasoning.effort` is the same."""
    def prompt(**extra: object) -> str:
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"return_token_ids": True, **extra})
        ids = reply.model_extra["prompt_token_ids"]  # type: ignore[index]
        return str(httpx.post(f"{server.url}/detokenize", json={"tokens": ids},
                              verify=server.verify, headers=AUTH).json()["prompt"])

    assert prompt() == "Hello hi"
    assert prompt(reasoning_effort="low") == "Hello [low True] hi"
    assert prompt(reasoning_effort="none") == "Hello [none False] hi"
    assert prompt(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}) \
        == "Hello [high False] hi"
    with pytest.raises(openai.BadRequestError) as refused:
        prompt(reasoning_effort="extreme")
    assert refused.value.body["param"] == "reasoning_effort"  # type: ignore[index]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        reasoning_effort="low")
    response = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=1,
                                       reasoning={"effort": "low"})
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=1,
                                reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]
