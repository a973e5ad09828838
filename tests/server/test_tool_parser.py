"""tool_choice "auto" with `--enable-auto-tool-choice --tool-call-parser NAME`: calls
read out of the model's own syntax (hermes' `<tool_call>` blocks, Llama 3's JSON), the
same streamed or not. The default
model does not write such blocks by itself, so its answers are fixed with a one-choice
format (structured output), which the parser then reads like any answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.api_server import ServerSettings, create_app
from tests.server.conftest import MODEL_NAME

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
CALLING = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
           '{"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine(lambda: LLMEngine(EngineConfig(kv_cache_memory_bytes=32 << 20,
                                                           max_model_len=512)))
    yield engine
    engine.shutdown()
    assert engine.engine.get_stats().kv_cache_usage == 0


def ask(engine: AsyncLLMEngine, parser: str | None, answer: str, stream: bool,
        tools: tuple[dict[str, Any], ...] = (WEATHER,), **extra: Any,
        ) -> tuple[str | None, list[tuple[str, dict[str, Any]]], str | None]:
    """(content, [(function, arguments)], finish_reason) of one chat answer fixed to
    `answer`, through the openai client against the app in this process."""
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME], tool_call_parser=parser))

    async def run() -> tuple[str | None, list[tuple[str, dict[str, Any]]], str | None]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                        http_client=http, max_retries=0)
            kwargs: dict[str, Any] = dict(
                model=MODEL_NAME, max_tokens=60, temperature=0, tools=list(tools),
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                extra_body={"structured_outputs": {"choice": [answer]}}, **extra)
            if not stream:
                result = await client.chat.completions.create(**kwargs)
                message = result.choices[0].message
                return (message.content,
                        [(c.function.name, json.loads(c.function.arguments))
                         for c in message.tool_calls or []], result.choices[0].finish_reason)
            content, reason = "", None
            calls: dict[int, list[str]] = {}
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for piece in choice.delta.tool_calls or []:
                        assert piece.id and piece.function and piece.function.name
                        calls[piece.index] = [piece.function.name,
                                              piece.function.arguments or ""]
                    reason = choice.finish_reason or reason
            return (content or None,
                    [(name, json.loads(arguments)) for name, arguments in calls.values()],
                    reason)

    return asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser, answer, content", [
    ("hermes", CALLING, "Let me check.\n"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
])
def test_auto_tool_calls_are_parsed_from_the_models_syntax(
        engine: AsyncLLMEngine, stream: bool, parser: str, answer: str,
        content: str | None) -> None:
    assert ask(engine, parser, answer, stream) == (
        content, [("get_weather", {"city": "Paris"})], "tool_calls")
    plain = ask(engine, parser, "No tool is needed here.", stream)
    assert plain == ("No tool is needed here.", [], "stop")


def test_auto_without_a_parser_is_refused(engine: AsyncLLMEngine) -> None:
    with pytest.raises(openai.BadRequestError, match="--tool-call-parser hermes"):
        ask(engine, None, CALLING, False)


@pytest.mark.parametrize("parser", [None, "hermes"])
def test_auto_over_no_tools_is_a_plain_answer(engine: AsyncLLMEngine,
                                              parser: str | None) -> None:
    """LangChain's bind_tools([]) sends `tools: []` with tool_choice "auto": nothing can
    be called, so the answer is plain text, as the Responses and Messages APIs give it;
    "required" over no tools is still a 400."""
    assert ask(engine, parser, CALLING, False, tools=(), tool_choice="auto") == (
        CALLING, [], "stop")
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        ask(engine, parser, CALLING, False, tools=(), tool_choice="required")


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_reads_calls_with_the_same_parser(engine: AsyncLLMEngine,
                                                           stream: bool) -> None:
    """Through /v1/responses: the text before the call is the message (a stream never
    shows the call's markup), then a function_call item; deltas add up to the text."""
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                            tool_call_parser="hermes"))
    tool = {"type": "function", "name": "get_weather",
            "parameters": WEATHER["function"]["parameters"]}  # type: ignore[index]

    async def run() -> tuple[list[Any], str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                        http_client=http, max_retries=0)
            kwargs: dict[str, Any] = dict(
                model=MODEL_NAME, input="Weather in Paris?", tools=[tool],
                max_output_tokens=60, temperature=0,
                extra_body={"structured_outputs": {"choice": [CALLING]}})
            if not stream:
                response = await client.responses.create(**kwargs)
                return response.output, response.output_text
            deltas = ""
            async with client.responses.stream(**kwargs) as events:
                async for event in events:
                    if event.type == "response.output_text.delta":
                        deltas += event.delta
                final = await events.get_final_response()
            return final.output, deltas

    output, text = asyncio.run(run())
    assert text == "Let me check.\n"
    assert [item.type for item in output] == ["message", "function_call"]
    assert output[0].content[0].text == "Let me check.\n"
    assert (output[1].name, json.loads(output[1].arguments)) == ("get_weather",
                                                               {"city": "Paris"})


