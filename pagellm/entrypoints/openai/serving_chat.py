"""POST /v1/chat/completions: a conversation in, rendered by the model's chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi import Request
from fastapi.responses import Response

from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.async_engine import RequestStream
from pagellm.engine.chat_template import ChatError, ChatOptions, check_messages, render_chat
from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.engine.text import TextTooLong
from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.json_text import JSONResponse
from pagellm.entrypoints.openai.logprobs import (
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
    DeltaFunctionCall,
    DeltaToolCall,
    TokenizeRequest,
    ToolCall,
    UsageInfo,
)
from pagellm.entrypoints.openai.reasoning import (
    REASONING_PARSERS,
    ThinkReasoningParser,
    answer_parts,
)
from pagellm.entrypoints.openai.sampling import build_sampling_params, structured_outputs_of
from pagellm.entrypoints.openai.serving import (
    CONTEXT_LENGTH_EXCEEDED,
    Prompt,
    ServerContext,
    UsageReport,
    beam_search_params,
    check_max_tokens,
    check_supported,
    choice_usage,
    final_outputs,
    is_set,
    length_bound,
    merged,
    request_defaults,
    request_ids,
    resolve_max_tokens,
    start_requests,
    truncated,
    usage,
)
from pagellm.entrypoints.openai.tool_calls import (
    ToolCallFormat,
    ToolCallReader,
    new_call_id,
    tool_call_reader,
)
from pagellm.entrypoints.openai.transport import (
    EventStreamResponse,
    sse,
    streamed,
    unless_disconnected,
)


def render_messages(context: ServerContext, body: ChatCompletionRequest | TokenizeRequest,
                    max_model_len: int | None = None) -> list[int]:
    """The prompt token ids of the request's conversation, rendered with its options by
    the engine's one renderer; a conversation or option it refuses is the client's error,
    a 400 naming the field. The request's `chat_template_kwargs` are laid over the
    server's defaults (--default-chat-template-kwargs), with `reasoning_effort` as vLLM
    passes it, and its tools are left out for tool_choice "none" where the server says
    so (--exclude-tools-when-tool-choice-none)."""
    assert body.messages is not None
    tools = body.tools
    if (context.exclude_tools_when_tool_choice_none
            and isinstance(body, ChatCompletionRequest) and body.tool_choice == "none"):
        tools = None
    asked = body.chat_template_kwargs or {}
    template_kwargs = {**context.default_chat_template_kwargs, **asked}
    effort = body.reasoning_effort if isinstance(body, ChatCompletionRequest) else None
    if effort is not None:
        template_kwargs["reasoning_effort"] = effort
        if "enable_thinking" not in asked:
            template_kwargs["enable_thinking"] = effort != "none"
    options = ChatOptions(body.add_generation_prompt, body.continue_final_message, tools, None,
                          template_kwargs, context.chat_template_content_format)
    try:
        return render_chat(context.engine.tokenizer,
                           [m.model_dump(exclude_none=True) for m in body.messages], options,
                           max_model_len)
    except TextTooLong as error:
        raise bad_request(str(error), param="messages",
                          code=CONTEXT_LENGTH_EXCEEDED) from error
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


def _chat_prompt(context: ServerContext, body: ChatCompletionRequest, params: SamplingParams
                 ) -> list[int]:
    max_model_len = context.engine.max_model_len
    return truncated(params, render_messages(context, body, length_bound(params, max_model_len)),
                     max_model_len, body.truncation_side)


def _check_chat_options(body: ChatCompletionRequest) -> None:
    if body.stream and body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not supported for streamed chat; ask without "
                          "stream", param="prompt_logprobs")
    check_rendering(body)


def _logprobs_setting(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs and not body.logprobs:  # 0 asks for nothing, as vLLM reads it
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if not body.logprobs:
        return None
    return body.top_logprobs or 0


@dataclass
class ChatRun:
    """A chat request started in the engine: its streams, how its answer is read for
    reasoning and tool calls, and the sampling it runs with (defaults filled in,
    max_tokens fitted to the context: what Responses echo)."""

    request_id: str
    streams: list[RequestStream]
    reader: ToolCallReader | None
    params: SamplingParams
    thinking: ThinkReasoningParser | None = None


async def start_chat(context: ServerContext, body: ChatCompletionRequest, arrival: float,
                     request_id: str, engine_id: str | None = None) -> ChatRun:
    """Checks a chat request, renders its conversation and queues it: what chat and the
    APIs answered through it (Responses, Messages) share. A request the server cannot
    take is a 400 naming the chat field (the other APIs rename it, see chat_bridge).
    The server's reasoning parser (if any) reads the answer, except under
    a format, whose answer is the format from its first token, and when the answer
    continues the conversation's last message, which is the client's text, not a
    reasoning block the template opened."""
    check_supported(body)
    _check_chat_options(body)
    reader = tool_call_reader(body, context.tool_call_parser)
    request_format = structured_outputs_of(
        body, reader.schema if isinstance(reader, ToolCallFormat) else None)
    thinking = (REASONING_PARSERS[context.reasoning_parser]()
                if context.reasoning_parser
                and request_format.params is None and not body.continue_final_message
                else None)
    engine = context.engine
    requested, max_tokens_param = body.completion_budget
    base = build_sampling_params(
        body, max_tokens=requested, logprobs=_logprobs_setting(body),
        prompt_logprobs=body.prompt_logprobs, vocab_size=engine.vocab_size,
        defaults=request_defaults(context, body),
        field_names={"logprobs": "top_logprobs", "max_tokens": max_tokens_param},
        structured_outputs=request_format.params)
    if thinking is not None or reader is not None and not isinstance(reader, ToolCallFormat):
        # A parsed syntax's markers are special tokens in some models (<tool_call>,
        # Llama's <|python_tag|>, some models' <think>), which the text would otherwise
        # drop (as vLLM does).
        base = base.clone(skip_special_tokens=False)
    prompt = Prompt(None, await context.off_loop(_chat_prompt, context, body, base))
    params = base.clone(max_tokens=resolve_max_tokens(
        engine.max_model_len, len(prompt.token_ids), base.max_tokens, base.min_tokens,
        "messages", engine.generation_defaults.max_tokens_limit))
    run = (beam_search_params(body, params, request_format.field) if body.use_beam_search
           else params)
    streams = await start_requests(context, engine_id or request_id, [prompt], [run],
                                   body.cache_salt, arrival, "messages", body.priority,
                                   request_format.field, logprobs_param="top_logprobs")
    return ChatRun(request_id, streams, reader, params, thinking)


async def create_chat_completion(context: ServerContext, body: ChatCompletionRequest,
                                 raw: Request) -> Response:
    arrival = time.monotonic()
    context.check_model(body.model)
    requested, param = body.completion_budget
    check_max_tokens(requested, context.engine.max_model_len, param)
    run = await start_chat(context, body, arrival,
                           *request_ids("chatcmpl-", raw, body.request_id))
    if body.stream:
        report = UsageReport.of(body.stream_options, context.force_include_usage)
        events = _stream(context, body, run, report)
        return EventStreamResponse(streamed(events), run.streams, context.sse_keep_alive)
    outputs = await unless_disconnected(raw, final_outputs(run.streams, context.metrics))
    return JSONResponse(_response(context, body, run, outputs[0]).model_dump(mode="json"))


def _shows_tokens(body: ChatCompletionRequest, run: ChatRun) -> bool:
    """Whether an answer's logprobs and token ids may be shown: not when the reasoning
    they would spell out is hidden (`include_reasoning: false`), as vLLM hides them."""
    return run.thinking is None or body.include_reasoning


def _response(context: ServerContext, body: ChatCompletionRequest, run: ChatRun,
              output: RequestOutput) -> ChatCompletionResponse:
    token_text = context.token_text(body.return_tokens_as_token_ids)
    reader = run.reader
    shows_tokens = _shows_tokens(body, run)
    echoed = _echoed(context, body)
    choices = []
    for c in output.outputs:
        reasoning, text = run.thinking.split(c.text) if run.thinking else (None, c.text)
        if not body.include_reasoning:
            reasoning = None
        content, calls = reader.split(text) if reader is not None and text is not None \
            else (text, None)
        if isinstance(reader, ToolCallFormat):
            content = content or ""  # vLLM's for a forced call, where OpenAI's is null
            if calls is None and reader.function is None:
                calls = []  # a cut "required" array: no call, as a list (vLLM's; clients index it)
        choices.append(ChatChoice(
            index=c.index, message=ChatResponseMessage(
                role=_role(context, body), content=echoed + (content or "") if echoed
                else content, tool_calls=calls, reasoning=reasoning,
                reasoning_content=reasoning),
            logprobs=(chat_logprobs(c.logprobs, token_text)
                      if body.logprobs and c.logprobs is not None and shows_tokens else None),
            finish_reason=_finish_reason(c.finish_reason, calls, reader),
            stop_reason=c.stop_reason,
            token_ids=c.token_ids if body.return_token_ids and shows_tokens else None))
    return ChatCompletionResponse(
        id=run.request_id, model=context.model_name, choices=choices, usage=usage([output]),
        prompt_logprobs=(prompt_logprobs_json(output.prompt_logprobs, token_text,
                                              body.prompt_logprobs or 0)
                         if output.prompt_logprobs is not None else None),
        prompt_token_ids=output.prompt_token_ids if body.return_token_ids else None)


def _role(context: ServerContext, body: ChatCompletionRequest) -> str:
    """The answer's role, as vLLM names it: the server's response role after the
    generation prompt, else that of the message the answer continues."""
    assert body.messages is not None
    return context.response_role if body.add_generation_prompt else body.messages[-1].role


def _echoed(context: ServerContext, body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the last message's text, which the answer starts with when
    the answer continues it (the last message has the answer's role)."""
    last = body.messages[-1]
    if not body.echo or last.role != _role(context, body):
        return ""
    return str(check_messages([last.model_dump(exclude_none=True)])[0]["content"])


