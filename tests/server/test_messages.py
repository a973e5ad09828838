"""Anthropic's Messages API (`anthropic` client) against the real server: a message is
the chat completion of the same conversation, with Anthropic's blocks, stop reasons,
usage (the prefix cache as cache_read_input_tokens), stream events and errors."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from tests.server.conftest import MODEL_NAME, Server

SYSTEM = ("You are PageLLM's test assistant. You answer in one short sentence and you "
          "always stay polite and precise. ") * 2
TOOLS: list[Any] = [{"name": "get_weather", "description": "The weather in a city",
                     "input_schema": {"type": "object",
                                      "properties": {"city": {"type": "string",
                                                              "maxLength": 20}},
                                      "required": ["city"], "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": TOOLS[0]["input_schema"]}}]
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0,
                               timeout=120)


def chat(server: Server, messages: list[dict[str, Any]], max_tokens: int,
         **extra: Any) -> dict[str, Any]:
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra})
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_a_message_is_the_chat_completion_of_its_conversation(
        server: Server, claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL_NAME, max_tokens=12, system=SYSTEM,
                                     messages=[{"role": "user", "content": "What is 2+2?"}],
                                     **GREEDY)
    expected = chat(server, [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "What is 2+2?"}], 12)
    assert message.content[0].type == "text"
    assert message.content[0].text == expected["choices"][0]["message"]["content"]
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.stop_reason == ("max_tokens" if expected["choices"][0]["finish_reason"]
                                   == "length" else "end_turn")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == \
        expected["usage"]["prompt_tokens"]
    assert usage.output_tokens == expected["usage"]["completion_tokens"]
    again = claude.messages.create(model=MODEL_NAME, max_tokens=2, system=SYSTEM,
                                   messages=[{"role": "user", "content": "And 3+3?"}])
    assert (again.usage.cache_read_input_tokens or 0) >= 32  # the system prompt's blocks


def test_each_turn_reads_the_earlier_turns_from_the_cache(claude: anthropic.Anthropic) -> None:
    """A conversation sent back whole, turn after turn (as Anthropic clients do): each
    turn's prompt begins with the previous turn's prompt and answer, so all their whole
    blocks but the last are read from the prefix cache."""
    history: list[dict[str, Any]] = []
    previous = 0
    for question in ("Name a color.", "Name a fruit.", "Name a city."):
        history.append({"role": "user", "content": question})
        message = claude.messages.create(model=MODEL_NAME, max_tokens=8, system=SYSTEM,
                                         messages=history, **GREEDY)
        usage = message.usage
        assert (usage.cache_read_input_tokens or 0) >= (previous // 16 - 1) * 16
        previous = usage.input_tokens + (usage.cache_read_input_tokens or 0) \
            + usage.output_tokens
        history.append({"role": "assistant", "content": message.content})
    assert previous > 100


def test_stop_sequences_and_end_turn(claude: anthropic.Anthropic) -> None:
    counted = claude.messages.create(model=MODEL_NAME, max_tokens=40, stop_sequences=["3"],
                                     messages=[{"role": "user",
                                                "content": "Count from 1 to 5: 1, 2,"}],
                                     **GREEDY)
    assert (counted.stop_reason, counted.stop_sequence) == ("stop_sequence", "3")
    assert "3" not in counted.content[0].text  # type: ignore[union-attr]
    short = claude.messages.create(model=MODEL_NAME, max_tokens=200,
                                   messages=[{"role": "user", "content": "Say hi."}], **GREEDY)
    assert short.stop_reason == "end_turn" and short.stop_sequence is None


def test_stream_events_say_what_the_whole_message_says(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, max_tokens=10, system=SYSTEM,
                                  messages=[{"role": "user", "content": "Tell me about the sea."}],
                                  **GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events.count("content_block_delta") > 1
    assert final.content[0].text == whole.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == whole.usage.output_tokens == 10
    # The same prompt, more of it cached the second time.
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == \
        whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert (final.usage.cache_read_input_tokens or 0) > (whole.usage.cache_read_input_tokens
                                                         or 0)


def test_the_raw_stream_is_typed_events(server: Server) -> None:
    with httpx.stream("POST", f"{server.url}/v1/messages", timeout=60, json={
            "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as reply:
        text = "".join(reply.iter_text())
    blocks = [block for block in text.split("\n\n") if block]
    kinds = [block.split("\n")[0].removeprefix("event: ") for block in blocks]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-1] == "message_stop"
    for block, kind in zip(blocks, kinds, strict=True):
        assert json.loads(block.split("data: ", 1)[1])["type"] == kind
    delta = json.loads(blocks[kinds.index("message_delta")].split("data: ", 1)[1])
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2


def test_tool_use_and_tool_result_round_trip(server: Server,
                                             claude: anthropic.Anthropic) -> None:
    question = {"role": "user", "content": "Weather in Paris?"}
    called = claude.messages.create(model=MODEL_NAME, max_tokens=60, tools=TOOLS,
                                    tool_choice={"type": "any"}, messages=[question], **GREEDY)
    assert called.stop_reason == "tool_use"
    assert [block.type for block in called.content] == ["tool_use"]
    use = called.content[0]
    assert use.name == "get_weather" and set(use.input) == {"city"}  # type: ignore[union-attr]
    answered = claude.messages.create(
        model=MODEL_NAME, max_tokens=8, tools=TOOLS, tool_choice={"type": "none"}, **GREEDY,
        messages=[question, {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": use.id,  # type: ignore[union-attr]
                       "content": [{"type": "text", "text": "Sunny, 20 C."}]},
                      {"type": "text", "text": "Thanks!"}]}])
    expected = chat(server, [
        question,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function",  # type: ignore[union-attr]
             "function": {"name": "get_weather",
                          "arguments": json.dumps(use.input)}}]},  # type: ignore[union-attr]
        {"role": "tool", "tool_call_id": use.id,  # type: ignore[union-attr]
         "content": "Sunny, 20 C."},
        {"role": "user", "content": "Thanks!"}], 8, tools=CHAT_TOOLS, tool_choice="none")
    text = answered.content[0].text  # type: ignore[union-attr]
    assert text == expected["choices"][0]["message"]["content"]


def test_a_named_tool_streams_as_a_tool_use_block(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=MODEL_NAME, max_tokens=60, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Rome?"}],
                                **GREEDY) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in events and "text" not in events
    assert [block.type for block in final.content] == ["tool_use"]
    assert "city" in final.content[0].input  # type: ignore[union-attr]
    cut = claude.messages.create(model=MODEL_NAME, max_tokens=3, tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "Weather in Rome?"}])
    assert cut.stop_reason == "max_tokens" and cut.content[0].type == "text"


def test_count_tokens_is_the_prompt_a_message_would_send(
        server: Server, claude: anthropic.Anthropic) -> None:
    request: dict[str, Any] = dict(model=MODEL_NAME, system=SYSTEM, tools=TOOLS,
                                   messages=[{"role": "user", "content": "Weather?"}])
    counted = claude.messages.count_tokens(**request)
    message = claude.messages.create(max_tokens=1, tool_choice={"type": "none"}, **request)
    assert counted.input_tokens == (message.usage.input_tokens
                                    + (message.usage.cache_read_input_tokens or 0))


def test_output_config_format_is_structured_output(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    message = claude.messages.create(
        model=MODEL_NAME, max_tokens=80, messages=[{"role": "user", "content": "A name?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, **GREEDY)
    assert message.stop_reason == "end_turn"
    assert set(json.loads(message.content[0].text)) == {"name"}  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0] is a 'image' block"),
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content must not be empty"),
    ({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages[0].content[0].input must be an object"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0] has type"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"name": "f", "input_schema": {"type": "string"}}],
      "tool_choice": {"type": "any"}}, "tools[0].input_schema must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "sometimes"}}, "tool_choice must be"),
    ({"messages": [{"role": "user", "content": "x"}],
      "output_config": {"format": {"type": "xml"}}}, "output_config.format must be"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]},
     "mcp_servers is not supported"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, "maximum context length"),
    ({"messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
     "'thinking' block, which is not supported in a user message"),
    ({"messages": [{"role": "user", "content": None}]},
     "messages[0].content must be a string or a list of content blocks"),
    ({"messages": [{"role": "user", "content": "x"}],
      "system": [{"type": "image", "source": {}}]}, "system[0] is a 'image' block"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
      "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "cannot be combined with tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "max_tokens must be >= 1"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 2.5},
     "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}],
      "tool_choice": {"type": "none"}}, "tools[0].name must be a non-empty string"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": [""]},
     "stop_sequences must not contain an empty string"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}},
     "tool_choice needs tools"),
    ({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "the assistant turn at messages[1] ends the conversation with tool_use blocks"),
    ({"messages": [{"role": "user", "content": "A person"},
                   {"role": "assistant", "content": '{"name": "'}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "cannot be combined with a prefilled assistant message"),
])
def test_bad_requests_get_anthropic_errors(server: Server, body: dict[str, Any],
                                           message: str) -> None:
    reply = httpx.post(f"{server.url}/v1/messages", json={"max_tokens": 5, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"], error


def test_count_tokens_checks_tools_as_a_message_would(server: Server) -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    for tools, message in (([tool, tool], "given twice"),
                           ([{**tool, "input_schema": {"type": "array"}}], "input_schema")):
        reply = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=60, json={
            "messages": [{"role": "user", "content": "x"}], "tools": tools})
        assert reply.status_code == 400 and message in reply.json()["error"]["message"]


def test_missing_max_tokens_and_unknown_model(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                               max_tokens=anthropic.omit)  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-opus-5", max_tokens=2,
                               messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_a_final_assistant_message_is_continued(server: Server,
                                                claude: anthropic.Anthropic) -> None:
    """Anthropic's prefill: the answer continues the assistant's text, and holds only
    the new text (chat's continue_final_message)."""
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": "The capital of France is"}]
    message = claude.messages.create(model=MODEL_NAME, max_tokens=6, messages=conversation,
                                     **GREEDY)
    expected = chat(server, conversation, 6, continue_final_message=True,
                    add_generation_prompt=False)
    text = message.content[0].text  # type: ignore[union-attr]
    assert text == expected["choices"][0]["message"]["content"]
    assert not message.content[0].text.startswith("The capital")  # type: ignore[union-attr]


def test_system_blocks_join_without_the_billing_header(claude: anthropic.Anthropic) -> None:
    """As vLLM: text blocks joined as they are, and Claude Code's per-request billing
    block dropped (it would make every prompt differ from its first tokens)."""
    plain = claude.messages.count_tokens(model=MODEL_NAME, system="Be brief. Be kind.",
                                         messages=[{"role": "user", "content": "Hi"}])
    blocks = claude.messages.count_tokens(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
        system=[{"type": "text", "text": "x-anthropic-billing-header: cch=1234;"},
                {"type": "text", "text": "Be brief. ", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be kind."}])
    assert blocks.input_tokens == plain.input_tokens


def test_a_thread_is_refused_so_the_sdk_sends_the_whole_conversation(server: Server) -> None:
    """The SDK's tool runner asks for a server-held thread by default and only sends
    each turn's new messages; answering without the earlier turns would be a silent
    wrong 200. Refused with Anthropic's code, the runner resends the whole conversation."""
    reply = httpx.post(f"{server.url}/v1/messages", timeout=60, json={
        "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
        "thread": {"type": "continue", "previous_message_id": "msg_1"}})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and "thread" in error["message"]
    assert error["details"] == {"error_code": "thread_unsupported_request"}

    calls: list[str] = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "Sunny, 20 C."

    sent: list[dict[str, Any]] = []
    recording = anthropic.Anthropic(
        base_url=server.url, api_key="unused", max_retries=0, timeout=120,
        http_client=anthropic.DefaultHttpxClient(event_hooks={"request": [
            lambda request: sent.append(json.loads(request.read()))]}))
    runner = recording.beta.messages.tool_runner(
        model=MODEL_NAME, max_tokens=40, tools=[get_weather], max_iterations=2,
        tool_choice={"type": "any"}, messages=[{"role": "user", "content": "Weather in Rome?"}],
        **GREEDY)
    replies = list(runner)
    assert len(replies) == 2 and len(calls) == 2
    assert all(reply.content[-1].type == "tool_use" for reply in replies)
    assert "thread" in sent[0] and not any("thread" in body for body in sent[1:])
    assert [len(body["messages"]) for body in sent[1:]] == [1, 3]  # the whole conversation


def test_nothing_is_left_in_the_engine(server: Server, claude: anthropic.Anthropic) -> None:
    """A stream closed early is aborted (not left to run to max_tokens), and every
    message above has let go of its blocks."""
    aborted = 'pagellm_request_finished_total{finished_reason="abort"}'
    before = server.wait_idle().get(aborted, 0)
    with claude.messages.stream(model=MODEL_NAME, max_tokens=400,
                                messages=[{"role": "user", "content": "A long story."}],
                                extra_body={"ignore_eos": True}) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                break
    assert server.wait_idle()[aborted] == before + 1
