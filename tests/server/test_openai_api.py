"""The server through the official openai client: what OpenAI users rely on works."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL_NAME, Server, start_server

# Long enough to fill several KV blocks (16 tokens each), so a repeat can hit the cache.
SYSTEM_PROMPT = ("You are PageLLM's test assistant. You answer in one short sentence, you "
                 "never use lists, and you always stay polite and precise. ") * 2


def chat(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    """With vLLM's card fields: `root` is where the tokenizer can be loaded from (the
    default model's local directory), and one permission record."""
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    card = models.data[0].model_extra
    assert card["parent"] is None and Path(card["root"], "tokenizer.json").is_file()
    assert card["permission"][0]["object"] == "model_permission"
    assert client.models.retrieve(MODEL_NAME).model_extra["root"] == card["root"]


def test_health(server: Server) -> None:
    response = httpx.get(f"{server.url}/health")
    assert response.status_code == 200
    for method in ("GET", "POST"):  # vLLM's /ping, which SageMaker probes
        assert httpx.request(method, f"{server.url}/ping").json() == {"status": "ok"}
    assert f"serving {MODEL_NAME} on {server.url}" in server.log_text


def test_completion(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                       max_tokens=8, temperature=0)
    choice = result.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in ("stop", "length")
    assert result.model == MODEL_NAME
    assert result.usage is not None
    assert result.usage.completion_tokens <= 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason is not None


def test_return_token_ids_gives_the_ids_beside_the_text(server: Server,
                                                        client: openai.OpenAI) -> None:
    """vLLM's return_token_ids, as RL rollouts read it: the prompt's ids (a stream's
    first chunk) and each choice's generated ids (a stream's new ones), streamed and not,
    in completions and chat; left out of answers that did not ask."""
    prompt_ids = httpx.post(f"{server.url}/tokenize",
                            json={"prompt": "Once upon a time"}).json()["tokens"]
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8,
                                  temperature=1.0, seed=5, n=2,
                                  extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs)
    for choice in whole.choices:
        extra = choice.model_extra or {}
        assert extra["prompt_token_ids"] == prompt_ids and len(extra["token_ids"]) == 8
        decoded = httpx.post(f"{server.url}/detokenize",
                             json={"tokens": extra["token_ids"]}).json()["prompt"]
        assert decoded == choice.text
    streamed: dict[int, list[int]] = {}
    prompts_sent: dict[int, list[int]] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            streamed.setdefault(choice.index, []).extend(extra["token_ids"])
            if "prompt_token_ids" in extra:
                assert choice.index not in prompts_sent
                prompts_sent[choice.index] = extra["prompt_token_ids"]
    assert streamed == {c.index: (c.model_extra or {})["token_ids"] for c in whole.choices}
    assert prompts_sent == {0: prompt_ids, 1: prompt_ids}

    chat: dict[str, Any] = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                max_tokens=6, temperature=0,
                                extra_body={"return_token_ids": True})
    answer = client.chat.completions.create(**chat)
    ids = (answer.choices[0].model_extra or {})["token_ids"]
    assert len(ids) == answer.usage.completion_tokens  # type: ignore[union-attr]
    assert len((answer.model_extra or {})["prompt_token_ids"]) == \
        answer.usage.prompt_tokens  # type: ignore[union-attr]
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == \
        (answer.model_extra or {})["prompt_token_ids"]
    assert [t for c in chunks for choice in c.choices
            for t in (choice.model_extra or {}).get("token_ids", [])] == ids
    assert "token_ids" not in (chunks[0].choices[0].model_extra or {})  # the role chunk
    plain = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})
    server.wait_idle()


def test_streamed_choices_come_one_a_chunk(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, prompt=["Once upon a time", "Hello"],
                                  max_tokens=6, temperature=1.0, seed=3, n=2)
    whole = {c.index: c.text for c in client.completions.create(**kwargs).choices}
    pieces: dict[int, str] = {}
    for chunk in client.completions.create(stream=True, **kwargs):
        assert len(chunk.choices) == 1
        pieces[chunk.choices[0].index] = pieces.get(chunk.choices[0].index, "") + \
            chunk.choices[0].text
    assert pieces == whole and len(whole) == 4


def test_omitted_model_means_ours(server: Server) -> None:
    response = httpx.post(f"{server.url}/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL_NAME


def test_token_id_and_batch_prompts(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt=[[504, 3458, 282], [19556, 28]],
                                       max_tokens=3, temperature=0)
    assert [c.index for c in result.choices] == [0, 1]
    assert result.usage is not None and result.usage.prompt_tokens == 5
    batch = client.completions.create(model=MODEL_NAME, prompt=["Hello", "Goodbye"], n=2,
                                      max_tokens=3, temperature=0)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]


def test_chat(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8, temperature=0)
    message = result.choices[0].message
    assert message.role == "assistant"
    assert message.content
    assert result.object == "chat.completion"
    # No call: no tool_calls field at all, as OpenAI answers (not null, not []).
    assert "tool_calls" not in message.model_dump(exclude_unset=True)


def test_chat_max_completion_tokens(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Count to twenty."}],
        max_completion_tokens=3, temperature=0)
    assert result.usage is not None and result.usage.completion_tokens <= 3


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream_opens_once_the_prompt_is_computed(client: openai.OpenAI) -> None:
    """The role chunk comes with the first engine output, as vLLM sends it: clients
    (vLLM's `bench serve` among them) time their first chunk as the time to first token.
    Sent on arrival, it would read ~0 s whatever the prompt's length."""
    import time

    long_question = "Summarize this: " + "the quick brown fox jumps over a lazy dog " * 45
    start = time.perf_counter()
    arrivals: list[float] = []
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": long_question}],
            max_tokens=2, temperature=0, stream=True,
            extra_body={"cache_salt": uuid.uuid4().hex}):
        if chunk.choices:
            arrivals.append(time.perf_counter() - start)
    role, first_content = arrivals[0], arrivals[1]
    assert role >= 0.5 * first_content, (role, first_content)


