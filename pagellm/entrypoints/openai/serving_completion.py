"""POST /v1/completions: prompts in (text, token ids, or lists of either), text out."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagellm.core.sampling_params import BeamSearchParams, SamplingParams
from pagellm.engine.async_engine import RequestStream
from pagellm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.entrypoints.openai.errors import bad_request
from pagellm.entrypoints.openai.json_text import JSONResponse
from pagellm.entrypoints.openai.logprobs import (
    TokenText,
    completion_logprobs,
    echoed_prompt_logprobs,
    joined,
    prompt_logprobs_json,
)
from pagellm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from pagellm.entrypoints.openai.sampling import build_sampling_params, structured_outputs_of
from pagellm.entrypoints.openai.serving import (
    Prompt,
    ServerContext,
    UsageReport,
    beam_search_params,
    check_choices,
    check_max_tokens,
    check_supported,
    choice_usage,
    encode,
    final_outputs,
    length_bound,
    merged,
    request_defaults,
    request_ids,
    resolve_max_tokens,
    start_requests,
    truncated,
    usage,
)
from pagellm.entrypoints.openai.transport import (
    EventStreamResponse,
    sse,
    streamed,
    unless_disconnected,
)


def _prompts(context: ServerContext, body: CompletionRequest, params: SamplingParams
             ) -> list[Prompt]:
    """Normalises the four accepted shapes to a list of tokenized prompts, truncated as
    asked; with `echo`, token-id prompts get their text too (decoded), to be echoed."""
    prompt, echo = body.prompt, body.echo
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(token, int) for token in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt is empty", param="prompt")
    tokenizer = context.engine.tokenizer
    fitted = length_bound(params, context.engine.max_model_len)
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt is empty", param="prompt")
            prompts.append(Prompt(item, encode(tokenizer, item, "prompt",
                                               body.add_special_tokens, fitted)))
        else:
            if not item:
                raise bad_request("prompt is empty", param="prompt")
            prompts.append(Prompt(_decoded(tokenizer, item) if echo else None, list(item)))
    max_model_len = context.engine.max_model_len
    return [p if len(kept) == len(p.token_ids)
            else Prompt(_decoded(tokenizer, kept) if echo else None, kept)
            for p in prompts
            for kept in [truncated(params, p.token_ids, max_model_len, body.truncation_side)]]


def _decoded(tokenizer: Any, token_ids: list[int]) -> str:
    """A token-id prompt's text for `echo`; ids outside the vocabulary are refused with
    the engine's own message when the request is queued, so they are not decoded here."""
    try:
        return str(tokenizer.decode(token_ids))
    except (OverflowError, IndexError, TypeError):
        return ""


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """`echo` with `logprobs` scores the echoed prompt too, as OpenAI's API did and vLLM
    does: the prompt's tokens come first in the logprobs block. With `prompt_logprobs`
    also set, the engine scores the larger count, and each answer shows its own."""
    counts = [count for count in (body.prompt_logprobs, body.logprobs if body.echo else None)
              if count is not None]
    return max(counts) if counts else None


def _first_logprobs(body: CompletionRequest, output: RequestOutput, token_text: TokenText
                    ) -> CompletionLogprobs | None:
    """The echoed prompt's part of a choice's logprobs block, or None without one."""
    if not (body.echo and body.logprobs is not None and output.prompt_logprobs is not None):
        return None
    return echoed_prompt_logprobs(output.prompt_token_ids, output.prompt_logprobs,
                                  token_text, len(_echoed(body, output)), body.logprobs)


def _prompt_scores(body: CompletionRequest, output: RequestOutput, token_text: TokenText
                   ) -> list[dict[str, dict[str, Any]] | None] | None:
    if body.prompt_logprobs is None or output.prompt_logprobs is None:
        return None
    return prompt_logprobs_json(output.prompt_logprobs, token_text, body.prompt_logprobs)


async def create_completion(context: ServerContext, body: CompletionRequest,
                            raw: Request) -> Response:
    arrival = time.monotonic()
    context.check_model(body.model)
    check_supported(body)
    engine = context.engine
    check_max_tokens(body.max_tokens, engine.max_model_len, "max_tokens")
    request_format = structured_outputs_of(body)
    base = build_sampling_params(body, max_tokens=1 if _prompt_only(body) else body.max_tokens,
                                 logprobs=body.logprobs,
                                 prompt_logprobs=_prompt_logprobs(body),
                                 vocab_size=engine.vocab_size,
                                 defaults=request_defaults(context, body),
                                 structured_outputs=request_format.params)
    prompts = await context.off_loop(_prompts, context, body, base)
    check_choices(len(prompts), body.n)
    params = [
        base.clone(max_tokens=resolve_max_tokens(
            engine.max_model_len, len(p.token_ids), base.max_tokens, base.min_tokens,
            "prompt", engine.generation_defaults.max_tokens_limit))
        for p in prompts]
    run: Sequence[SamplingParams | BeamSearchParams] = params
    if body.use_beam_search:
        run = [beam_search_params(body, p, request_format.field) for p in params]
    request_id, engine_id = request_ids("cmpl-", raw, body.request_id)
    streams = await start_requests(context, engine_id, prompts, run, body.cache_salt,
                                   arrival, "prompt", body.priority, request_format.field)
    if body.stream:
        report = UsageReport.of(body.stream_options, context.force_include_usage)
        return EventStreamResponse(streamed(_stream(context, request_id, body, streams,
                                                    report)), streams, context.sse_keep_alive)
    outputs = await unless_disconnected(raw, final_outputs(streams, context.metrics))
    if _prompt_only(body):
        outputs = [_without_completion(output) for output in outputs]
    return JSONResponse(_response(context, request_id, body, outputs).model_dump(mode="json"))


