"""What both generation endpoints share: model check, context-length check, starting the
engine requests of one HTTP request, merging their outputs, usage, SSE framing, and
abandoning the work when the client goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from pagellm.engine.outputs import RequestOutput
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.entrypoints.openai.protocol import PromptTokensDetails, UsageInfo

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Completions one HTTP request may ask for (prompts x n). Each is a full engine request,
# so this bounds how much of the engine one client can occupy with a single call.
MAX_CHOICES = 256

DONE = "data: [DONE]\n\n"


@dataclass
class ServerContext:
    """What every handler needs: the engine, the names it answers to, the metrics."""

    engine: AsyncLLMEngine
    model_names: list[str]
    metrics: ServerMetrics

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, requested: str | None) -> None:
        """404 for a model this server does not serve; an omitted model means ours."""
        if requested is not None and requested not in self.model_names:
            raise APIError(404, f"The model `{requested}` does not exist.", param="model",
                           code="model_not_found")


@dataclass
class Prompt:
    """One prompt, tokenized by the server (text kept for outputs that echo it)."""

    text: str | None
    token_ids: list[int]


def encode(tokenizer: Any, text: str, param: str, add_special_tokens: bool) -> list[int]:
    """Tokenizes client text; JSON can carry lone UTF-16 surrogates, which no tokenizer
    accepts, and that is the client's error (400), not ours."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except (TypeError, UnicodeError) as error:
        raise bad_request(f"{param} is not valid Unicode text (lone surrogate?)",
                          param=param) from error


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"This request asks for {num_prompts * n} completions ({num_prompts} prompts x "
            f"n={n}); the limit is {MAX_CHOICES}.", param="n")


def resolve_max_tokens(max_model_len: int, prompt_len: int, max_tokens: int | None,
                       prompt_param: str, max_tokens_param: str) -> int:
    """The completion budget of a prompt: as asked, or (if None) all the context left.

    Raises OpenAI's "maximum context length" 400, naming both numbers, when the prompt
    and the completion cannot both fit.
    """
    budget = max_model_len - prompt_len if max_tokens is None else max_tokens
    if prompt_len >= max_model_len or prompt_len + budget > max_model_len:
        wanted = max(budget, 1)
        param = prompt_param if prompt_len >= max_model_len else max_tokens_param
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + wanted} tokens ({prompt_len} in the prompt, {wanted} "
            f"for the completion). Please reduce the length of the prompt or "
            f"{max_tokens_param}.", param=param, code="context_length_exceeded")
    return budget


async def start_requests(
    context: ServerContext,
    base_id: str,
    prompts: list[Prompt],
    params: list[SamplingParams],
    cache_salt: str | None,
    arrival_time: float,
    prompt_param: str,
) -> list[RequestStream]:
    """Queues one engine request per prompt; all or none (an error aborts the started)."""
    streams: list[RequestStream] = []
    try:
        for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            engine_prompt: Any = ({"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                                  if prompt.text is not None else prompt.token_ids)
            streams.append(await context.engine.add_request(
                f"{base_id}-{index}", engine_prompt, sampling, cache_salt, arrival_time))
    except BaseException as error:
        for stream in streams:
            stream.abort()
        if isinstance(error, ValueError):
            param = "cache_salt" if str(error).startswith("cache_salt") else prompt_param
            raise bad_request(str(error), param=param) from error
        if isinstance(error, EngineDeadError):
            raise APIError(503, "The server is shutting down.") from error
        raise
    return streams


async def merged(streams: list[RequestStream], metrics: ServerMetrics
                 ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from all streams as they come; leaving early aborts all.

    The next output of a stream is only awaited once the previous one was consumed, so
    a slow reader lets the engine's streams coalesce outputs instead of queueing them.
    """
    pending: dict[asyncio.Task[RequestOutput], int] = {
        asyncio.ensure_future(stream.__anext__()): index
        for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                if output.finished:
                    metrics.observe_finished(output)
                yield index, output
                pending[asyncio.ensure_future(streams[index].__anext__())] = index
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            stream.abort()


async def final_outputs(streams: list[RequestStream], metrics: ServerMetrics
                        ) -> list[RequestOutput]:
    """The finished output of every stream, in prompt order."""
    last: dict[int, RequestOutput] = {}
    async with aclosing(merged(streams, metrics)) as outputs:
        async for index, output in outputs:
            last[index] = output
    return [last[index] for index in range(len(streams))]


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    """OpenAI's usage: each prompt counted once (whatever n), every completion token."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def failure(error: BaseException) -> APIError:
    """The API error for a request that failed after it was queued."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, "The server is shutting down.")
    if isinstance(error, RequestFailedError):
        return APIError(500, f"The server failed this request: {error}")
    logger.error("request failed", exc_info=error)
    return APIError(500, "The server had an error while processing your request.")


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, allow_nan=False)}\n\n"


async def streamed(events: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """SSE events, then `[DONE]`; an error mid-stream becomes an error event first, since
    the 200 status has already been sent."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except Exception as error:  # noqa: BLE001 - reported to the client, then [DONE]
        yield sse(failure(error).body())
    yield DONE


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops generating as soon as the client disconnects.

    Starlette only notices a disconnect when a write fails (ASGI spec 2.4), so a request
    still queued or in a long prefill would run on for a client that is gone. Here a
    listener runs beside the stream and cancels it on disconnect, and the body iterator
    is always closed, so the request's `finally` aborts it and frees its KV blocks.
    """

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with aclosing(self.events), anyio.create_task_group() as group:

            async def stream() -> None:
                with contextlib.suppress(OSError):
                    await self.stream_response(send)
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, but cancels it if the client disconnects first.

    A non-streamed generation can run for minutes; without this the engine would keep
    computing (and holding KV blocks) for a client that is gone.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "The client closed the request.")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