@pytest.mark.parametrize("stream", [False, True])
def test_the_messages_api_reads_calls_with_the_same_parser(engine: AsyncLLMEngine,
                                                          stream: bool) -> None:
    """Through /v1/messages: a text block (a stream never shows the call's markup), then a
    tool_use block; with disable_parallel_tool_use, only the first of two calls."""
    import anthropic
    import httpx2  # the anthropic SDK's HTTP client, which takes only its own objects

    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                            tool_call_parser="hermes"))
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    tool = {"name": "get_weather", "input_schema": schema}
    twice = CALLING + CALLING.removeprefix("Let me check.")

    async def run(answer: str, choice: dict[str, Any]) -> tuple[list[Any], str, str | None]:
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://test") as http:
            client = anthropic.AsyncAnthropic(base_url="http://test", api_key="x",
                                              http_client=http, max_retries=0)
            kwargs: dict[str, Any] = dict(
                model=MODEL_NAME, max_tokens=90, tools=[tool], tool_choice=choice,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                extra_body={"temperature": 0,
                            "structured_outputs": {"choice": [answer]}})
            if not stream:
                message = await client.messages.create(**kwargs)
                return message.content, "", message.stop_reason
            text = ""
            async with client.messages.stream(**kwargs) as events:
                async for event in events:
                    if event.type == "text":
                        text += event.text
                final = await events.get_final_message()
            return final.content, text, final.stop_reason

    content, text, reason = asyncio.run(run(CALLING, {"type": "auto"}))
    assert [block.type for block in content] == ["text", "tool_use"]
    assert content[0].text == "Let me check.\n" and reason == "tool_use"
    assert (content[1].name, content[1].input) == ("get_weather", {"city": "Paris"})
    assert text == ("Let me check.\n" if stream else "")
    single, _, _ = asyncio.run(run(twice, {"type": "auto", "disable_parallel_tool_use": True}))
    both, _, _ = asyncio.run(run(twice, {"type": "auto"}))
    assert [block.type for block in single] == ["text", "tool_use"]
    assert [block.type for block in both] == ["text", "tool_use", "tool_use"]


def test_chat_reads_reasoning_with_the_reasoning_parser(engine: AsyncLLMEngine,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """--reasoning-parser: what comes before the end tag is `reasoning` (and
    `reasoning_content`), the rest `content`, the same streamed or not, and the two add
    up to the answer. The default model does not think, so the end tag is taken from its
    own greedy answer, as if it had written `</think>` there."""
    from pagellm.entrypoints.openai import reasoning

    def ask_chat(parser: str | None, stream: bool, include: bool = True) -> tuple[str, str]:
        app = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                                reasoning_parser=parser))

        async def run() -> tuple[str, str]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as client:
                body = {"messages": [{"role": "user", "content": "What is 2+2?"}],
                        "max_tokens": 16, "temperature": 0, "stream": stream,
                        "include_reasoning": include, "logprobs": True,
                        "return_token_ids": True}
                reply = await client.post("/v1/chat/completions", json=body)
            if not stream:
                choice = reply.json()["choices"][0]
                message = choice["message"]
                assert message.get("reasoning") == message.get("reasoning_content")
                # Hidden reasoning is not spelled out by token ids or logprobs (vLLM's).
                assert ("token_ids" in choice) == (choice["logprobs"] is not None) == \
                    (include or parser is None)
                return message.get("reasoning") or "", message["content"] or ""
            thought, said = "", ""
            for line in reply.text.splitlines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        assert include or parser is None or (
                            "token_ids" not in choice and choice.get("logprobs") is None)
                        delta = choice["delta"]
                        assert delta.get("reasoning") == delta.get("reasoning_content")
                        thought += delta.get("reasoning") or ""
                        said += delta.get("content") or ""
            return thought, said

        return asyncio.run(run())

    plain = ask_chat(None, False)
    assert plain[0] == "" and len(plain[1].split()) > 4
    end_tag = " " + plain[1].split()[3]
    before, _, after = plain[1].partition(end_tag)
    monkeypatch.setattr(reasoning, "_END", end_tag)
    for stream in (False, True):
        assert ask_chat("deepseek_r1", stream) == (before, after), stream
        assert ask_chat("deepseek_r1", stream, include=False) == ("", after), stream


