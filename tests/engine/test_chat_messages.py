"""How messages reach a chat template: an assistant's tool calls as templates expect
them (vLLM's rules), without touching the caller's messages."""

from __future__ import annotations

import copy

import pytest

from pagellm.engine.chat_template import ChatError, check_messages, loops_over_content


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


PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% for part in m['content'] %}"
                  "[{{ part.text }}]{% endfor %}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.mark.parametrize("template, loops", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    (PARTS_TEMPLATE, True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
     "{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m['content']) }}{% endfor %}", True),
    ("{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(c=m.content) }}{% endfor %}", True),
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
     "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}", True),
    ("{% for m in messages %}{% set content = m['content'] %}{% for p in content %}"
     "{{ p['text'] }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% set content = m['content'] | trim %}{{ content }}"
     "{% for m2 in messages %}{% endfor %}{% endfor %}", False),
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
     "{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", True),
    ("{% for p in messages[-1]['content'] %}{{ p.text }}{% endfor %}", True),
    ("{% macro show(m) %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endmacro %}"
     "{% for m in messages %}{{ show(m) }}{% endfor %}", True),
    ("{% for m in messages %}{% generation %}{% for p in m['content'] %}{{ p.text }}"
     "{% endfor %}{% endgeneration %}{% endfor %}", True),  # HF's training tag
    ("{% for d in documents %}{% for x in d.content %}{{ x }}{% endfor %}{% endfor %}"
     "{% for m in messages %}{{ m.content }}{% endfor %}", False),  # not a message's
    ("{% for m in messages %}{% for line in m['content'].split('\\n') %}{{ line }}"
     "{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{{ m['content'] }", False),  # not Jinja: rendering will say so
])
def test_auto_content_format_finds_templates_that_loop_over_content(
        template: str, loops: bool) -> None:
    """vLLM's "auto": a template that loops over a message's content gets OpenAI's list
    of parts; iterating a string would render it character by character."""
    assert loops_over_content(template) is loops


def test_content_reaches_the_template_as_a_string_or_as_parts() -> None:
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                            {"type": "input_text", "text": "there"}]},
               {"role": "assistant", "content": None}]
    assert [m["content"] for m in check_messages(history)] == ["Be brief.", "Hi\nthere", ""]
    assert [m["content"] for m in check_messages(history, "openai")] == [
        [{"type": "text", "text": "Be brief."}],
        [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}], []]