def test_continuous_usage_stats_count_the_tokens_so_far(client: openai.OpenAI) -> None:
    """vLLM's `continuous_usage_stats`: usage on every chunk, growing to the final one."""
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    chat = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6, temperature=0, stream=True, stream_options=options))
    completion = list(client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two,", max_tokens=6, temperature=0,
        stream=True, stream_options=options))
    for chunks in (chat, completion):
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks if c.usage is not None]
        assert counts == sorted(counts) and counts[-1] == 6 and counts[-2] == 6
        assert len({c.usage.prompt_tokens for c in chunks if c.usage is not None}) == 1
        assert chunks[-1].choices == []  # the usage chunk of include_usage still ends it
    assert chat[0].usage is not None and chat[0].usage.completion_tokens == 0  # role chunk
    plain = list(client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two,", max_tokens=6, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]
    # n > 1: a chunk counts its own choice's tokens (as vLLM's do), the last all of them.
    several = list(client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two,", max_tokens=6, temperature=1.0, seed=2,
        n=3, extra_body={"ignore_eos": True}, stream=True, stream_options=options))
    own: dict[int, list[int]] = {}
    for chunk in several[:-1]:
        assert chunk.usage is not None
        own.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    assert {index: counts[-1] for index, counts in own.items()} == {0: 6, 1: 6, 2: 6}
    assert all(counts == sorted(counts) for counts in own.values())
    assert several[-1].usage is not None and several[-1].usage.completion_tokens == 18


def test_chat_stream_deltas_carry_no_nulls(server: Server) -> None:
    """As OpenAI and vLLM stream them: the role only in the first delta, no `null`s."""
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=60) as response:
        lines = [line[len("data: "):] for line in response.iter_lines()
                 if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    deltas = [json.loads(line)["choices"][0]["delta"] for line in lines[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert len(deltas) > 1 and all(set(delta) <= {"content"} for delta in deltas[1:])


def test_async_client_chat_stream_and_not(async_client: openai.AsyncOpenAI) -> None:
    async def run() -> tuple[str, str]:
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        whole = await async_client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
        stream = await async_client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await async_client.close()
        return whole.choices[0].message.content or "", "".join(parts)

    whole, streamed = asyncio.run(run())
    assert whole and whole == streamed


def test_async_client_completions(async_client: openai.AsyncOpenAI) -> None:
    async def run() -> list[str]:
        results = await asyncio.gather(*[
            async_client.completions.create(model=MODEL_NAME, prompt=f"Number {i} is",
                                            max_tokens=4, temperature=0) for i in range(4)])
        await async_client.close()
        return [r.choices[0].text for r in results]

    assert all(asyncio.run(run()))


def test_n_completions(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="My favourite food is", n=3,
                                       max_tokens=6, temperature=1.0, seed=7)
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    assert len({c.text for c in result.choices}) > 1
    chat_result = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=4)
    assert sorted(c.index for c in chat_result.choices) == [0, 1]


def test_stop_string(client: openai.OpenAI) -> None:
    free = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=12,
                                     temperature=0).choices[0].text
    assert "," in free
    stop_at = free[:free.index(",")]
    stopped = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=12,
                                        temperature=0, stop=[","]).choices[0]
    assert stopped.text == stop_at
    assert stopped.finish_reason == "stop"


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt="A random word:",
                                          max_tokens=8, temperature=1.0, seed=seed
                                          ).choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_completion_logprobs(client: openai.OpenAI) -> None:
    result = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=4,
                                       temperature=0, logprobs=3)
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens or []) == len(logprobs.token_logprobs or []) == 4
    assert "".join(logprobs.tokens or []) == result.choices[0].text
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs or [])
    assert all(len(top) >= 3 for top in logprobs.top_logprobs or [])
    assert logprobs.text_offset == sorted(logprobs.text_offset or [])