def test_an_answer_all_reasoning_has_no_empty_text_block(engine: AsyncLLMEngine) -> None:
    """The default model never closes its thinking, so its whole answer is reasoning: the
    Messages API answers a thinking block alone, streamed or not (an empty text block
    beside it, sent back, is refused by Anthropic's API; vLLM sends none either)."""
    import anthropic
    import httpx2

    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                            reasoning_parser="deepseek_r1"))

    async def ask() -> list[Any]:
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                      base_url="http://test", timeout=60) as http2:
            claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="x",
                                              http_client=http2, max_retries=0)
            kwargs: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=8,
                                          messages=[{"role": "user", "content": "Hi"}])
            whole = await claude.messages.create(**kwargs)
            async with claude.messages.stream(**kwargs) as stream:
                events = [event async for event in stream]
                streamed = await stream.get_final_message()
        return [whole, streamed, events]

    whole, streamed, events = asyncio.run(ask())
    for message in (whole, streamed):
        assert [block.type for block in message.content] == ["thinking"], message.content
        assert message.content[0].thinking and message.stop_reason == "max_tokens"
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == \
        ["thinking"]


def test_responses_and_messages_read_reasoning_too(engine: AsyncLLMEngine,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With --reasoning-parser, the Responses API answers with a reasoning item before
    the message, and the Messages API with a thinking block before the text, each the
    same streamed (through the SDKs' own stream readers) or not. A conversation that
    continues its last message reads no reasoning: that text is the client's. The end
    tag comes from the default model's own answer, as in the chat test above."""
    import anthropic
    import httpx2

    from pagellm.entrypoints.openai import reasoning

    question = [{"role": "user", "content": "What is 2+2?"}]
    app = create_app(engine, ServerSettings(model_names=[MODEL_NAME],
                                            reasoning_parser="deepseek_r1"))

    async def answer_plainly() -> str:
        plain = create_app(engine, ServerSettings(model_names=[MODEL_NAME]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=plain),
                                     base_url="http://test", timeout=60) as client:
            reply = await client.post("/v1/chat/completions", json={
                "messages": question, "max_tokens": 16, "temperature": 0})
        return str(reply.json()["choices"][0]["message"]["content"])

    async def ask() -> dict[str, Any]:
        found: dict[str, Any] = {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test", timeout=60) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x",
                                        http_client=http, max_retries=0)
            kwargs: dict[str, Any] = dict(model=MODEL_NAME, input=question,
                                          max_output_tokens=16, temperature=0)
            found["response"] = await client.responses.create(**kwargs)
            async with client.responses.stream(**kwargs) as stream:
                found["events"] = [event async for event in stream]
                found["streamed"] = await stream.get_final_response()
            continued = await client.chat.completions.create(
                model=MODEL_NAME, max_tokens=4, temperature=0,
                messages=[*question, {"role": "assistant", "content": "It is"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
            found["continued"] = continued.choices[0].message
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app),
                                      base_url="http://test", timeout=60) as http2:
            claude = anthropic.AsyncAnthropic(base_url="http://test", api_key="x",
                                              http_client=http2, max_retries=0)
            message_kwargs: dict[str, Any] = dict(model=MODEL_NAME, messages=question,
                                                  max_tokens=16,
                                                  extra_body={"temperature": 0})
            found["message"] = await claude.messages.create(**message_kwargs)
            async with claude.messages.stream(**message_kwargs) as message_stream:
                found["message_events"] = [event async for event in message_stream]
                found["streamed_message"] = await message_stream.get_final_message()
        return found

    plain = asyncio.run(answer_plainly())
    assert len(plain.split()) > 4
    end_tag = " " + plain.split()[3]
    before, _, after = plain.partition(end_tag)
    monkeypatch.setattr(reasoning, "_END", end_tag)
    found = asyncio.run(ask())

    counted = len(engine.tokenizer.encode(before, add_special_tokens=False))
    for response in (found["response"], found["streamed"]):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == before
        assert response.output_text == after
        assert response.usage.output_tokens_details.reasoning_tokens == counted > 0
    kinds = [event.type for event in found["events"]]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert "".join(event.delta for event in found["events"]
                   if event.type == "response.reasoning_text.delta") == before
    assert {event.output_index for event in found["events"]
            if event.type == "response.output_text.delta"} == {1}

    for message in (found["message"], found["streamed_message"]):
        assert [block.type for block in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == before and message.content[0].signature
        assert message.content[1].text == after
    deltas = [event.delta.type for event in found["message_events"]
              if event.type == "content_block_delta"]
    assert deltas.index("signature_delta") < deltas.index("text_delta")

    continued = found["continued"]
    assert getattr(continued, "reasoning", None) is None and continued.content
