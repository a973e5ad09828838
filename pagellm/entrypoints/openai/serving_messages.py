"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM
serves it, for clients written against Anthropic's SDK.

As with the Responses API, a message is a chat completion underneath: the system
prompt and content blocks become a chat conversation (tool_use blocks an assistant's
tool_calls, tool_result blocks tool messages), the one chat path renders, queues and
reads tool calls, and the answer comes back as content blocks (text, then one tool_use
block per call) with Anthropic's stop reasons, usage and stream events. Anthropic's
`cache_control` marks are accepted and change nothing: every prefix is cached here
without being asked, and `usage.cache_read_input_tokens` says how much was read.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.entrypoints.openai.errors import APIError, bad_request, failure
from pagellm.entrypoints.openai.messages_protocol import (
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    StopReason,
    StreamEvent,
)
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.serving import (
    ServerContext,
    aborting_on_exit,
    final_outputs,
    is_set,
    merged,
    usage,
)
from pagellm.entrypoints.openai.serving_chat import (
    ChatRun,
    renamed_error,
    render_messages,
    start_chat,
)
from pagellm.entrypoints.openai.tool_calls import ToolCallReader
from pagellm.entrypoints.openai.transport import EventStreamResponse, sse, unless_disconnected

# Chat's field names in errors, and the Messages fields they stand for.
_RENAMES = ((re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
            (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
            (re.compile(r"\bresponse_format\b"), "output_config.format"))
# Sampling fields with the same name and meaning in chat.
_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                  "cache_salt", "priority", "structured_outputs")
_REFUSED = {"mcp_servers": "MCP servers are not supported",
            "container": "code execution containers are not supported"}


@dataclass(frozen=True)
class _Conversation:
    """The chat messages, and what each came from (`system`, `messages[2]`)."""

    messages: list[dict[str, Any]]
    origins: list[str]


async def create_message(context: ServerContext, body: MessagesRequest, raw: Request
                         ) -> Response:
    arrival = time.monotonic()
    context.check_model(body.model)
    for option, reason in _REFUSED.items():
        if is_set(getattr(body, option)):
            raise bad_request(f"{option} is not supported: {reason}", param=option)
    conversation = _conversation(body.system, body.messages)
    message_id = f"msg_{uuid.uuid4().hex}"
    try:
        run = await start_chat(context, _chat_request(body, conversation), arrival,
                               message_id)
    except APIError as error:
        raise renamed_error(error, conversation.origins, "messages", _RENAMES) from error
    if body.stream:
        return EventStreamResponse(aborting_on_exit(
            run.streams, _events(context, run, message_id)))
    outputs = await unless_disconnected(raw, final_outputs(run.streams, context.metrics))
    return JSONResponse(_answer(context.model_name, message_id, run.reader, outputs[0])
                        .model_dump(mode="json"))


async def count_tokens(context: ServerContext, body: CountTokensRequest) -> CountTokensResponse:
    """The prompt tokens the same request to /v1/messages would have (its rendered
    conversation, tools included)."""
    context.check_model(body.model)
    conversation = _conversation(body.system, body.messages)
    chat = ChatCompletionRequest.model_validate({
        "messages": conversation.messages, "tools": _chat_tools(body.tools)})
    try:
        tokens = await context.off_loop(render_messages, context.engine.tokenizer, chat)
    except APIError as error:
        raise renamed_error(error, conversation.origins, "messages", _RENAMES) from error
    return CountTokensResponse(input_tokens=len(tokens))


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _blocks(content: str | list[Any], where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks, each a dict with a type (a string is one text
    block); an empty list is a 400, as in Anthropic's API."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not content:
        raise bad_request(f"{where} must not be empty", param=where)
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{index}] must be a content block with a type",
                              param=f"{where}[{index}]")
    return content


