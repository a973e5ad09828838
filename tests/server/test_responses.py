"""The Responses API (`client.responses`) against the real server: a response is the chat
completion of the same conversation, streamed as OpenAI's typed events, continued from
the store by `previous_response_id` (and then served from the prefix cache)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME, Server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "name": "get_weather", "description": "The weather",
                     "parameters": WEATHER}]
INSTRUCTIONS = ("You are PageLLM's test assistant. You answer in one short sentence and "
                "you always stay polite and precise. ") * 2


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int,
              **kwargs: Any) -> str:
    result = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                            max_tokens=max_tokens, temperature=0, **kwargs)
    return result.choices[0].message.content or ""


def test_a_response_is_the_chat_completion_of_its_conversation(client: openai.OpenAI
                                                                ) -> None:
    response = client.responses.create(model=MODEL_NAME, input="What is 2+2?",
                                       instructions=INSTRUCTIONS, max_output_tokens=12,
                                       temperature=0)
    expected = chat_text(client, [{"role": "system", "content": INSTRUCTIONS},
                                  {"role": "user", "content": "What is 2+2?"}], 12)
    assert response.output_text == expected
    assert response.id.startswith("resp_") and response.object == "response"
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert response.status in ("completed", "incomplete")
    usage = response.usage
    assert usage is not None and usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 12


def test_previous_response_id_continues_from_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="Name a color.",
                                    instructions=INSTRUCTIONS, max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=MODEL_NAME, input="Name another one.",
                                     instructions=INSTRUCTIONS, previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    conversation = [{"role": "system", "content": INSTRUCTIONS},
                    {"role": "user", "content": "Name a color."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Name another one."}]
    assert second.output_text == chat_text(client, conversation, 8)
    assert second.previous_response_id == first.id
    assert second.usage is not None and first.usage is not None
    # The first turn (instructions, question, answer) is served from the prefix cache.
    assert second.usage.input_tokens_details.cached_tokens >= 48
    assert second.usage.input_tokens > first.usage.input_tokens


def test_instructions_do_not_carry_over(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL_NAME, input="Say yes.",
                                    instructions=INSTRUCTIONS, max_output_tokens=4,
                                    temperature=0)
    second = client.responses.create(model=MODEL_NAME, input="Say no.",
                                     previous_response_id=first.id, max_output_tokens=4,
                                     temperature=0)
    conversation = [{"role": "user", "content": "Say yes."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "Say no."}]
    assert second.output_text == chat_text(client, conversation, 4)


def test_input_items_become_the_conversation(client: openai.OpenAI) -> None:
    """Messages with text parts, a developer message, and a function call with its output
    render as the chat conversation with tool_calls and a tool message."""
    items: list[Any] = [
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny, 20 C."},
    ]
    response = client.responses.create(model=MODEL_NAME, input=items, tools=TOOLS,
                                       tool_choice="none", max_output_tokens=10,
                                       temperature=0)
    conversation = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 20 C."}]
    chat_tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather", "parameters": WEATHER}}]
    assert response.output_text == chat_text(client, conversation, 10, tools=chat_tools,
                                             tool_choice="none")


def test_stream_events_say_what_the_whole_response_says(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL_NAME, input="Tell me about the sea.",
                                  max_output_tokens=10, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text == final.output_text
    item_ids = {event.item_id for event in events if hasattr(event, "item_id")}
    assert item_ids == {final.output[0].id}
    # Cut by max_output_tokens: incomplete, and said so in the response and its message.
    assert final.status == whole.status == "incomplete"
    assert final.incomplete_details is not None
    assert final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]


def test_the_raw_stream_is_typed_events_without_done(server: Server) -> None:
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=60,
                      json={"input": "Hi", "max_output_tokens": 2, "stream": True}) as reply:
        text = "".join(reply.iter_text())
    blocks = [block for block in text.split("\n\n") if block]
    assert "[DONE]" not in text
    for block in blocks:
        event_line, data_line = block.split("\n")
        kind = event_line.removeprefix("event: ")
        assert json.loads(data_line.removeprefix("data: "))["type"] == kind
    delta = json.loads(next(b for b in blocks if "output_text.delta" in b).split("data: ")[1])
    assert delta["logprobs"] == [] and "response" not in delta


def test_store_retrieve_delete_and_store_false(client: openai.OpenAI) -> None:
    kept = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=3)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    unkept = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=3,
                                     store=False)
    assert unkept.store is False
    for missing in (unkept.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)
        with pytest.raises(openai.NotFoundError) as error:
            client.responses.create(model=MODEL_NAME, input="Again", max_output_tokens=2,
                                    previous_response_id=missing)
        assert error.value.body["param"] == "previous_response_id"  # type: ignore[index]
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int

    response = client.responses.parse(model=MODEL_NAME, input="Invent a person.",
                                      text_format=Person, max_output_tokens=60, temperature=0)
    assert isinstance(response.output_parsed, Person)
    json_object = client.responses.create(model=MODEL_NAME, input="A JSON object, please.",
                                          text={"format": {"type": "json_object"}},
                                          max_output_tokens=40, temperature=0)
    if json_object.status == "completed":
        assert isinstance(json.loads(json_object.output_text), dict)


def test_forced_calls_come_back_as_function_call_items(client: openai.OpenAI) -> None:
    required = client.responses.create(model=MODEL_NAME, input="Weather in Paris?",
                                       tools=TOOLS, tool_choice="required",
                                       max_output_tokens=60, temperature=0)
    calls = [item for item in required.output if item.type == "function_call"]
    assert calls and required.output == calls
    assert calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    assert calls[0].id.startswith("fc_") and calls[0].call_id
    # The client answers the call; the stored conversation carries it, as chat history.
    answered = client.responses.create(
        model=MODEL_NAME, previous_response_id=required.id, tools=TOOLS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 20 C."}],
        max_output_tokens=8, temperature=0)
    conversation = [{"role": "user", "content": "Weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": calls[0].call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": calls[0].arguments}}]},
                    {"role": "tool", "tool_call_id": calls[0].call_id, "content": "Sunny, 20 C."}]
    chat_tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather", "parameters": WEATHER}}]
    assert answered.output_text == chat_text(client, conversation, 8, tools=chat_tools,
                                             tool_choice="none")
    with client.responses.stream(model=MODEL_NAME, input="Weather in Rome?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60, temperature=0) as stream:
        kinds = [event.type for event in stream]
        named = stream.get_final_response()
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"]
    assert [item.type for item in named.output] == ["function_call"]
    assert "city" in json.loads(named.output[0].arguments)  # type: ignore[union-attr]


def test_logprobs_when_included(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_NAME, input="Hi there", max_output_tokens=5,
                                       temperature=0, top_logprobs=2,
                                       include=["message.output_text.logprobs"])
    part = response.output[0].content[0]  # type: ignore[union-attr]
    assert part.logprobs is not None and len(part.logprobs) == response.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    plain = client.responses.create(model=MODEL_NAME, input="Hi there", max_output_tokens=5,
                                    temperature=0)
    assert plain.output[0].content[0].logprobs is None  # type: ignore[union-attr]
    assert plain.output_text == response.output_text


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": [{"type": "input_image"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400,
     "input[0].call_id"),
    ({"input": []}, 400, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"type": "string"}}], "tool_choice": "required"},
     400, "tools[0].parameters"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ({"input": "x", "max_output_tokens": 100000}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, 400,
     "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "object", "minProperties": "x"}}}},
     400, "text.format"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "temperature": -1}, 400, "temperature"),
    ({"input": "x", "top_logprobs": 50}, 400, "top_logprobs"),
    ({"input": "x", "model": "gpt-5"}, 404, "model"),
    ({"input": "x" * 5000}, 400, "input"),
])
def test_bad_requests_name_the_responses_field(server: Server, body: dict[str, Any],
                                               status: int, param: str) -> None:
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
    assert "messages" not in reply.json()["error"]["message"]


def test_truncation_auto_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    long_input = "The sea is blue. " * 400
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_NAME, input=long_input, max_output_tokens=4)
    cut = client.responses.create(model=MODEL_NAME, input=long_input, max_output_tokens=4,
                                  truncation="auto")
    assert cut.usage is not None and cut.usage.input_tokens == 512 - 4


def test_nothing_is_left_in_the_engine(server: Server, client: openai.OpenAI) -> None:
    """A stream closed early, and every response above: no request runs, no block held."""
    with client.responses.stream(model=MODEL_NAME, input="Tell a long story.",
                                 max_output_tokens=200) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    server.wait_idle()
