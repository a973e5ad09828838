"""ASGI middleware: what happens to every request before and after its handler.

The guards run ahead of FastAPI's body parsing: a body over the size limit must be
refused without buffering it whole, and a request without the API key must learn nothing
about the endpoint (not even that its body was malformed). The others see a request
whole, a stream's last byte included.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import APIError, is_anthropic, route_path

# How much of an oversized body is read and dropped before answering 413. Answering while
# the client is still sending makes many clients report a broken pipe instead of the
# status; past this much it is not worth the bandwidth, and the connection is closed.
_DRAIN_FACTOR = 4


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, declared (Content-Length) or streamed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared < 0:
            await APIError(400, "Invalid Content-Length header.").response(
                anthropic=is_anthropic(scope))(scope, receive, send)
            return
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, already_read=0)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await self._refuse(scope, receive, send, already_read=size)
                else:
                    await self._too_large().response(anthropic=is_anthropic(scope))(
                        scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self) -> APIError:
        return APIError(413, f"Request body too large: the limit is {self.max_bytes} bytes.",
                        code="request_too_large")

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, already_read: int) -> None:
        drained = already_read
        while drained <= _DRAIN_FACTOR * self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            drained += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        headers = {"Connection": "close"}
        await self._too_large().response(headers=headers, anthropic=is_anthropic(scope))(
            scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


def _first_headers(scope: Scope) -> dict[bytes, bytes]:
    """The request's headers by (lower-case) name; of a repeated one the first counts,
    as Starlette's Headers.get reads it."""
    return dict(reversed(list(scope.get("headers", ()))))


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the buffered body once, then the client's later messages
    (a streaming response listens on them for the client's disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# Paths that need the API key: the API and SageMaker's route into it (/invocations),
# the one endpoint outside it that changes the server's state, the one that shows the
# tokens of cached prompts, and those that show the chat template (which may hold an
# operator's private system prompt): /tokenizer_info, and /tokenize with /detokenize,
# which render it and read it back. vLLM leaves /invocations and the last three open.
_GUARDED_PREFIXES = ("/v1", "/invocations", "/reset_prefix_cache", "/kv_cache_events",
                     "/tokenizer_info", "/tokenize", "/detokenize")
# Those that concern every tenant: the stream of every cached prompt's tokens (and salts),
# and the reset that empties everyone's cache. With admin keys, only those open them.
_ADMIN_PREFIXES = ("/reset_prefix_cache", "/kv_cache_events")


class APIKeyMiddleware:
    """401 for any /v1 request (and the other guarded paths) without `Authorization:
    Bearer <api key>` or, as Anthropic's clients send it, `x-api-key: <api key>`, for
    one of the keys (several, as vLLM takes them, let keys be rotated). With
    `admin_keys`, the cache's event stream and reset take one of those instead (and no
    client key): a server shared by tenants keeps them for the operator and the router.

    /health and /metrics stay open: load balancers and Prometheus probe them without
    credentials, and they reveal no request data.
    """

    def __init__(self, app: ASGIApp, api_keys: Sequence[str] | None,
                 admin_keys: Sequence[str] | None = None) -> None:
        self.app = app
        self.keys = None if api_keys is None else [key.encode() for key in api_keys]
        self.admin_keys = None if admin_keys is None else [key.encode() for key in admin_keys]

    def _keys_for(self, path: str) -> list[bytes] | None:
        if self.admin_keys is not None and path.startswith(_ADMIN_PREFIXES):
            return self.admin_keys
        return self.keys if path.startswith(_GUARDED_PREFIXES) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A CORS preflight (OPTIONS) carries no credentials and reads nothing, as vLLM
        # lets it through.
        keys = self._keys_for(route_path(scope)) if scope["type"] == "http" else None
        if keys is not None and scope.get("method") != "OPTIONS":
            headers = _first_headers(scope)
            scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer":  # the scheme's case does not matter (RFC 7235)
                bearer = b""
            given = headers.get(b"x-api-key", b"")
            # Every key is compared, so the time taken tells nothing about which matched.
            if not any([hmac.compare_digest(bearer, key) | hmac.compare_digest(given, key)
                        for key in keys]):
                error = APIError(401, "Incorrect API key provided." if keys is not self.admin_keys
                                 else "This endpoint needs an admin API key (--admin-api-key).",
                                 code="invalid_api_key")
                await error.response(anthropic=is_anthropic(scope))(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """vLLM's --enable-request-id-headers: every answer of the app (an unexpected 500,
    written outside it, aside) carries `X-Request-Id`, the one the client sent or a new
    one, for a client or proxy to match answers to requests in its logs."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _first_headers(scope).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


# The endpoints that run the model, whose requests vLLM's server_load counts.
_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses",
                               "/v1/messages", "/invocations"})


@dataclass
class ServerLoad:
    """vLLM's server_load: the generation requests in flight, from arrival to their last
    byte (a stream's too), which load balancers poll at GET /load to pick a server."""

    requests: int = 0


class LoadTrackingMiddleware:
    """Counts a POST to a generation endpoint in `load` while the app handles it."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope.get("method") != "POST"
                or route_path(scope) not in _GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        self.load.requests += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.requests -= 1
