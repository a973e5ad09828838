"""How responses reach the client: SSE framing, and work that stops when the client leaves.

A client that disconnects must cost nothing more: its stream is cancelled at once (not at
the next failed write) and a non-streamed request stops waiting, and either way the
request's cleanup aborts it in the engine and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagellm.engine.async_engine import RequestStream
from pagellm.entrypoints.openai.errors import APIError, failure
from pagellm.entrypoints.openai.json_text import dumps

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see bytes


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event; `event` names its type (the Responses and Messages APIs'
    streams do)."""
    kind = "" if event is None else f"event: {event}\n"
    return f"{kind}data: {dumps(payload)}\n\n"


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


async def kept_alive(events: AsyncGenerator[str, None], interval: float
                     ) -> AsyncGenerator[str, None]:
    """`events`, with an SSE comment whenever none came for `interval` seconds (vLLM's
    --sse-keep-alive-interval): a proxy with a read timeout (nginx's 60 s, a load
    balancer's idle timeout) would otherwise cut a stream that is still queued, in a
    long prefill, or between slow tokens. One task advances `events` at a time, and a
    timeout leaves it running rather than cancelling it mid-step."""
    pending = asyncio.ensure_future(anext(events))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEP_ALIVE
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(events))
    finally:
        pending.cancel()
        with contextlib.suppress(BaseException):  # its outcome was already taken
            await pending
        await events.aclose()


class EventStreamResponse(StreamingResponse):
    """An SSE response that stops generating as soon as the client disconnects.

    Starlette only notices a disconnect when a write fails (ASGI spec 2.4), so a request
    still queued or in a long prefill would run on for a client that is gone. Here a
    listener runs beside the stream and cancels it on disconnect, the body iterator is
    always closed, and the engine requests it reads (`streams`) are aborted when the
    response ends, so their KV blocks are freed at once. That last step is not left to
    the iterator's own `finally`: a generator closed before its first step never runs it
    (a client gone before the first event).
    """

    def __init__(self, events: AsyncGenerator[str, None],
                 streams: Sequence[RequestStream] = (), keep_alive: float | None = None
                 ) -> None:
        if keep_alive:
            events = kept_alive(events, keep_alive)
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.streams = streams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with aclosing(self.events), anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            for request in self.streams:
                request.abort()  # idempotent: a finished one is left alone


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