def _prompt_only(body: CompletionRequest) -> bool:
    """vLLM's `echo` with `max_tokens: 0`: the prompt back (with `logprobs`, scored), and
    no completion, as scoring harnesses ask for a prompt's likelihood. The request runs
    for one token (the prompt's scores need its last step), which the answer drops."""
    return body.echo and body.max_tokens == 0


def _without_completion(output: RequestOutput) -> RequestOutput:
    return dataclasses.replace(output, outputs=[
        dataclasses.replace(completion, text="", token_ids=[],
                            logprobs=None if completion.logprobs is None else [],
                            cumulative_logprob=(None if completion.cumulative_logprob is None
                                                else 0.0))
        for completion in output.outputs])


def _echoed(body: CompletionRequest, output: RequestOutput) -> str:
    """What `echo` puts before a completion: its prompt's text."""
    return (output.prompt or "") if body.echo else ""


def _released(entries: list[Logprob], completion: CompletionOutput) -> list[Logprob]:
    """The scored tokens a stream's chunk may carry: all of them once the choice is
    finished, else those whose text begins in the text sent so far. Why: text that may
    begin a stop string, or part of a character, is held back, and its tokens' offsets
    would point past the text sent (then, capped at the final text, go backwards). They
    go with the chunk that sends their text, at the offsets the whole answer gives."""
    if completion.finish_reason is not None:
        return entries
    sent = len(completion.text)
    count = 0
    while count < len(entries) and entries[count].text_offset < sent:
        count += 1
    return entries[:count]


def _response(context: ServerContext, request_id: str, body: CompletionRequest,
              outputs: list[RequestOutput]) -> CompletionResponse:
    token_text = context.token_text(body.return_tokens_as_token_ids)
    choices = []
    for prompt_index, output in enumerate(outputs):
        echoed = _echoed(body, output)
        for completion in output.outputs:
            logprobs = None
            if body.logprobs is not None and completion.logprobs is not None:
                logprobs = joined(
                    _first_logprobs(body, output, token_text) or CompletionLogprobs(),
                    completion_logprobs(completion.logprobs, token_text, len(completion.text)),
                    len(echoed))
            choices.append(CompletionChoice(
                index=prompt_index * body.n + completion.index,
                text=echoed + completion.text,
                logprobs=logprobs, finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                prompt_logprobs=_prompt_scores(body, output, token_text),
                prompt_token_ids=output.prompt_token_ids if body.return_token_ids else None,
                token_ids=completion.token_ids if body.return_token_ids else None))
    return CompletionResponse(id=request_id, model=context.model_name, choices=choices,
                              usage=usage(outputs))


async def _stream(context: ServerContext, request_id: str, body: CompletionRequest,
                  streams: list[RequestStream], report: UsageReport
                  ) -> AsyncGenerator[str, None]:
    """A chunk per choice that moved, with its new text (and new logprobs), one choice a
    chunk as OpenAI and vLLM send them; with continuous usage, the chunk counts its
    prompt and its choice's tokens so far (as vLLM's does)."""
    token_text = context.token_text(body.return_tokens_as_token_ids)
    sent_text: dict[int, int] = {}
    sent_logprobs: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    finals: dict[int, RequestOutput] = {}
    created = int(time.time())
    async with aclosing(merged(streams, context.metrics)) as outputs:
        async for prompt_index, output in outputs:
            if _prompt_only(body):
                output = _without_completion(output)
            choices: list[tuple[CompletionChoice, CompletionOutput]] = []
            for completion in output.outputs:
                index = prompt_index * body.n + completion.index
                delta = completion.text[sent_text.get(index, 0):]
                if index in done or (not delta and completion.finish_reason is None):
                    continue
                first = index not in sent_text
                if first:
                    delta = _echoed(body, output) + delta
                sent_text[index] = len(completion.text)
                if completion.finish_reason is not None:
                    done.add(index)
                logprobs = None
                if body.logprobs is not None and completion.logprobs is not None:
                    new = _released(completion.logprobs[sent_logprobs.get(index, 0):],
                                    completion)
                    sent_logprobs[index] = sent_logprobs.get(index, 0) + len(new)
                    logprobs = joined(
                        (_first_logprobs(body, output, token_text) if first else None)
                        or CompletionLogprobs(),
                        completion_logprobs(new, token_text, len(completion.text)
                                            if completion.finish_reason is not None else None),
                        len(_echoed(body, output)))
                ids = None
                if body.return_token_ids:  # the tokens since the last chunk of the choice
                    ids = completion.token_ids[sent_tokens.get(index, 0):]
                    sent_tokens[index] = len(completion.token_ids)
                choices.append((CompletionChoice(
                    index=index, text=delta, logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                    prompt_logprobs=_prompt_scores(body, output, token_text) if first else None,
                    prompt_token_ids=(output.prompt_token_ids
                                      if body.return_token_ids and first else None),
                    token_ids=ids), completion))
            if output.finished:
                finals[prompt_index] = output
            for choice, completion in choices:
                chunk = CompletionResponse(
                    id=request_id, created=created, model=context.model_name, choices=[choice],
                    usage=choice_usage(output, completion) if report.on_every_chunk else None)
                yield sse(chunk.model_dump(
                    mode="json", exclude=None if report.on_every_chunk else {"usage"}))
    if report.at_end:
        final = CompletionResponse(id=request_id, created=created, model=context.model_name,
                                   choices=[], usage=usage(list(finals.values())))
        yield sse(final.model_dump(mode="json"))
