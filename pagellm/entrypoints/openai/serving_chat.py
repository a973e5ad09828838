"""POST /v1/chat/completions: a conversation in, rendered by the model's chat template."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.async_engine import RequestStream
from pagellm.engine.chat_template import ChatError, ChatOptions, render_chat
from pagellm.engine.outputs import RequestOutput
from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.logprobs import (
    TokenText,
    chat_logprobs,
    prompt_logprobs_json,
)
from pagellm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    TokenizeRequest,
    UsageInfo,
)
from pagellm.entrypoints.openai.sampling import build_sampling_params, format_field
from pagellm.entrypoints.openai.serving import (
    Prompt,
    ServerContext,
    UsageReport,
    check_supported,
    final_outputs,
    is_set,
    merged,
    resolve_max_tokens,
    start_requests,
    usage,
)
from pagellm.entrypoints.openai.transport import (
    EventStreamResponse,
    sse,
    streamed,
    unless_disconnected,
)


def render_messages(tokenizer: Any, body: ChatCompletionRequest | TokenizeRequest
                    ) -> list[int]:
    """The prompt token ids of the request's conversation, rendered with its options by
    the engine's one renderer; a conversation or option it refuses is the client's error,
    a 400 naming the field."""
    assert body.messages is not None
    options = ChatOptions(body.add_generation_prompt, body.continue_final_message,
                          body.tools, None, body.chat_template_kwargs)
    try:
        return render_chat(tokenizer, [m.model_dump(exclude_none=True) for m in body.messages],
                           options)
    except ChatError as error:
        raise bad_request(str(error), param=error.param) from error


def check_rendering(body: ChatCompletionRequest | TokenizeRequest) -> None:
    """What the renderer does not take from a request: a template of its own, or special
    tokens added on top of those the template writes."""
    if is_set(body.chat_template):
        raise bad_request("chat_template is not supported: a request cannot replace the "
                          "model's chat template", param="chat_template")
    if body.add_special_tokens:
        raise bad_request("add_special_tokens is not supported with messages: the chat "
                          "template writes the special tokens", param="add_special_tokens")


def _chat_prompt(tokenizer: Any, body: ChatCompletionRequest, params: SamplingParams,
                 max_model_len: int) -> list[int]:
    return params.truncate(render_messages(tokenizer, body), max_model_len)


def _check_chat_options(body: ChatCompletionRequest) -> None:
    if body.echo:
        raise bad_request("echo is not supported for chat (use continue_final_message to "
                          "continue an assistant message)", param="echo")
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported for streamed chat; ask without "
                          "stream", param="prompt_logprobs")
    check_rendering(body)


def _check_tools(body: ChatCompletionRequest) -> None:
    """Tool definitions may be given for the template to render, but no tool call is
    ever parsed out of the answer, so only tool_choice "none" can be honoured."""
    choice = body.tool_choice
    if body.tools and choice != "none":
        raise bad_request("tool calling is not supported: send tools with tool_choice "
                          "\"none\" (they are only rendered into the prompt), or no tools",
                          param="tool_choice" if choice is not None else "tools")
    if not body.tools and choice is not None and choice != "none":
        raise bad_request("tool_choice needs tools, and tool calling is not supported",
                          param="tool_choice")


def _logprobs_setting(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


async def create_chat_completion(context: ServerContext, body: ChatCompletionRequest,
                                 raw: Request) -> Response:
    arrival = time.monotonic()
    context.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")
    check_supported(body)
    _check_chat_options(body)
    _check_tools(body)
    engine = context.engine
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens is not None \
        else "max_tokens"
    requested = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    base = build_sampling_params(
        body, max_tokens=requested, logprobs=_logprobs_setting(body),
        prompt_logprobs=body.prompt_logprobs, vocab_size=engine.vocab_size,
        field_names={"logprobs": "top_logprobs", "max_tokens": max_tokens_param})
    prompt = Prompt(None, await context.off_loop(_chat_prompt, engine.tokenizer, body, base,
                                            engine.max_model_len))
    params = base.clone(max_tokens=resolve_max_tokens(
        engine.max_model_len, len(prompt.token_ids), requested, "messages", max_tokens_param))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start_requests(context, request_id, [prompt], [params], body.cache_salt,
                                   arrival, "messages", body.priority, format_field(body))
    if body.stream:
        return EventStreamResponse(streamed(_stream(context, request_id, body, streams,
                                                    UsageReport.of(body.stream_options),
                                                    len(prompt.token_ids))))
    outputs = await unless_disconnected(raw, final_outputs(streams, context.metrics))
    return JSONResponse(_response(context, request_id, body, outputs[0]).model_dump(mode="json"))


def _response(context: ServerContext, request_id: str, body: ChatCompletionRequest,
              output: RequestOutput) -> ChatCompletionResponse:
    token_text = TokenText(context.engine.tokenizer, body.return_tokens_as_token_ids)
    choices = [
        ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                   logprobs=chat_logprobs(c.logprobs, token_text) if c.logprobs is not None
                   else None,
                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in output.outputs]
    return ChatCompletionResponse(
        id=request_id, model=context.model_name, choices=choices, usage=usage([output]),
        prompt_logprobs=(prompt_logprobs_json(output.prompt_logprobs, token_text,
                                              body.prompt_logprobs or 0)
                         if output.prompt_logprobs is not None else None))


async def _stream(context: ServerContext, request_id: str, body: ChatCompletionRequest,
                  streams: list[RequestStream], report: UsageReport, prompt_tokens: int
                  ) -> AsyncGenerator[str, None]:
    """A role chunk per choice, then content deltas, each choice's last with its reason;
    with continuous usage, every chunk counts the tokens so far (as vLLM's does)."""
    token_text = TokenText(context.engine.tokenizer, body.return_tokens_as_token_ids)
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], so_far: UsageInfo | None) -> str:
        """A chunk, with the usage so far where continuous usage is asked for."""
        return sse(ChatCompletionChunk(
            id=request_id, created=created, model=context.model_name, choices=choices,
            usage=so_far).model_dump(mode="json", exclude=None if so_far else {"usage"}))

    yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                 for i in range(body.n)],
                UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
                if report.on_every_chunk else None)
    sent_text: dict[int, int] = {}
    sent_logprobs: dict[int, int] = {}
    done: set[int] = set()
    final: RequestOutput | None = None
    async with aclosing(merged(streams, context.metrics)) as outputs:
        async for _, output in outputs:
            choices = []
            for completion in output.outputs:
                index = completion.index
                delta = completion.text[sent_text.get(index, 0):]
                if index in done or (not delta and completion.finish_reason is None):
                    continue
                sent_text[index] = len(completion.text)
                if completion.finish_reason is not None:
                    done.add(index)
                logprobs = None
                if completion.logprobs is not None:
                    logprobs = chat_logprobs(
                        completion.logprobs[sent_logprobs.get(index, 0):], token_text)
                    sent_logprobs[index] = len(completion.logprobs)
                choices.append(ChatChunkChoice(
                    index=index, delta=ChatDelta(content=delta), logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason))
            if output.finished:
                final = output
            if choices:
                yield chunk(choices, usage([output]) if report.on_every_chunk else None)
    if report.at_end and final is not None:
        last = ChatCompletionChunk(id=request_id, created=created, model=context.model_name,
                                   choices=[], usage=usage([final]))
        yield sse(last.model_dump(mode="json"))
