"""A Responses request as the chat request that answers it (see serving_responses.py).

The input items become chat messages, each remembering the item it came from, so that
an error the chat path finds in a message names the client's item (`input[2]`) and not
its place in the chat list, which also holds the instructions and the stored history.
The Responses fields become chat's, and chat's field names in errors become the
Responses names again.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

from pagellm.core.sampling_params import MAX_LOGPROBS
from pagellm.engine.chat_template import TEXT_PARTS, json_object
from pagellm.entrypoints.openai.chat_bridge import (
    Conversation,
    as_chat_request,
    json_schema_format,
    renamed_error,
    required_string,
)
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagellm.entrypoints.openai.serving import refuse_set

# The include entry that asks for the output text's logprobs.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ROLES = ("user", "system", "developer", "assistant")
# Chat's text parts less Anthropic's thinking, which the Responses API has no part for.
_TEXT_PARTS = {kind: key for kind, key in TEXT_PARTS.items() if kind != "thinking"}
# OpenAI's values of text.verbosity (accepted and echoed: a template has no such knob).
_VERBOSITIES = (None, "low", "medium", "high")
# Known Responses options this server cannot honour, refused rather than ignored.
_REFUSED = {"background": "background responses are not supported; ask with stream to "
                          "read the answer as it is generated",
            "conversation": "conversation objects are not supported; continue with "
                            "previous_response_id",
            "prompt": "stored prompt templates are not supported; send the input"}
# What `include` may ask for (OpenAI's list); only the logprobs change the answer here.
_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content",
                       "file_search_call.results", "web_search_call.results",
                       "web_search_call.action.sources", "message.input_image.image_url",
                       "computer_call_output.output.image_url",
                       "code_interpreter_call.outputs"})
# Where the stored history's messages came from, for errors.
_HISTORY = "the conversation of previous_response_id"


def conversation_of(history: list[dict[str, Any]], items: str | list[Any]) -> Conversation:
    """The stored history (of previous_response_id) and the new input as one chat
    conversation; function_call items at the start of the input join the history's
    last assistant turn, as they would join one in the input."""
    new = _input_messages(items)
    messages = list(history)
    origins = [_HISTORY] * len(history)
    if new and messages and messages[-1]["role"] == "assistant" \
            and new[0][0]["role"] == "assistant" and new[0][0]["content"] is None:
        last = messages[-1]
        messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []),
                                               *new[0][0]["tool_calls"]]}
        new = new[1:]
    return Conversation(messages + [message for message, _ in new],
                        origins + [origin for _, origin in new])


# The id prefix of each input item type, as OpenAI writes them.
_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                  "reasoning": "rs"}


def resolve_references(items: str | list[Any],
                       stored_item: Callable[[str], dict[str, Any] | None]) -> str | list[Any]:
    """The input with each `item_reference` replaced by the stored item it names (an
    earlier response's input or output item), as OpenAI reads it: clients that keep the
    history themselves (the AI SDK) send earlier answers back this way. An id not in the
    store is a 400 naming the item."""
    if isinstance(items, str):
        return items
    resolved = []
    for index, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            where = f"input[{index}]"
            item_id = required_string(item, "id", where)
            found = stored_item(item_id)
            if found is None:
                raise bad_request(f"{where} refers to item {item_id!r}, which is not stored "
                                  "(a response made with store: false, deleted, or forgotten "
                                  "to keep the store within its size)", param=f"{where}.id")
            item = found
        resolved.append(item)
    return resolved


def client_item_ids(items: str | list[Any]) -> frozenset[str]:
    """The ids the client wrote on its own input items (not on its references); one that
    is not a non-empty string is a 400 naming it (null is no id: the server gives one)."""
    if isinstance(items, str):
        return frozenset()
    ids = set()
    for index, item in enumerate(items):
        if (not isinstance(item, dict) or item.get("type") == "item_reference"
                or item.get("id") is None):
            continue
        where = f"input[{index}]"
        if not required_string(item, "id", where):
            raise bad_request(f"{where}.id must not be empty", param=f"{where}.id")
        ids.add(item["id"])
    return frozenset(ids)


def input_items(items: str | list[Any]) -> list[dict[str, Any]]:
    """The input as OpenAI lists it back: items with an id each (the client's, or a new
    one) and a message's string content as one text part."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    listed = []
    for item in items:
        kind = item.get("type", "message")
        entry = {**item, "type": kind}
        if entry.get("id") is None:
            entry["id"] = f"{_ITEM_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            entry["content"] = [{"type": part, "text": item["content"]}]
        listed.append(entry)
    return listed


def check_options(body: ResponsesRequest) -> None:
    """A 400 for what this server does not do, where going on would answer 200 with
    something other than what the client asked for, and for values OpenAI refuses."""
    refuse_set(body, _REFUSED)
    if isinstance(body.input, list) and not body.input and body.previous_response_id is None:
        raise bad_request("input must not be empty", param="input")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                          f"{body.top_logprobs}", param="top_logprobs")
    for index, entry in enumerate(body.include or []):
        if entry not in _INCLUDES:
            raise bad_request(f"include[{index}] {entry!r} is not one of "
                              f"{', '.join(sorted(_INCLUDES))}", param=f"include[{index}]")
    verbosity = (body.text or {}).get("verbosity")
    if verbosity not in _VERBOSITIES:
        raise bad_request(f"text.verbosity must be one of {', '.join(_VERBOSITIES[1:])}, "
                          f"got {verbosity!r}", param="text.verbosity")


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Logprobs come with the include entry asking for them (top_logprobs only says how
    many alternatives each has), as in OpenAI's API and vLLM."""
    return LOGPROBS_INCLUDE in (body.include or [])