def _tool_result_text(block: dict[str, Any], where: str) -> str | list[dict[str, str]]:
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text blocks",
                          param=f"{where}.content")
    parts = []
    for index, part in enumerate(_blocks(content, f"{where}.content")):
        if part["type"] != "text":
            raise bad_request(f"{where}.content[{index}] is a {part['type']!r} block; only "
                              "text blocks are supported", param=f"{where}.content[{index}]")
        parts.append({"type": "text", "text": _text(part, f"{where}.content[{index}]")})
    return parts


def _conversation(system: str | list[Any] | None, messages: list[Any]) -> _Conversation:
    """The chat messages of a Messages request: the system prompt first; a user
    message's tool_result blocks as tool messages before its text (as vLLM orders them);
    an assistant's text as its content and its tool_use blocks as its tool_calls.
    Thinking blocks are dropped (the models served here do not think); images and
    documents are a 400 naming the block."""
    chat: list[dict[str, Any]] = []
    origins: list[str] = []
    if system:
        parts = [{"type": "text", "text": _text(block, f"system[{index}]")}
                 for index, block in enumerate(_blocks(system, "system"))]
        chat.append({"role": "system", "content": parts})
        origins.append("system")
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        texts: list[dict[str, str]] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(_blocks(message.content, f"{where}.content")):
            at = f"{where}.content[{index}]"
            kind = block["type"]
            if kind == "text":
                texts.append({"type": "text", "text": _text(block, at)})
            elif kind == "tool_use" and message.role == "assistant":
                arguments = block.get("input")
                if not isinstance(block.get("id"), str) or not isinstance(
                        block.get("name"), str) or not isinstance(arguments, dict):
                    raise bad_request(f"{at} must be a tool_use block with a string id and "
                                      "name and an object input", param=at)
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(arguments,
                                                                   ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{at}.tool_use_id must be a string",
                                      param=f"{at}.tool_use_id")
                chat.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                             "content": _tool_result_text(block, at)})
                origins.append(at)
            elif kind not in ("thinking", "redacted_thinking"):
                raise bad_request(f"{at} is a {kind!r} block, which is not supported in a "
                                  f"{message.role} message", param=at)
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": texts or None}
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
            origins.append(where)
    return _Conversation(chat, origins)


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's client tools (name, description, input_schema) in chat's form; its
    server tools (web search, code execution, ...) are a 400."""
    if not tools:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise bad_request(f"tools[{index}] has type {tool.get('type')!r}; only client "
                              "tools (name, description, input_schema) are supported",
                              param=f"tools[{index}].type")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{index}].input_schema must be a JSON schema object",
                              param=f"tools[{index}].input_schema")
        converted.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool["input_schema"]}})
    return converted


def _chat_tool_choice(choice: dict[str, Any] | None, tools: list[Any] | None
                      ) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice: auto, any
    (chat's "required"), tool (a named function), none."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in ("auto", "none"):
        return (kind if tools else None), parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": '
                      '"tool", "name": ...}', param="tool_choice")


def _response_format(output_config: dict[str, Any] | None) -> dict[str, Any] | None:
    """`output_config.format` (a JSON schema the answer follows) as chat's
    response_format."""
    spec = (output_config or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" \
            or not isinstance(spec.get("schema"), dict):
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": '
                          '{...}}', param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


def _chat_request(body: MessagesRequest, conversation: _Conversation) -> ChatCompletionRequest:
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SHARED_FIELDS}
    choice, parallel = _chat_tool_choice(body.tool_choice, body.tools)
    fields.update(messages=conversation.messages, max_completion_tokens=body.max_tokens,
                  stop=body.stop_sequences, tools=_chat_tools(body.tools), tool_choice=choice,
                  parallel_tool_calls=parallel,
                  response_format=_response_format(body.output_config))
    return ChatCompletionRequest.model_validate(fields)


def _stop(completion: CompletionOutput, called: bool) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished completion."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _content(reader: ToolCallReader | None, completion: CompletionOutput
             ) -> list[ContentBlock]:
    """The answer's blocks: its text (when there is some, or no call), then one tool_use
    block per call. A call cut by max_tokens has no arguments to give: it stays text."""
    text, calls = (completion.text, None) if reader is None else reader.split(completion.text)
    if calls and completion.finish_reason == "length":
        text, calls = completion.text, None
    blocks = [ContentBlock(type="text", text=text or "")] if text or not calls else []
    blocks += [ContentBlock(type="tool_use", id=call.id, name=call.function.name,
                            input=json.loads(call.function.arguments))
               for call in calls or []]
    return blocks


def _usage(result: RequestOutput) -> MessagesUsage:
    counted = usage([result])
    cached = result.num_cached_tokens
    return MessagesUsage(input_tokens=counted.prompt_tokens - cached,
                         output_tokens=counted.completion_tokens,
                         cache_read_input_tokens=cached)


def _answer(model: str, message_id: str, reader: ToolCallReader | None,
            result: RequestOutput) -> MessagesResponse:
    completion = result.outputs[0]
    content = _content(reader, completion)
    stop_reason, stop_sequence = _stop(completion,
                                       any(block.type == "tool_use" for block in content))
    return MessagesResponse(id=message_id, model=model, content=content,
                            stop_reason=stop_reason, stop_sequence=stop_sequence,
                            usage=_usage(result))


async def _events(context: ServerContext, run: ChatRun, message_id: str
                  ) -> AsyncGenerator[str, None]:
    """Anthropic's event stream: message_start (once the prompt is read, so that its
    usage says how much came from the cache) and a ping; the text block's start, its
    text_delta pieces (held back where a tool call may begin) and stop; each tool_use
    block whole (start, one input_json_delta, stop); message_delta with the stop reason
    and usage; message_stop. A failure is an `error` event."""

    def event(kind: str, **fields: Any) -> str:
        return sse(StreamEvent(type=kind, **fields).model_dump(mode="json"), kind)

    reader = run.reader
    sent = 0
    started = opened = False
    try:
        async with aclosing(merged(run.streams, context.metrics)) as outputs:
            async for _, result in outputs:
                completion = result.outputs[0]
                if not started:
                    empty = MessagesResponse(id=message_id, model=context.model_name,
                                             content=[], usage=_usage(result))
                    yield event("message_start", message=empty) + event("ping")
                    started = True
                finished = completion.finish_reason is not None
                content = _content(reader, completion) if finished else []
                if finished:
                    shown = content[0].text or "" if content[0].type == "text" else ""
                else:
                    shown = completion.text if reader is None \
                        else reader.streamed_content(completion.text)
                if len(shown) > sent or (finished and content[0].type == "text"):
                    if not opened:
                        yield event("content_block_start", index=0,
                                    content_block=ContentBlock(type="text", text=""))
                        opened = True
                    if len(shown) > sent:
                        yield event("content_block_delta", index=0,
                                    delta={"type": "text_delta", "text": shown[sent:]})
                        sent = len(shown)
                if not finished:
                    continue
                if opened:
                    yield event("content_block_stop", index=0)
                for index, block in enumerate(content):
                    if block.type != "tool_use":
                        continue
                    yield (event("content_block_start", index=index,
                                 content_block=block.model_copy(update={"input": {}}))
                           + event("content_block_delta", index=index, delta={
                               "type": "input_json_delta",
                               "partial_json": json.dumps(block.input, ensure_ascii=False)})
                           + event("content_block_stop", index=index))
                stop_reason, stop_sequence = _stop(
                    completion, any(block.type == "tool_use" for block in content))
                final = _usage(result)
                yield (event("message_delta",
                             delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                             usage={"input_tokens": final.input_tokens,
                                    "output_tokens": final.output_tokens,
                                    "cache_read_input_tokens": final.cache_read_input_tokens})
                       + event("message_stop"))
    except Exception as error:  # noqa: BLE001 - reported to the client as Anthropic does
        yield event("error", error=failure(error).anthropic_body()["error"])
