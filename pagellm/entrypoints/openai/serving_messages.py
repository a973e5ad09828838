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
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.entrypoints.openai.chat_bridge import (
    Conversation,
    renamed_error,
    required_string,
    split_answer,
    visible_text,
)
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
    merged,
    refuse_set,
    usage,
)
from pagellm.entrypoints.openai.serving_chat import ChatRun, render_messages, start_chat
from pagellm.entrypoints.openai.tool_calls import ToolCallReader, tool_call_reader
from pagellm.entrypoints.openai.transport import EventStreamResponse, sse, unless_disconnected

# Chat's field names in errors, and the Messages fields they stand for.
_RENAMES = ((re.compile(r"\btools\[(\d+)\]\.function\.parameters\b"), r"tools[\1].input_schema"),
            (re.compile(r"\btools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"\bmax_completion_tokens\b"), "max_tokens"),
            (re.compile(r"\bresponse_format\b"), "output_config.format"))
# Sampling fields with the same name and meaning in chat.
_SHARED_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                  "ignore_eos", "cache_salt", "priority", "structured_outputs")
_REFUSED = {"mcp_servers": "this server connects to no MCP server",
            "container": "there is no code execution container here"}
# A system block Claude Code sends with a per-request hash in it: kept, it would make
# every prompt differ from its first tokens on, so vLLM drops it, and so do we.
_BILLING_HEADER = "x-anthropic-billing-header"


async def create_message(context: ServerContext, body: MessagesRequest, raw: Request
                         ) -> Response:
    """A message answered through the chat path; a stream of Anthropic's events when
    asked. A final assistant message is continued (Anthropic's prefill)."""
    arrival = time.monotonic()
    context.check_model(body.model)
    refuse_set(body, _REFUSED)
    if body.max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {body.max_tokens}", param="max_tokens")
    if "" in (body.stop_sequences or []):
        raise bad_request("stop_sequences must not contain an empty string",
                          param="stop_sequences")
    conversation = _conversation(body.system, body.messages)
    message_id = f"msg_{uuid.uuid4().hex}"
    try:
        run = await start_chat(context, _chat_request(body, conversation,
                                                      context.tool_call_parser),
                               arrival, message_id)
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
        "messages": conversation.messages, "tools": _chat_tools(body.tools),
        "tool_choice": "none" if body.tools else None, **_prefill(conversation)})
    try:
        tool_call_reader(chat, None)  # the tools checked as a message would check them
        tokens = await context.off_loop(render_messages, context.engine.tokenizer, chat)
    except APIError as error:
        raise renamed_error(error, conversation.origins, "messages", _RENAMES) from error
    return CountTokensResponse(input_tokens=len(tokens))


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of blocks, each a dict with a type (a string is one text
    block); no content at all is a 400, as in Anthropic's API."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks",
                          param=where)
    if not content:
        raise bad_request(f"{where} must not be empty", param=where)
    for index, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise bad_request(f"{where}[{index}] must be a content block with a type",
                              param=f"{where}[{index}]")
    return content


def _texts(blocks: list[dict[str, Any]], where: str) -> list[str]:
    """The text of text-only content (the system prompt, a tool result); empty text
    blocks are skipped, as vLLM does; another kind of block is a 400 naming it."""
    texts = []
    for index, block in enumerate(blocks):
        if block["type"] != "text":
            raise bad_request(f"{where}[{index}] is a {block['type']!r} block; only text "
                              "blocks are supported here", param=f"{where}[{index}]")
        text = required_string(block, "text", f"{where}[{index}]")
        if text:
            texts.append(text)
    return texts


def _system_message(system: Any) -> list[dict[str, Any]]:
    """The system prompt as one message, its blocks joined as vLLM joins them, less the
    billing-header block."""
    if system is None:
        return []
    texts = [text for text in _texts(_blocks(system, "system"), "system")
             if not text.startswith(_BILLING_HEADER)]
    return [{"role": "system", "content": "".join(texts)}] if texts else []


