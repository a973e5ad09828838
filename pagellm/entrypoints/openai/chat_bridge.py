"""What the APIs answered through the chat path share (OpenAI's Responses API and
Anthropic's Messages API): a conversation whose messages remember what the client called
them, chat errors put back in the client's terms, and an answer read into text and calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagellm.engine.chat_template import json_object
from pagellm.entrypoints.openai.errors import APIError, bad_request, validated
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, ToolCall
from pagellm.entrypoints.openai.tool_calls import ToolCallReader


def as_chat_request(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request of fields translated from another API's request; a value chat
    cannot take (one the other API's schema left open) is a 400 naming chat's field,
    which the caller puts back in its client's terms."""
    return validated(ChatCompletionRequest, fields)


@dataclass(frozen=True)
class Conversation:
    """Chat messages and, for each, what the client called it (`input[3]`,
    `messages[2].content[0]`, `system`), so that an error the chat path finds in a
    message names the client's field, not the message's place in the chat list."""

    messages: list[dict[str, Any]]
    origins: list[str]

    def turn_starts(self) -> list[int]:
        """Where each turn after the first begins (its user message): the places a
        conversation can be cut, dropping whole turns, oldest first."""
        return [index for index, message in enumerate(self.messages)
                if index > 0 and message["role"] == "user"]

    def tail(self, start: int) -> Conversation:
        return Conversation(self.messages[start:], self.origins[start:])


def required_string(item: dict[str, Any], key: str, where: str) -> str:
    """A field of a client's item that must be a string; a 400 naming it otherwise."""
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def split_answer(reader: ToolCallReader | None, answer: str
                 ) -> tuple[str | None, list[ToolCall] | None]:
    """(text, calls) of a finished answer (after its reasoning, see answer_parts). A
    call cut short (by max_tokens or a stop string, so that its arguments are not a
    whole JSON object) is not a call the client could run or send back: the answer is
    then all text. Calls that were whole when max_tokens ended the answer stay calls,
    as chat reads them."""
    if reader is None:
        return answer, None
    text, calls = reader.split(answer)
    if calls and any(json_object(call.function.arguments) is None for call in calls):
        return answer, None
    return text, calls


def streamed_text(reader: ToolCallReader | None, answer: str) -> str:
    """The text of a running answer that a stream may send: all of it without a reader,
    else what comes before a possible call (a call's markup is never shown). Once the
    answer is finished, its text is what split_answer reads."""
    return answer if reader is None else reader.streamed_content(answer)


def json_schema_format(schema: dict[str, Any], name: str, strict: Any = None
                       ) -> dict[str, Any]:
    """A JSON schema the answer follows, as chat's response_format (which nests under
    `json_schema` what the Responses and Messages APIs give flat)."""
    spec: dict[str, Any] = {"name": name, "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


_MESSAGE_INDEX = re.compile(r"\bmessages\[(\d+)\]")
# "messages" as the subject of an error about the whole conversation ("messages is not
# valid Unicode text", "messages cannot be rendered by the chat template").
_MESSAGES_SUBJECT = re.compile(r"^messages\b(?!\[)")


def renamed_error(error: APIError, origins: list[str], messages_param: str,
                  renames: tuple[tuple[re.Pattern[str], str], ...]) -> APIError:
    """A chat error in the terms of the API whose request became the chat request:
    `messages[i]` becomes `origins[i]` (an index past them, in text the client wrote,
    stays), the `messages` param `messages_param` (in the message too, where it is the
    subject), and each of `renames` rewrites a chat field to the client's."""

    def origin(match: re.Match[str]) -> str:
        index = int(match.group(1))
        return origins[index] if index < len(origins) else match.group(0)

    def rename(text: str) -> str:
        for pattern, replacement in renames:
            text = pattern.sub(replacement, text)
        return _MESSAGE_INDEX.sub(origin, text)

    param, message = error.param, rename(error.message)
    if param == "messages":
        param = messages_param
        message = _MESSAGES_SUBJECT.sub(messages_param, message)
    elif param is not None:
        param = rename(param)
    return APIError(error.status, message, param=param, code=error.code, type=error.type)