def _text_content(content: Any, where: str) -> str | list[dict[str, str]]:
    """Text as chat takes it: a string, or the text parts (input_text, output_text, and
    the refusal parts of OpenAI's own replayed output) as chat text parts; a missing text
    or any other part is a 400 naming it (`where` is the field, `input[2].content`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_request(f"{where} must be a string or a non-empty list of text parts",
                          param=where)
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad_request(f"{where}[{index}] is a {kind!r} part; only text parts "
                              "(input_text, output_text, refusal) are supported",
                              param=f"{where}[{index}]")
        parts.append({"type": "text", "text": required_string(part, _TEXT_PARTS[kind],
                                                              f"{where}[{index}]")})
    return parts


def _arguments(item: dict[str, Any], where: str) -> str:
    """A function call's arguments: the JSON text of an object, as its call gave them."""
    text = required_string(item, "arguments", where)
    if json_object(text) is None:
        raise bad_request(f"{where}.arguments must be the JSON text of an object, got "
                          f"{text[:80]!r}", param=f"{where}.arguments")
    return text


def _input_messages(items: str | list[Any]) -> list[tuple[dict[str, Any], str]]:
    """The input as (chat message, origin) pairs: a string is one user message; items are
    messages, the client's record of earlier function calls (merged into the assistant
    message before them, as one chat turn with tool_calls) and their outputs (tool
    messages). Reasoning items are dropped: the models served here do not reason."""
    if isinstance(items, str):
        return [({"role": "user", "content": items}, "input")]
    messages: list[tuple[dict[str, Any], str]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an item object (a message, function_call, "
                              "function_call_output or item_reference), got "
                              f"{type(item).__name__}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got "
                                  f"{role!r}", param=f"{where}.role")
            messages.append(({"role": role,
                              "content": _text_content(item.get("content"),
                                                       f"{where}.content")}, where))
        elif kind == "function_call":
            call = {"id": required_string(item, "call_id", where), "type": "function",
                    "function": {"name": required_string(item, "name", where),
                                 "arguments": _arguments(item, where)}}
            if messages and messages[-1][0]["role"] == "assistant":
                messages[-1][0].setdefault("tool_calls", []).append(call)
            else:
                messages.append(({"role": "assistant", "content": None,
                                  "tool_calls": [call]}, where))
        elif kind == "function_call_output":
            call_id = required_string(item, "call_id", where)
            messages.append(({"role": "tool", "tool_call_id": call_id,
                              "content": _text_content(item.get("output"), f"{where}.output")},
                             where))
        elif kind != "reasoning":
            raise bad_request(f"{where} has type {kind!r}, which is not supported (message, "
                              "function_call, function_call_output, item_reference)",
                              param=f"{where}.type")
    return messages


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's form (chat checks their names and
    schemas); a built-in tool (web_search, file_search, ...) is a 400: there is nothing
    here to run it."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{index}] has type {kind!r}; only function tools are "
                              "supported", param=f"tools[{index}].type")
        converted.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict")
            if key in tool}})
    return converted


def _chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None
                      ) -> str | dict[str, Any] | None:
    """Chat's form of the choice. "auto" and "none" without tools mean no tools (vLLM's
    default is "auto" with none), where chat would refuse a choice without tools."""
    if choice in ("none", "auto") and not tools:
        return None
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": '
                      '"function", "name": ...}', param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format, which nests under `json_schema` what
    Responses gives flat; chat checks the rest (an unknown type is its 400)."""
    spec = (text or {}).get("format")
    if not isinstance(spec, dict) or spec.get("type") != "json_schema":
        return spec
    if not isinstance(spec.get("schema"), dict):
        raise bad_request("text.format of type 'json_schema' needs schema, the JSON "
                          "schema of the answer (an object)", param="text.format")
    return json_schema_format(spec["schema"], spec.get("name", "output"), spec.get("strict"))


# Fields with the same name and meaning in both requests.
_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
                  "min_tokens", "ignore_eos", "logit_bias", "skip_special_tokens",
                  "include_stop_str_in_output", "cache_salt", "priority",
                  "parallel_tool_calls", "structured_outputs")


def chat_request(body: ResponsesRequest, conversation: Conversation) -> ChatCompletionRequest:
    """The chat request answering `body` over `conversation`, with the instructions as
    its system message."""
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SHARED_FIELDS}
    instructions = ([{"role": "system", "content": body.instructions}]
                    if body.instructions else [])
    logprobs = wants_logprobs(body)
    fields.update(
        messages=instructions + conversation.messages,
        max_completion_tokens=body.max_output_tokens,
        logprobs=logprobs, top_logprobs=body.top_logprobs if logprobs else None,
        tools=_chat_tools(body.tools) or None,
        tool_choice=_chat_tool_choice(body.tool_choice, body.tools),
        response_format=_response_format(body.text),
        reasoning_effort=(body.reasoning or {}).get("effort"))
    return as_chat_request(fields)


# Chat's field names in errors, and the Responses fields they stand for.
_RENAMES = ((re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
            (re.compile(r"\bresponse_format\b"), "text.format"),
            (re.compile(r"\breasoning_effort\b"), "reasoning.effort"))


def renamed(error: APIError, body: ResponsesRequest, conversation: Conversation) -> APIError:
    """A chat error in the Responses request's terms: its fields, and the input item a
    message came from (the chat list starts with the instructions, if any)."""
    origins = (["instructions"] if body.instructions else []) + conversation.origins
    return renamed_error(error, origins, "input", _RENAMES)