def test_chat_logprobs(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert content is not None and len(content) == result.usage.completion_tokens
    for token in content:
        assert len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob


def test_repeated_system_prompt_is_served_from_cache(client: openai.OpenAI) -> None:
    salt = uuid.uuid4().hex  # a fresh cache namespace: earlier tests cannot pre-warm it
    first = client.chat.completions.create(
        model=MODEL_NAME, messages=chat(SYSTEM_PROMPT, "What is a cat?"),
        max_tokens=4, temperature=0, extra_body={"cache_salt": salt})
    second = client.chat.completions.create(
        model=MODEL_NAME, messages=chat(SYSTEM_PROMPT, "What is a dog?"),
        max_tokens=4, temperature=0, extra_body={"cache_salt": salt})
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32, second.usage
    assert cached % 16 == 0  # whole blocks only
    assert cached < second.usage.prompt_tokens


def test_cache_salt_isolates_tenants(client: openai.OpenAI) -> None:
    system = f"Session {uuid.uuid4().hex}. {SYSTEM_PROMPT}"  # cached by no other test

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        result = client.chat.completions.create(
            model=MODEL_NAME, messages=chat(system, "Name a tree."),
            max_tokens=2, temperature=0, extra_body=extra)
        return result.usage.prompt_tokens_details.cached_tokens

    tenant_a, tenant_b = f"a-{uuid.uuid4().hex}", f"b-{uuid.uuid4().hex}"
    assert cached(tenant_a) == 0
    assert cached(tenant_a) > 0  # the same tenant hits its own blocks
    assert cached(tenant_b) == 0  # another tenant never sees them
    assert cached(None) == 0  # nor do requests without a salt
    assert cached(tenant_b) > 0


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_metrics_exposes_the_required_families(server: Server, path: str,
                                               body: dict[str, object]) -> None:
    assert httpx.post(f"{server.url}{path}", json=body, timeout=60).status_code == 200
    metrics = server.wait_idle()
    for name in ("pagellm_prefix_cache_queries_total", "pagellm_prefix_cache_hits_total",
                 "pagellm_kv_cache_usage", "pagellm_num_requests_running",
                 "pagellm_num_requests_waiting", "pagellm_num_preemptions_total",
                 "pagellm_prompt_tokens_total", "pagellm_generation_tokens_total",
                 "pagellm_time_to_first_token_seconds_count",
                 "pagellm_inter_token_latency_seconds_count",
                 "pagellm_e2e_request_latency_seconds_count"):
        assert name in metrics, name
    assert metrics["pagellm_e2e_request_latency_seconds_count"] >= 1
    assert metrics['pagellm_request_finished_total{finished_reason="length"}'] >= 1
    assert metrics["pagellm_generation_tokens_total"] >= 2
    text = httpx.get(f"{server.url}/metrics").text
    assert "# TYPE pagellm_time_to_first_token_seconds histogram" in text
    assert 'le="+Inf"' in text
    # The same series under vLLM's names, for dashboards and autoscalers written for it.
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert ('vllm:time_to_first_token_seconds_bucket{model_name="SmolLM2-135M-Instruct",'
            'engine="0",le=') in text
    metrics = server.metrics()
    for ours, theirs in (("pagellm_num_requests_running",
                          'vllm:num_requests_running{engine="0"}'),
                         ("pagellm_kv_cache_usage", 'vllm:kv_cache_usage_perc{engine="0"}'),
                         ("pagellm_prefix_cache_hits_total",
                          'vllm:prefix_cache_hits_total{engine="0"}'),
                         ("pagellm_prompt_tokens_total", 'vllm:prompt_tokens_total{engine="0"}'),
                         ("pagellm_e2e_request_latency_seconds_count",
                          'vllm:e2e_request_latency_seconds_count{engine="0"}'),
                         ('pagellm_request_finished_total{finished_reason="length"}',
                          'vllm:request_success_total{finished_reason="length",engine="0"}')):
        assert metrics[theirs] == metrics[ours], theirs


def test_metrics_count_http_requests_and_the_process_as_vllm_does(server: Server) -> None:
    """vLLM's instrumentator series (by route template, method and status class) and
    prometheus_client's process series; probes and /metrics itself are left out."""
    key = 'http_requests_total{method="POST",status="%s",handler="%s"}'
    before = server.metrics()
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}
                         ).status_code == 200
        assert http.post("/v1/completions", json={"prompt": 5}).status_code == 400
        assert http.post("/no/such/route", json={}).status_code == 404
        assert http.get("/health").status_code == 200
        assert http.get("/v1/models/" + MODEL_NAME).status_code == 200
        assert http.get("/v1/completions").status_code == 405
        assert http.request("BREW", "/v1/models").status_code == 405
    after = server.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew(key % ("2xx", "/v1/completions")) == 1
    assert grew(key % ("4xx", "/v1/completions")) == 1
    assert grew(key % ("4xx", "none")) == 1  # a path no route matches
    assert grew('http_requests_total{method="GET",status="2xx",handler="/v1/models/{name:path}"}'
                ) == 1
    assert grew('http_requests_total{method="GET",status="4xx",handler="/v1/completions"}') == 1
    assert grew('http_requests_total{method="other",status="4xx",handler="/v1/models"}') == 1
    assert not any("/health" in name or '"/metrics"' in name for name in after)
    assert grew('http_request_duration_seconds_count{method="POST",handler="/v1/completions"}'
                ) == 2
    assert grew("http_request_duration_highr_seconds_count") == 6
    assert after["process_resident_memory_bytes"] > 10 << 20
    assert after["process_cpu_seconds_total"] > 0 and after["process_open_fds"] > 0
    # Each family once, under one HELP and TYPE: the text is valid for strict parsers.
    text = httpx.get(f"{server.url}/metrics").text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families))


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: openai.OpenAI) -> None:
    """vLLM's way for scoring harnesses to ask a prompt's likelihood: the prompt back,
    its tokens' logprobs (the first without one), and no completion."""
    prompt = "The capital of France is Paris"
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, prompt=prompt, max_tokens=0, echo=True,
                                  logprobs=1, temperature=0)
    whole = client.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.text == prompt
    assert whole.usage.completion_tokens == 0
    tokens = whole.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    streamed = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt
    with_one = client.completions.create(**{**kwargs, "max_tokens": 1})
    assert with_one.choices[0].logprobs.token_logprobs[:tokens] == \
        choice.logprobs.token_logprobs
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(**{**kwargs, "echo": False})


def test_echo_puts_the_prompt_before_the_completion(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt="The capital of France is", **kwargs)
    echoed = client.completions.create(prompt="The capital of France is", echo=True, **kwargs)
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    streamed = list(client.completions.create(prompt="The capital of France is", echo=True,
                                              stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    ids = client.completions.create(prompt=[504, 3458, 282], echo=True, **kwargs)
    no_echo = client.completions.create(prompt=[504, 3458, 282], **kwargs)
    assert ids.choices[0].text.endswith(no_echo.choices[0].text)
    assert len(ids.choices[0].text) > len(no_echo.choices[0].text)


def test_logit_bias_forces_and_forbids_tokens(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="The capital of France is", max_tokens=5,
                  temperature=0, logprobs=0)
    plain = client.completions.create(**kwargs).choices[0].logprobs
    assert plain is not None and plain.tokens
    forced = client.completions.create(logit_bias={"28": 100}, **kwargs).choices[0].logprobs
    assert forced is not None and len(set(forced.tokens)) == 1
    assert forced.token_logprobs[0] > -1e-3
    first = client.completions.create(prompt=[28], echo=True, max_tokens=1, model=MODEL_NAME)
    assert forced.tokens[0] == first.choices[0].text[: len(forced.tokens[0])]
    # Forbidding the greedy first token changes it (the sampler sees the biased logits).
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.model.loader import load_tokenizer
    from pagellm.model.resolve import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(None, resolve_cache_dir()))
    (first_id,) = tokenizer.encode(plain.tokens[0], add_special_tokens=False)
    # -1e9 is clamped to -100, as vLLM's server does.
    forbidden = client.completions.create(logit_bias={str(first_id): -1e9},
                                          **kwargs).choices[0].logprobs
    assert forbidden is not None and forbidden.tokens[0] != plain.tokens[0]


def test_bad_words_and_allowed_token_ids(client: openai.OpenAI) -> None:
    """vLLM's extras, sent as the openai client sends them (extra_body)."""
    kwargs = dict(model=MODEL_NAME, prompt="Q: What is the capital of France?\nA: The capital "
                  "of France is", max_tokens=8, temperature=0)
    assert client.completions.create(**kwargs).choices[0].text.startswith(" Paris")
    banned = client.completions.create(extra_body={"bad_words": ["Paris"]}, **kwargs)
    assert "Paris" not in banned.choices[0].text
    allowed = client.completions.create(
        prompt=[28, 29], max_tokens=6, model=MODEL_NAME, temperature=1.0, seed=3, logprobs=0,
        extra_body={"allowed_token_ids": [11, 28, 29], "return_tokens_as_token_ids": True})
    logprobs = allowed.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens
    assert set(logprobs.tokens) <= {"token_id:11", "token_id:28", "token_id:29"}
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=4, temperature=0, logprobs=True,
        extra_body={"allowed_token_ids": [11, 28], "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
    assert content and {item.token for item in content} <= {"token_id:11", "token_id:28"}


def test_continue_final_message_continues_the_assistant(client: openai.OpenAI) -> None:
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.engine.chat_template import ChatOptions, render_chat
    from pagellm.model.loader import load_tokenizer
    from pagellm.model.resolve import resolve_model_path

    messages = [{"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "The answer is"}]
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    tokenizer = load_tokenizer(resolve_model_path(None, resolve_cache_dir()))
    ids = render_chat(tokenizer, messages, ChatOptions(add_generation_prompt=False,
                                                       continue_final_message=True))
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe answer is")
    assert result.usage is not None and result.usage.prompt_tokens == len(ids)
    same = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=6, temperature=0)
    assert result.choices[0].message.content == same.choices[0].text
    # vLLM's echo: the answer starts with the message it continues, streamed first.
    echo = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    echoed = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                            temperature=0, extra_body=echo)
    assert echoed.choices[0].message.content == "The answer is" + same.choices[0].text
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=echo))
    assert chunks[1].choices[0].delta.content == "The answer is"
    assert chunks[1].usage is not None and chunks[1].usage.completion_tokens == 0
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        echoed.choices[0].message.content)
    # After the generation prompt the answer starts a new message: nothing to echo.
    question = client.chat.completions.create(
        model=MODEL_NAME, messages=messages[:1], max_tokens=6, temperature=0,
        extra_body={"echo": True})
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages[:1],
                                           max_tokens=6, temperature=0)
    assert question.choices[0].message.content == plain.choices[0].message.content


