"""How messages reach a chat template: an assistant's tool calls as templates expect
them (vLLM's rules), without touching the caller's messages."""

from __future__ import annotations

import copy

import pytest

from pagellm.engine.chat_template import ChatError, check_messages


def test_tool_call_arguments_reach_the_template_as_dicts() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "time", "arguments": ""}},
            {"id": "c3", "function": {"name": "now", "arguments": {"tz": "UTC"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "assistant", "content": "It is sunny.", "tool_calls": []},
    ]
    before = copy.deepcopy(history)
    rendered = check_messages(history)
    assert [call["function"]["arguments"] for call in rendered[1]["tool_calls"]] == [
        {"city": "Paris"}, {}, {"tz": "UTC"}]
    assert rendered[1]["tool_calls"][0]["id"] == "c1"
    assert "tool_calls" not in rendered[3]  # an empty list keeps templates on plain text
    assert history == before


@pytest.mark.parametrize("call, message", [
    ({"type": "retrieval", "function": {}}, r"tool_calls\[0\] must be"),
    ({"function": "weather"}, r"tool_calls\[0\] must be"),
    ({"function": {"name": "f", "arguments": "{not json"}}, "must be a JSON object"),
    ({"function": {"name": "f", "arguments": "[1]"}}, "must be a JSON object"),
])
def test_bad_tool_calls_name_the_call(call: dict[str, object], message: str) -> None:
    with pytest.raises(ChatError, match=message):
        check_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
