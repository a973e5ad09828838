"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as vLLM
serves it, for clients written against Anthropic's SDK.

As with the Responses API, a message is a chat completion underneath: the system
prompt and content blocks become a chat conversation (messages_to_chat.py), the one chat
path renders, queues and reads tool calls, and the answer comes back as content blocks
(text, then one tool_use block per call) with Anthropic's stop reasons, usage (the
prefix cache as `cache_read_input_tokens`) and stream events.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.entrypoints.openai.chat_bridge import split_answer, streamed_text
from pagellm.entrypoints.openai.errors import APIError, failure
from pagellm.entrypoints.openai.json_text import JSONResponse
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
from pagellm.entrypoints.openai.messages_to_chat import (
    chat_request,
    check_options,
    conversation_of,
    count_request,
    renamed,
)
from pagellm.entrypoints.openai.reasoning import answer_parts
from pagellm.entrypoints.openai.serving import (
    ServerContext,
    final_outputs,
    merged,
    usage,
)
from pagellm.entrypoints.openai.serving_chat import ChatRun, render_messages, start_chat
from pagellm.entrypoints.openai.tool_calls import function_schemas
from pagellm.entrypoints.openai.transport import EventStreamResponse, sse, unless_disconnected


async def create_message(context: ServerContext, body: MessagesRequest, raw: Request
                         ) -> Response:
    """A message answered through the chat path; a stream of Anthropic's events when
    asked. A final assistant message is continued (Anthropic's prefill)."""
    arrival = time.monotonic()
    context.check_model(body.model)
    check_options(body)
    conversation = conversation_of(body.system, body.messages)
    message_id = f"msg_{uuid.uuid4().hex}"
    try:
        run = await start_chat(context, chat_request(body, conversation,
                                                     context.tool_call_parser),
                               arrival, message_id)
    except APIError as error:
        raise renamed(error, conversation) from error
    if body.stream:
        return EventStreamResponse(_events(context, run, message_id), run.streams,
                                   context.sse_keep_alive)
    outputs = await unless_disconnected(raw, final_outputs(run.streams, context.metrics))
    return JSONResponse(_answer(context.model_name, message_id, run, outputs[0])
                        .model_dump(mode="json"))


async def count_tokens(context: ServerContext, body: CountTokensRequest) -> CountTokensResponse:
    """The prompt tokens the same request to /v1/messages would have (its rendered
    conversation, tools included)."""
    context.check_model(body.model)
    conversation = conversation_of(body.system, body.messages)
    try:
        chat = count_request(conversation, body.tools)
        if chat.tools:
            function_schemas(chat.tools)  # the tools checked as a message checks them
        tokens = await context.off_loop(render_messages, context, chat)
    except APIError as error:
        raise renamed(error, conversation) from error
    return CountTokensResponse(input_tokens=len(tokens))


def _stop(completion: CompletionOutput, called: bool) -> tuple[StopReason, str | None]:
    """Anthropic's (stop_reason, stop_sequence) of a finished completion."""
    if completion.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


def _content(run: ChatRun, completion: CompletionOutput, signature: str
             ) -> list[ContentBlock]:
    """The answer's blocks: its reasoning as a thinking block (with a reasoning parser,
    when there is some; `signature` is opaque, as vLLM's), its text (when there is some,
    or the answer would have no block at all), then one tool_use block per call (a call
    cut short is text: see split_answer). No empty text block beside others, as vLLM
    and Anthropic send none: Anthropic refuses one sent back in the conversation."""
    reasoning, answer = answer_parts(run.thinking, completion)
    text, calls = split_answer(run.reader, answer)
    blocks = ([ContentBlock(type="thinking", thinking=reasoning, signature=signature)]
              if reasoning else [])
    if text or not (calls or blocks):
        blocks.append(ContentBlock(type="text", text=text or ""))
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


def _answer(model: str, message_id: str, run: ChatRun, result: RequestOutput
            ) -> MessagesResponse:
    completion = result.outputs[0]
    content = _content(run, completion, _signature())
    stop_reason, stop_sequence = _stop(completion,
                                       any(block.type == "tool_use" for block in content))
    return MessagesResponse(id=message_id, model=model, content=content,
                            stop_reason=stop_reason, stop_sequence=stop_sequence,
                            usage=_usage(result))


async def _events(context: ServerContext, run: ChatRun, message_id: str
                  ) -> AsyncGenerator[str, None]:
    """Anthropic's event stream: message_start (once the prompt is read, so that its
    usage says how much came from the cache) and a ping; with a reasoning parser, the
    thinking block (its thinking_delta pieces, then its signature_delta and stop once
    the text begins); the text block's start, its text_delta pieces (held back where a
    tool call may begin) and stop; each tool_use block whole (start, one
    input_json_delta, stop); message_delta with the stop reason and usage;
    message_stop. A failure is an `error` event."""

    def event(kind: str, **fields: Any) -> str:
        return sse(StreamEvent(type=kind, **fields).model_dump(mode="json"), kind)

    signature = _signature()
    sent_thought = sent = 0
    started = thinking = thought = opened = False
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
                reasoning, answer = answer_parts(run.thinking, completion)
                if len(reasoning) > sent_thought:
                    if not thinking:
                        yield event("content_block_start", index=0, content_block=ContentBlock(
                            type="thinking", thinking="", signature=""))
                        thinking = True
                    yield event("content_block_delta", index=0, delta={
                        "type": "thinking_delta", "thinking": reasoning[sent_thought:]})
                    sent_thought = len(reasoning)
                content = _content(run, completion, signature) if finished else []
                text = next((block for block in content if block.type == "text"), None)
                shown = (text.text or "") if text is not None else (
                    "" if finished else streamed_text(run.reader, answer))
                if thinking and not thought and (shown or finished):
                    yield (event("content_block_delta", index=0, delta={
                               "type": "signature_delta", "signature": signature})
                           + event("content_block_stop", index=0))
                    thought = True
                first = 1 if thinking else 0
                if len(shown) > sent or text is not None:
                    if not opened:
                        yield event("content_block_start", index=first,
                                    content_block=ContentBlock(type="text", text=""))
                        opened = True
                    if len(shown) > sent:
                        yield event("content_block_delta", index=first,
                                    delta={"type": "text_delta", "text": shown[sent:]})
                        sent = len(shown)
                if not finished:
                    continue
                if opened:
                    yield event("content_block_stop", index=first)
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


def _signature() -> str:
    """A thinking block's signature: Anthropic's verifies the thinking when a client
    sends it back; here thinking sent back is dropped, so it is only an opaque id."""
    return uuid.uuid4().hex