def test_continue_final_message_completes_the_users_text(server: Server,
                                                         client: openai.OpenAI) -> None:
    """vLLM's rule for any last role: the answer continues the message, takes its role,
    and with echo starts with its text."""
    messages = [{"role": "user", "content": "The capital of France is"}]
    body = {"continue_final_message": True, "add_generation_prompt": False, "echo": True}
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=6, temperature=0, extra_body=body)
    tokens = httpx.post(f"{server.url}/tokenize", json={
        "model": MODEL_NAME, "messages": messages, "continue_final_message": True,
        "add_generation_prompt": False}).json()["tokens"]
    same = client.completions.create(model=MODEL_NAME, prompt=tokens, max_tokens=6,
                                     temperature=0)
    assert result.choices[0].message.role == "user"
    assert result.choices[0].message.content == "The capital of France is" + same.choices[0].text


def test_tools_with_tool_choice_none_and_earlier_tool_calls(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "weather", "parameters": {}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 20 C."},
    ]
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[tool],
                                            tool_choice="none", max_tokens=4, temperature=0)
    assert result.choices[0].message.content is not None
    text = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        response_format={"type": "text"})
    assert text.choices[0].finish_reason is not None


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    """OpenAI's structured output as the client sends it: the answer parses and follows
    the schema, and the stream says the same as the whole answer."""
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Name a big city and its population."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
        extra_body={"structured_outputs": {"json": None, "disable_any_whitespace": True}})
    result = client.chat.completions.create(**kwargs)
    choice = result.choices[0]
    answer = json.loads(choice.message.content or "")
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    assert len(answer["city"]) <= 24 and choice.finish_reason == "stop"
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(stream=True, **kwargs)
                       if chunk.choices)
    assert streamed == choice.message.content


def test_chat_completions_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The openai client's own structured-output helper (it sends a strict schema)."""
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        verdict: bool
        reason: str = Field(max_length=40)

    result = client.chat.completions.parse(
        model=MODEL_NAME, max_tokens=60, temperature=0, response_format=Answer,
        messages=[{"role": "user", "content": "Is water wet? Answer as JSON."}])
    parsed = result.choices[0].message.parsed
    assert isinstance(parsed, Answer)


def test_json_object_and_guided_choice(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=80, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a name."}],
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:
        assert (obj.choices[0].message.content or "").startswith("{")
    prompt = "Q: Is the sky green? Answer yes or no.\nA:"
    for extra in ({"guided_choice": [" yes", " no"]},
                  {"structured_outputs": {"choice": [" yes", " no"]}}):
        result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                           temperature=1.0, seed=5, n=3, extra_body=extra)
        assert {c.text for c in result.choices} <= {" yes", " no"}
        assert {c.finish_reason for c in result.choices} == {"stop"}
    # vLLM's StructuredOutputsParams serialised whole, unset fields as null.
    vllm_style = {"json": None, "regex": None, "choice": [" yes", " no"], "grammar": None,
                  "json_object": None, "disable_any_whitespace": False,
                  "disable_additional_properties": False, "whitespace_pattern": None,
                  "structural_tag": None}
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                       temperature=0, extra_body={"structured_outputs": vllm_style})
    assert result.choices[0].text in (" yes", " no")
    # guidance's vLLM client sends its grammar twice, as guided_grammar and in
    # structured_outputs; outlines' Lark grammars begin with an inlined `?start:`.
    grammar = '?start: answer\nanswer: " yes" | " no"'
    both = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"guided_decoding_backend": "guidance", "guided_grammar": grammar,
                    "structured_outputs": {"grammar": grammar}})
    assert both.choices[0].text in (" yes", " no")
    rule = " | ".join(f'"item {i}"' for i in range(20_001))  # past llguidance's parser limit
    with pytest.raises(openai.InternalServerError, match="structured output failed"):
        client.completions.create(model=MODEL_NAME, prompt="Pick:", max_tokens=8,
                                  extra_body={"guided_grammar": f"start: {rule}"})
    digits = client.completions.create(model=MODEL_NAME, prompt="My PIN is", max_tokens=8,
                                       temperature=0, extra_body={"guided_regex": r" \d{4}"})
    assert re.fullmatch(r" [0-9]{4}", digits.choices[0].text)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}


def _streamed_tool_calls(chunks: Any) -> tuple[list[dict[str, str]], str | None, str]:
    """Tool calls put together from a stream's deltas, as the openai client does."""
    calls: dict[int, dict[str, str]] = {}
    reason, content = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += piece.id or ""
                call["name"] += piece.function.name or "" if piece.function else ""
                call["arguments"] += piece.function.arguments or "" if piece.function else ""
            reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason, content