def _finish_reason(reason: str | None, calls: list[ToolCall] | None,
                   reader: ToolCallReader | None) -> str | None:
    """An answer that made calls finishes as its reader says ("tool_calls"; a named
    function's call keeps "stop", OpenAI's for a forced function); a cut answer keeps
    its own reason."""
    if reader is None or not calls or reason != "stop":
        return reason
    return reader.finish_reason or reason


def _named_piece(text: str, function: str, first: bool) -> ChatDelta:
    """A piece of a named function's arguments, the first one naming the call."""
    if not text and not first:
        return ChatDelta()
    return ChatDelta(tool_calls=[DeltaToolCall(
        index=0, id=new_call_id() if first else None, type="function" if first else None,
        function=DeltaFunctionCall(name=function if first else None, arguments=text))])


def _calls_delta(content: str | None, calls: list[ToolCall]) -> ChatDelta:
    """The end of an answer read whole: its last content, and every call at once."""
    return ChatDelta(content=content or None, tool_calls=[
        DeltaToolCall(index=i, id=call.id, type="function",
                      function=DeltaFunctionCall(name=call.function.name,
                                                 arguments=call.function.arguments))
        for i, call in enumerate(calls)])


async def _stream(context: ServerContext, body: ChatCompletionRequest, run: ChatRun,
                  report: UsageReport) -> AsyncGenerator[str, None]:
    """A role chunk per choice, then content deltas (after reasoning deltas, with a
    reasoning parser), one choice a chunk, each choice's last with its reason; with
    continuous usage, every chunk counts its prompt and its choice's tokens so far (as
    vLLM's does).

    Tool calls stream as OpenAI's do where that can be known: a named function's
    arguments as they come (the first piece naming the call). Other calls are read from
    the whole answer and sent with the last chunk ("required": a partial array names no
    call yet; a parsed answer: its content is sent up to where a call begins)."""
    token_text = context.token_text(body.return_tokens_as_token_ids)
    created = int(time.time())
    request_id, reader, thinking = run.request_id, run.reader, run.thinking
    shows_tokens = _shows_tokens(body, run)
    role = _role(context, body)
    echoed = _echoed(context, body)

    def chunk(choices: list[ChatChunkChoice], so_far: UsageInfo | None,
              prompt_token_ids: list[int] | None = None) -> str:
        """A chunk, with the usage so far where continuous usage is asked for."""
        return sse(ChatCompletionChunk(
            id=request_id, created=created, model=context.model_name, choices=choices,
            usage=so_far, prompt_token_ids=prompt_token_ids,
        ).model_dump(mode="json", exclude=None if so_far else {"usage"}))

    sent_text: dict[int, int] = {}
    sent_reasoning: dict[int, int] = {}
    sent_logprobs: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    named = reader.function if isinstance(reader, ToolCallFormat) else None
    done: set[int] = set()
    final: RequestOutput | None = None
    opened = False
    async with aclosing(merged(run.streams, context.metrics)) as outputs:
        async for _, output in outputs:
            if not opened:
                opened = True
                # The role opens each choice once the prompt is computed, as vLLM sends
                # it: a client timing its first chunk measures the prefill (one choice a
                # chunk, as OpenAI and vLLM send them, for clients that read choices[0]).
                # With return_token_ids each role chunk carries the prompt's ids (vLLM's).
                # An echo follows, in a chunk of its own.
                so_far = usage([replace(output, outputs=[])]) if report.on_every_chunk \
                    else None
                for index in range(body.n):
                    yield chunk([ChatChunkChoice(
                        index=index, delta=ChatDelta(role=role, content=""))], so_far,
                        output.prompt_token_ids if body.return_token_ids else None)
                for index in range(body.n if echoed else 0):
                    yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(
                        content=echoed))], so_far)
            choices: list[tuple[ChatChunkChoice, CompletionOutput]] = []
            for completion in output.outputs:
                index = completion.index
                finished = completion.finish_reason is not None
                if index in done:
                    continue
                sent = sent_text.get(index, 0)
                calls = None
                reasoning, text = answer_parts(thinking, completion)
                thought = ""
                if thinking is not None and body.include_reasoning:
                    thought = reasoning[sent_reasoning.get(index, 0):]
                    sent_reasoning[index] = len(reasoning)
                if reader is None or named is not None:
                    shown = text
                    delta = ChatDelta(content=shown[sent:]) if named is None else \
                        _named_piece(shown[sent:], named, index not in sent_text)
                elif not finished:
                    shown = reader.streamed_content(text)
                    delta = ChatDelta(content=shown[sent:])
                else:
                    content, calls = reader.split(text)
                    shown = text
                    delta = (ChatDelta(content=text[sent:]) if calls is None
                             else _calls_delta((content or "")[sent:], calls))
                if len(shown) == sent and not finished and not thought:
                    continue
                if thought:
                    delta = delta.model_copy(update={"content": delta.content or None,
                                                     "reasoning": thought,
                                                     "reasoning_content": thought})
                sent_text[index] = len(shown)
                if finished:
                    done.add(index)
                logprobs = None
                if body.logprobs and completion.logprobs is not None and shows_tokens:
                    logprobs = chat_logprobs(
                        completion.logprobs[sent_logprobs.get(index, 0):], token_text)
                    sent_logprobs[index] = len(completion.logprobs)
                ids = None
                if body.return_token_ids and shows_tokens:  # those since its last chunk
                    ids = completion.token_ids[sent_tokens.get(index, 0):]
                    sent_tokens[index] = len(completion.token_ids)
                if finished and delta.tool_calls:
                    # The calls, then the reason in a chunk of its own, as OpenAI sends
                    # them: openai-node's stream helper marks a call done only when a
                    # later chunk finishes it.
                    choices.append((ChatChunkChoice(index=index, delta=delta,
                                                    logprobs=logprobs, token_ids=ids),
                                    completion))
                    delta, logprobs, ids = ChatDelta(), None, None
                choices.append((ChatChunkChoice(
                    index=index, delta=delta, logprobs=logprobs,
                    finish_reason=_finish_reason(completion.finish_reason, calls, reader),
                    stop_reason=completion.stop_reason, token_ids=ids), completion))
            if output.finished:
                final = output
            for choice, completion in choices:
                yield chunk([choice], choice_usage(output, completion)
                            if report.on_every_chunk else None)
    if report.at_end and final is not None:
        last = ChatCompletionChunk(id=request_id, created=created, model=context.model_name,
                                   choices=[], usage=usage([final]))
        yield sse(last.model_dump(mode="json"))