def _conversation(system: Any, messages: list[Any]) -> Conversation:
    """The chat messages of a Messages request: the system prompt first; a user
    message's tool_result blocks as tool messages before its text (as vLLM orders them);
    an assistant's text as its content and its tool_use blocks as its tool_calls.
    Thinking blocks in an assistant's turn are dropped (the models served here do not
    think); images, documents and anything else are a 400 naming the block."""
    chat = _system_message(system)
    origins = ["system"] * len(chat)
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        texts: list[dict[str, str]] = []
        calls: list[dict[str, Any]] = []
        for index, block in enumerate(_blocks(message.content, f"{where}.content")):
            at = f"{where}.content[{index}]"
            kind = block["type"]
            if kind == "text":
                text = required_string(block, "text", at)
                if text:
                    texts.append({"type": "text", "text": text})
            elif kind == "tool_use" and message.role == "assistant":
                arguments = block.get("input")
                if not isinstance(arguments, dict):
                    raise bad_request(f"{at}.input must be an object", param=f"{at}.input")
                calls.append({"id": required_string(block, "id", at), "type": "function",
                              "function": {"name": required_string(block, "name", at),
                                           "arguments": json.dumps(arguments,
                                                                   ensure_ascii=False)}})
            elif kind == "tool_result" and message.role == "user":
                content = block.get("content", "")
                chat.append({"role": "tool",
                             "tool_call_id": required_string(block, "tool_use_id", at),
                             "content": content if isinstance(content, str) else "\n".join(
                                 _texts(_blocks(content, f"{at}.content"), f"{at}.content"))})
                origins.append(at)
            elif not (kind in ("thinking", "redacted_thinking") and message.role == "assistant"):
                article = "an" if message.role == "assistant" else "a"
                raise bad_request(f"{at} is a {kind!r} block, which is not supported in "
                                  f"{article} {message.role} message", param=at)
        if texts or calls:
            turn: dict[str, Any] = {"role": message.role, "content": texts or None}
            if calls:
                turn["tool_calls"] = calls
            chat.append(turn)
            origins.append(where)
        elif message.role == "user" and not any(o.startswith(where) for o in origins):
            raise bad_request(f"{where}.content has no text or tool result",
                              param=f"{where}.content")
    return Conversation(chat, origins)


def _prefill(conversation: Conversation) -> dict[str, Any]:
    """A last assistant message of text is Anthropic's prefill: the answer continues it
    (chat's continue_final_message), and holds only the new text. A last assistant
    message with tool_use blocks waits for their results: a 400, as in Anthropic's API."""
    last = conversation.messages[-1] if conversation.messages else {}
    if last.get("role") != "assistant":
        return {}
    if "tool_calls" in last:
        where = conversation.origins[-1]
        raise bad_request(f"{where} ends with tool_use blocks, which need a user message "
                          "with their tool_result blocks after them", param=where)
    return {"add_generation_prompt": False, "continue_final_message": True}


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
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{index}].name must be a non-empty string",
                              param=f"tools[{index}].name")
        if not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools[{index}].input_schema must be a JSON schema object",
                              param=f"tools[{index}].input_schema")
        converted.append({"type": "function", "function": {
            "name": tool["name"], "description": tool.get("description", ""),
            "parameters": tool["input_schema"]}})
    return converted


def _chat_tool_choice(choice: dict[str, Any] | None, tools: list[Any] | None,
                      parser: str | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """(chat's tool_choice, parallel_tool_calls) of Anthropic's tool_choice: auto (the
    default with tools; it needs the server's tool-call parser), any (chat's
    "required"), tool (a named function), none."""
    kind = "auto" if choice is None else choice.get("type")
    parallel = False if (choice or {}).get("disable_parallel_tool_use") else None
    if not tools and kind in ("any", "tool"):
        raise bad_request(f"tool_choice {kind} needs tools", param="tool_choice")
    if kind == "none" or not tools:
        return ("none" if tools else None), parallel
    if kind == "auto":
        if parser is None:
            raise bad_request(
                'tool_choice "auto" (the default with tools) needs a parser of the model\'s '
                "own tool-call syntax: start the server with --enable-auto-tool-choice "
                '--tool-call-parser hermes, or use {"type": "any"}, {"type": "tool", '
                '"name": ...} (answered as JSON under the tools\' schemas) or {"type": '
                '"none"}', param="tool_choice")
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice, dict) and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad_request('tool_choice must be {"type": "auto" | "any" | "none"} or {"type": '
                      '"tool", "name": ...}', param="tool_choice")


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    """`output_config.format` (or the older top-level `output_format`), a JSON schema
    the answer follows, as chat's response_format."""
    spec = (body.output_config or {}).get("format") or body.output_format
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" \
            or not isinstance(spec.get("schema"), dict):
        raise bad_request('output_config.format must be {"type": "json_schema", "schema": '
                          '{...}}', param="output_config.format")
    if body.tool_choice is not None and body.tool_choice.get("type") in ("any", "tool"):
        raise bad_request("output_config.format cannot be combined with tool_choice any or "
                          "tool: the answer is then the call's arguments",
                          param="output_config.format")
    if body.messages and body.messages[-1].role == "assistant":
        raise bad_request("output_config.format cannot be combined with a prefilled "
                          "assistant message: the format would start over after it",
                          param="output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}


def _chat_request(body: MessagesRequest, conversation: Conversation, parser: str | None
                  ) -> ChatCompletionRequest:
    fields: dict[str, Any] = {name: getattr(body, name) for name in _SHARED_FIELDS}
    tools = _chat_tools(body.tools)
    choice, parallel = _chat_tool_choice(body.tool_choice, body.tools, parser)
    fields.update(messages=conversation.messages, max_completion_tokens=body.max_tokens,
                  stop=body.stop_sequences, tools=tools, tool_choice=choice,
                  parallel_tool_calls=parallel, response_format=_response_format(body),
                  **_prefill(conversation))
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
    block per call (a call cut short is text: see split_answer)."""
    text, calls = split_answer(reader, completion)
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
                shown = visible_text(reader, completion)
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