def test_a_forced_call_has_only_the_listed_arguments(client: openai.OpenAI) -> None:
    """LangChain's with_structured_output(method="function_calling") sends a schema
    without additionalProperties; read as vLLM's default backend reads it (closed), the
    small model cannot add keys until max_tokens cuts the JSON."""
    person = {"type": "function", "function": {"name": "Person", "parameters": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "age": {"type": "integer"}},
        "required": ["name", "age"]}}}
    result = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=60, temperature=0, tools=[person],
        messages=[{"role": "user", "content": "Extract: John is 30 years old."}],
        tool_choice={"type": "function", "function": {"name": "Person"}})
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.tool_calls is not None
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"name", "age"}
    # instructor's RESPONSES_TOOLS sends the schema as a format too: the call wins (vLLM's
    # rule), since it is the whole answer.
    both = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=60, temperature=0, tools=[person],
        messages=[{"role": "user", "content": "Extract: John is 30 years old."}],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        response_format={"type": "json_object"})
    assert both.choices[0].message.tool_calls is not None
    assert both.choices[0].message.tool_calls[0].function.arguments == \
        choice.message.tool_calls[0].function.arguments


def test_tool_schemas_are_compiled_only_for_a_forced_call(client: openai.OpenAI) -> None:
    """With "none" (or "auto") the tools are only rendered into the prompt, as vLLM
    treats them: one whose schema would not compile (llama-index once sent a $ref
    without its $defs) does not fail the request."""
    broken = {"type": "function", "function": {"name": "Order", "parameters": {
        "type": "object", "properties": {"items": {"type": "array",
                                                   "items": {"$ref": "#/$defs/Item"}}}}}}
    answer = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
        tools=[broken], tool_choice="none")
    assert answer.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="tools.0..function.parameters"):
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            tools=[broken], tool_choice="required")


def test_a_named_tool_choice_answers_its_arguments(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, max_tokens=60, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    result = client.chat.completions.create(**kwargs)
    message = result.choices[0].message
    assert message.content == "" and result.choices[0].finish_reason == "stop"
    (call,) = message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    calls, reason, content = _streamed_tool_calls(
        client.chat.completions.create(stream=True, **kwargs))
    assert content == "" and reason == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)]
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    # The agent loop: the answer and the tool's result go back into the conversation.
    follow_up = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, temperature=0, tools=[WEATHER_TOOL], tool_choice="none",
        messages=[*kwargs["messages"], message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 20 C."}])
    assert follow_up.choices[0].message.content and not follow_up.choices[0].message.tool_calls


def test_required_tool_choice_answers_calls(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, max_tokens=80, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required", parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    result = client.chat.completions.create(**kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # vLLM's
    (call,) = choice.message.tool_calls or []  # parallel_tool_calls=False: one call
    assert call.function.name in ("get_weather", "get_time")
    schema = (WEATHER_TOOL if call.function.name == "get_weather" else TIME_TOOL)["function"]
    assert set(json.loads(call.function.arguments)) == set(schema["parameters"]["required"])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls, reason, content = _streamed_tool_calls(chunks)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)]
    # The reason comes in a chunk of its own after the calls, as OpenAI sends it
    # (openai-node's stream helper marks a call done only then).
    assert all(c.choices[0].finish_reason is None for c in chunks if c.choices[0].delta.tool_calls)
    assert chunks[-1].choices[0].delta.model_dump(exclude_none=True) == {}
    # Cut by max_tokens, the array names no call: its text stays the content, and
    # tool_calls is an empty list, as vLLM answers (LiteLLM fails on null there).
    cut = client.chat.completions.create(**{**kwargs, "max_tokens": 3}).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls == []
    assert (cut.message.content or "").startswith("[")
    # Cut by a stop string it keeps "stop": "tool_calls" would tell an agent loop to run
    # calls that are not there.
    stopped = client.chat.completions.create(**{**kwargs, "stop": ["name"]}).choices[0]
    assert stopped.finish_reason == "stop" and stopped.message.tool_calls == []


def test_forced_tool_calls_with_n_cuts_and_none(client: openai.OpenAI) -> None:
    """n > 1 sampled calls arrive the same streamed or not; a named call cut by
    max_tokens keeps its partial arguments with finish_reason "length"; with
    tool_choice "none" a response_format still applies, to the content."""
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    kwargs: dict[str, Any] = dict(
        model=MODEL_NAME, max_tokens=60, temperature=1.0, seed=11, n=3, messages=messages,
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    result = client.chat.completions.create(**kwargs)
    whole = {c.index: (c.message.tool_calls or [])[0].function.arguments for c in result.choices}
    pieces: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        assert len(chunk.choices) == 1  # one choice a chunk, as OpenAI and vLLM send them
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                pieces[choice.index] = pieces.get(choice.index, "") + (
                    piece.function.arguments or "" if piece.function else "")
    assert pieces == whole and len(set(whole.values())) > 1

    cut = client.chat.completions.create(**{**kwargs, "n": 1, "max_tokens": 4})
    assert cut.choices[0].finish_reason == "length"
    (call,) = cut.choices[0].message.tool_calls or []
    assert call.function.arguments.startswith("{") and len(call.function.arguments) > 1

    answer = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=40, temperature=0, messages=messages, tools=[WEATHER_TOOL],
        tool_choice="none", response_format={"type": "json_object"},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert not answer.choices[0].message.tool_calls
    assert (answer.choices[0].message.content or "").startswith("{")


def test_a_stream_whose_format_fails_ends_with_an_error_event(client: openai.OpenAI) -> None:
    rule = " | ".join(f'"item {i}"' for i in range(20_001))  # past llguidance's parser limit
    stream = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "Pick one."}],
        extra_body={"guided_grammar": f"start: {rule}"})
    with pytest.raises(openai.APIError, match="structured output failed"):
        for _ in stream:
            pass


def test_parse_with_a_pydantic_function_tool(client: openai.OpenAI) -> None:
    """The openai client's strict function tools, read back into the model class, as
    libraries such as instructor use them."""
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=20)
        celsius: bool

    result = client.chat.completions.parse(
        model=MODEL_NAME, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={"type": "function", "function": {"name": "Weather"}})
    (call,) = result.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)


def test_health_answers_while_a_huge_prompt_is_tokenized(server: Server) -> None:
    """Tokenizing runs off the event loop: a megabyte of text takes a while to encode,
    and every other request must not wait for it."""
    import threading
    import time

    from tests.server.conftest import MAX_REQUEST_BYTES

    body = {"prompt": "hello world, " * ((MAX_REQUEST_BYTES - 1000) // 13), "max_tokens": 2}
    result: dict[str, httpx.Response] = {}

    def post() -> None:
        result["big"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    thread = threading.Thread(target=post)
    started = time.monotonic()
    thread.start()
    worst = 0.0
    while thread.is_alive():
        before = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - before)
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    assert result["big"].status_code == 400 and "context length" in result["big"].text
    assert worst < max(0.5, elapsed / 3), (worst, elapsed)


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    ids = [504, 3458, 282, 19556, 28, 504, 3458]
    kwargs = dict(model=MODEL_NAME, max_tokens=4, temperature=0)
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 3},
                                    **kwargs)
    assert cut.usage is not None and cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == client.completions.create(prompt=ids[-3:],
                                                            **kwargs).choices[0].text
    echoed = client.completions.create(prompt="one two three four five six", echo=True,
                                       extra_body={"truncate_prompt_tokens": 2}, **kwargs)
    assert echoed.choices[0].text.startswith(" five six")
    whole = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": -1},
                                      **kwargs)
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], extra_body={"truncate_prompt_tokens": 5},
        **kwargs)
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    # vLLM's truncation_side "right" keeps the first tokens instead.
    first = client.completions.create(prompt=ids, extra_body={
        "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True},
        **kwargs)
    assert first.choices[0].model_extra is not None
    assert first.choices[0].model_extra["prompt_token_ids"] == ids[:3]
    assert first.choices[0].text == client.completions.create(prompt=ids[:3],
                                                              **kwargs).choices[0].text
    chat_first = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], extra_body={
            "truncate_prompt_tokens": 5, "truncation_side": "right", "return_token_ids": True},
        **kwargs)
    assert chat_first.model_extra is not None
    assert chat_first.model_extra["prompt_token_ids"][:1] == [1]  # <|im_start|> kept
    assert len(chat_first.model_extra["prompt_token_ids"]) == 5


def test_add_special_tokens_and_tokens_as_ids(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Hello there", max_tokens=2, temperature=0)
    plain = client.completions.create(**kwargs)
    without = client.completions.create(extra_body={"add_special_tokens": False}, **kwargs)
    assert plain.usage is not None and without.usage is not None
    assert without.usage.prompt_tokens <= plain.usage.prompt_tokens
    as_ids = client.completions.create(logprobs=2, **kwargs,
                                       extra_body={"return_tokens_as_token_ids": True})
    logprobs = as_ids.choices[0].logprobs
    assert logprobs is not None
    assert all(t.startswith("token_id:") for t in logprobs.tokens)
    assert as_ids.choices[0].text == plain.choices[0].text


def test_text_offsets_point_into_the_text_across_split_characters(client: openai.OpenAI
                                                                  ) -> None:
    """Tokens that each hold part of a character read U+FFFD alone; their offsets must
    still follow the text (they all point at that character), streamed or not."""
    kwargs = dict(model=MODEL_NAME, prompt="日本語で自己紹介してください。", max_tokens=24,
                  temperature=0, logprobs=0)
    whole = client.completions.create(**kwargs).choices[0]
    logprobs = whole.logprobs
    assert logprobs is not None and logprobs.text_offset is not None
    assert any(t == "\ufffd" for t in logprobs.tokens or []), "needs a split character"
    text = whole.text
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert all(0 <= offset <= len(text) for offset in logprobs.text_offset)
    for offset, token in zip(logprobs.text_offset, logprobs.tokens or [], strict=True):
        if token != "\ufffd":
            assert text[offset:].startswith(token), (offset, token)
    streamed = [c.choices[0].logprobs for c in client.completions.create(stream=True,
                                                                         **kwargs)
                if c.choices and c.choices[0].logprobs is not None]
    assert [o for part in streamed for o in part.text_offset or []] == logprobs.text_offset


def test_streamed_offsets_follow_the_text_sent_when_a_stop_string_cuts(client: openai.OpenAI
                                                                       ) -> None:
    """Text that may begin a stop string is held back from a stream; the tokens it comes
    from are sent with it, not before: each chunk's offsets point into the text sent so
    far, and all of them are the unstreamed answer's (they went backwards before)."""
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=32,
                                  temperature=0, logprobs=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[len(text) // 3:len(text) // 3 + 13]
    kwargs["stop"] = stop
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop" and stop not in whole.text
    assert whole.logprobs is not None and whole.logprobs.text_offset is not None
    sent, offsets = "", []
    for chunk in client.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        sent += chunk.choices[0].text
        for offset in (chunk.choices[0].logprobs.text_offset or []
                       if chunk.choices[0].logprobs else []):
            assert offset <= len(sent), (offset, sent)
            offsets.append(offset)
    assert sent == whole.text
    assert offsets == whole.logprobs.text_offset


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI) -> None:
    """What scoring harnesses send (echo, logprobs, one token): the block lists the
    prompt's tokens first, the first without a logprob, then the completion's."""
    kwargs = dict(model=MODEL_NAME, prompt="The capital of France is Paris", max_tokens=1,
                  temperature=0, logprobs=1, echo=True)
    result = client.completions.create(**kwargs)
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and result.usage is not None
    prompt_tokens = result.usage.prompt_tokens
    assert len(logprobs.tokens or []) == prompt_tokens + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join((logprobs.tokens or [])[:prompt_tokens]) == "The capital of France is Paris"
    assert logprobs.text_offset == sorted(logprobs.text_offset or [])
    assert (logprobs.text_offset or [])[-1] == len("The capital of France is Paris")
    plain = client.completions.create(model=MODEL_NAME, prompt=kwargs["prompt"], max_tokens=1,
                                      temperature=0, logprobs=1).choices[0].logprobs
    assert plain is not None
    assert logprobs.token_logprobs[-1] == pytest.approx(plain.token_logprobs[0], abs=1e-4)
    streamed = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)
                if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens or []] == \
        logprobs.tokens
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset or []] == \
        logprobs.text_offset


def test_prompt_logprobs_field(client: openai.OpenAI) -> None:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank,
    decoded_token}}, None for the first; the scores equal echo's."""
    prompt = [504, 3458, 282, 19556, 28]
    result = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                       temperature=0, extra_body={"prompt_logprobs": 2})
    scores = result.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(prompt)
    echo = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                      temperature=0, logprobs=2, echo=True).choices[0].logprobs
    assert echo is not None
    for position, entry in enumerate(scores[1:], 1):
        # The prompt's own token first, as vLLM and the offline Logprob mapping order it.
        assert next(iter(entry)) == str(prompt[position])
        own = entry[str(prompt[position])]
        assert own["logprob"] == pytest.approx(echo.token_logprobs[position], abs=1e-5)
        assert own["rank"] >= 1 and len(entry) >= 2
    for token, top in zip((echo.tokens or [])[1:], (echo.top_logprobs or [])[1:], strict=True):
        assert top is not None and next(iter(top)) == token
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0})
    chat_scores = chat.model_extra["prompt_logprobs"]
    assert chat.usage is not None and len(chat_scores) == chat.usage.prompt_tokens
    # return_tokens_as_token_ids names the logprobs' tokens, not decoded_token (vLLM's).
    as_ids = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
        extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True}).choices[0]
    assert as_ids.logprobs is not None and as_ids.logprobs.tokens is not None
    assert as_ids.logprobs.tokens[1] == f"token_id:{prompt[1]}"
    assert as_ids.logprobs.text_offset == echo.text_offset  # into the text, as without ids
    entry = as_ids.model_extra["prompt_logprobs"][1][str(prompt[1])]
    assert entry["decoded_token"] == scores[1][str(prompt[1])]["decoded_token"] == \
        echo.tokens[1]  # type: ignore[index]


def test_echo_logprobs_and_prompt_logprobs_each_show_their_own_count(client: openai.OpenAI
                                                                     ) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=[504, 3458, 282, 19556, 28], max_tokens=1, temperature=0,
        logprobs=1, echo=True, extra_body={"prompt_logprobs": 4})
    choice = result.choices[0]
    assert choice.logprobs is not None
    assert all(len(top) <= 2 for top in (choice.logprobs.top_logprobs or [])[1:] if top)
    scores = choice.model_extra["prompt_logprobs"]
    assert all(len(entry) >= 4 for entry in scores[1:])


def test_sagemaker_invocations_route_chat_and_completions(server: Server,
                                                          client: openai.OpenAI) -> None:
    """vLLM's /invocations: a body with messages is answered as chat, one with a prompt
    as a completion, streamed or not."""
    chat_body = {"model": MODEL_NAME, "messages": chat(SYSTEM_PROMPT, "What is a cat?"),
                 "max_tokens": 5, "temperature": 0}
    plain_body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 5,
                  "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        routed = http.post("/invocations", json=chat_body).json()
        assert routed["object"] == "chat.completion"
        assert routed["choices"][0]["message"]["content"] == client.chat.completions.create(
            **chat_body).choices[0].message.content
        completed = http.post("/invocations", json=plain_body).json()
        assert completed["object"] == "text_completion"
        assert completed["choices"][0]["text"] == client.completions.create(
            **plain_body).choices[0].text
        streamed = http.post("/invocations", json={**plain_body, "stream": True}).text
        assert streamed.rstrip().endswith("data: [DONE]")
        for body, param in (({"input": "x"}, None), ({"messages": "Hi"}, "messages"),
                            ({"prompt": "x", "max_tokens": "many"}, "max_tokens")):
            refused = http.post("/invocations", json=body)
            assert refused.status_code == 400, body
            assert refused.json()["error"]["param"] == param
        # A body it cannot read is the 400 a route's body gets, in the same words.
        for body, words in ((b'{"prompt": ', "parse the JSON"), (b"", "body is empty"),
                            (b'{"prompt": "caf\xe9"}', "not UTF-8 text (byte 15)")):
            garbled = http.post("/invocations", content=body,
                                headers={"Content-Type": "application/json"})
            assert garbled.status_code == 400 and words in garbled.text, garbled.text
    server.wait_idle()


def test_answer_ids_come_from_x_request_id_as_in_vllm(server: Server,
                                                     client: openai.OpenAI) -> None:
    """vLLM's ids: the client's X-Request-Id (a gateway's trace id), else the body's
    request_id, after the endpoint's prefix; two requests sent with one id at once (a
    gateway's retry) both run."""
    messages = [{"role": "user", "content": "Hi"}]
    traced = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2,
                                            extra_headers={"X-Request-Id": "trace-7"})
    assert traced.id == "chatcmpl-trace-7"
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=2, stream=True,
        extra_body={"request_id": "mine"}))
    assert {chunk.id for chunk in chunks} == {"cmpl-mine"}
    header_wins = client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"request_id": "mine"},
        extra_headers={"X-Request-Id": "gateway"})
    assert header_wins.id == "cmpl-gateway"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        twins = list(pool.map(lambda _: client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "twin"}),
            range(2)))
    assert [twin.id for twin in twins] == ["chatcmpl-twin"] * 2
    assert twins[0].choices[0].message.content == twins[1].choices[0].message.content
    server.wait_idle()


def test_openapi_document_says_what_errors_look_like(server: Server) -> None:
    """A request the server cannot take is documented as the 400 it answers, in OpenAI's
    error shape, not FastAPI's 422, which it never sends."""
    document = httpx.get(f"{server.url}/openapi.json").json()
    operations = [op for path in document["paths"].values() for op in path.values()]
    assert not any("422" in op["responses"] for op in operations)
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert chat["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}
    schemas = document["components"]["schemas"]
    assert set(schemas["ErrorResponse"]["properties"]) == {"error"}
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": 5}).json()
    assert set(refused) == {"error"} and set(refused["error"]) == {
        "message", "type", "param", "code"}


def test_models_retrieve(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError):  # an empty name names no model
        client.get("/models/", cast_to=object)


def test_tokenize_gives_the_tokens_each_endpoint_sends(server: Server,
                                                       client: openai.OpenAI) -> None:
    """/tokenize uses the generation endpoints' own encoding and chat rendering, so its
    count is the prompt_tokens those endpoints report."""
    messages = chat(SYSTEM_PROMPT, "What is a cat?")
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME,
                                                          "messages": messages}).json()
    answer = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=1, temperature=0)
    assert answer.usage is not None and rendered["count"] == answer.usage.prompt_tokens
    assert rendered["count"] == len(rendered["tokens"]) and rendered["token_strs"] is None

    text = "The capital of France is"
    encoded = httpx.post(f"{server.url}/tokenize",
                         json={"prompt": text, "return_token_strs": True}).json()
    completion = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=1)
    assert completion.usage is not None and encoded["count"] == completion.usage.prompt_tokens
    assert encoded["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    assert "".join(encoded["token_strs"]).replace("Ġ", " ") == text

    decoded = httpx.post(f"{server.url}/detokenize", json={"tokens": rendered["tokens"]})
    assert decoded.status_code == 200, decoded.text
    # Only with --enable-tokenizer-info-endpoint, as in vLLM (see the next test).
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 404
    assert decoded.json()["prompt"].startswith("<|im_start|>system\n" + SYSTEM_PROMPT)
    assert decoded.json()["prompt"].endswith("<|im_start|>assistant\n")


def test_serve_renders_chat_with_the_chat_template_option(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """`serve --chat-template FILE`: /tokenize and chat completions both render with it
    (the server's own tokenizer copy included)."""
    folder = tmp_path_factory.mktemp("template")
    (folder / "plain.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    templated = start_server(folder, "--chat-template", str(folder / "plain.jinja"),
                             "--enable-tokenizer-info-endpoint")
    try:
        # vLLM's /tokenizer_info, which lm-evaluation-harness's remote tokenizer reads:
        # the configuration, with the template chats are rendered with.
        info = httpx.get(f"{templated.url}/tokenizer_info").json()
        assert info["chat_template"] == (folder / "plain.jinja").read_text()
        assert info["eos_token"] == "<|im_end|>" and info["tokenizer_class"]
        assert info["added_tokens_decoder"]["0"] == {  # as tokenizer_config.json has it
            "content": "<|endoftext|>", "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}
        assert not any(key.endswith("_file") or key == "name_or_path" for key in info)
        messages = [{"role": "user", "content": "What is a cat?"}]
        rendered = httpx.post(f"{templated.url}/tokenize", json={"messages": messages}).json()
        decoded = httpx.post(f"{templated.url}/detokenize",
                             json={"tokens": rendered["tokens"]}).json()["prompt"]
        assert decoded == "user: What is a cat?\nassistant:"
        client = openai.OpenAI(base_url=f"{templated.url}/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=1)
        assert answer.usage is not None and answer.usage.prompt_tokens == rendered["count"]
    finally:
        templated.stop()


def test_serve_with_the_priority_policy_takes_priorities(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    prioritized = start_server(tmp_path_factory.mktemp("priority"), "--scheduling-policy",
                               "priority")
    try:
        client = openai.OpenAI(base_url=f"{prioritized.url}/v1", api_key="none",
                               max_retries=0)
        for priority in (-3, 0, 7):
            answer = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                                               extra_body={"priority": priority})
            assert answer.usage is not None and answer.usage.completion_tokens == 2
        with pytest.raises(openai.BadRequestError, match="priority"):
            client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                                      extra_body={"priority": 1.5})
    finally:
        prioritized.stop()


def test_tokenize_follows_the_chat_options(server: Server) -> None:
    messages = [{"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "It is"}]

    def count(**options: object) -> int:
        response = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **options})
        assert response.status_code == 200, response.text
        return int(response.json()["count"])

    continued = count(continue_final_message=True, add_generation_prompt=False)
    closed = count(add_generation_prompt=False)
    opened = count()
    assert continued < closed < opened


def test_version(server: Server) -> None:
    response = httpx.get(f"{server.url}/version")
    assert response.status_code == 200 and response.json()["version"]


def test_beam_search_chat_and_completions(server: Server, client: openai.OpenAI) -> None:
    """vLLM's use_beam_search: n beams, the n best sequences as choices, best first, with
    every step after the first served from the prefix cache."""
    salt = uuid.uuid4().hex
    question = [{"role": "user", "content": "Reply with one word: what color is the sky?"}]
    before = server.metrics()
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=question, n=3, max_tokens=24,
        extra_body={"use_beam_search": True, "cache_salt": salt})
    after = server.metrics()
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.finish_reason for c in answer.choices] == ["stop"] * 3
    assert answer.choices[0].message.content == "The sky is blue."
    assert len({c.message.content for c in answer.choices}) == 3
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    assert answer.usage.prompt_tokens_details.cached_tokens == 0  # a fresh salt
    # EOS counts as a completion token, as in any answer.
    assert answer.usage.completion_tokens == sum(
        httpx.post(f"{server.url}/tokenize", json={
            "prompt": c.message.content, "add_special_tokens": False}).json()["count"] + 1
        for c in answer.choices)
    # Every beam step after the prompt's found its sequence in the cache up to the last
    # full block: it computed at most a block's worth of tokens per beam.
    queries = after["pagellm_prefix_cache_queries_total"] - before[
        "pagellm_prefix_cache_queries_total"]
    hits = after["pagellm_prefix_cache_hits_total"] - before["pagellm_prefix_cache_hits_total"]
    assert 0 < queries - hits <= answer.usage.prompt_tokens + 24 * 3 * 16  # max_tokens 24
    assert hits > queries / 2
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=question, n=3, max_tokens=24,
        extra_body={"use_beam_search": True, "cache_salt": salt, "length_penalty": 1.0})
    assert [c.message.content for c in again.choices] == [
        c.message.content for c in answer.choices]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.logprobs is None for c in answer.choices)  # not asked for
    # Streamed, each choice comes whole when the search ends.
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(
            model=MODEL_NAME, messages=question, n=3, max_tokens=24, stream=True,
            extra_body={"use_beam_search": True, "cache_salt": salt}):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (
                choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in answer.choices]

    completion = client.completions.create(
        model=MODEL_NAME, prompt=["The capital of France is", "Water boils at"], n=2,
        max_tokens=8, echo=True, extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert completion.choices[0].text.startswith("The capital of France is")
    assert completion.choices[2].text.startswith("Water boils at")
    assert completion.usage is not None and completion.usage.completion_tokens == 4 * 8
    assert all(c.logprobs is None for c in completion.choices)
    # Logprobs when asked: each beam's own tokens, with as many alternatives as asked.
    scored = client.chat.completions.create(
        model=MODEL_NAME, messages=question, n=3, max_tokens=24, logprobs=True,
        top_logprobs=2, extra_body={"use_beam_search": True, "cache_salt": salt})
    assert [c.message.content for c in scored.choices] == [
        c.message.content for c in answer.choices]
    for choice in scored.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        tokens = choice.logprobs.content
        assert "".join(t.token for t in tokens[:-1]) == choice.message.content  # EOS last
        assert all(len(t.top_logprobs) == 2 for t in tokens)
    plain = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", n=2, max_tokens=8, logprobs=3,
        extra_body={"use_beam_search": True})
    for choice in plain.choices:
        assert choice.logprobs is not None and choice.logprobs.text_offset is not None
        assert "".join(choice.logprobs.tokens or []) == choice.text
        assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)
    server.wait_idle()
