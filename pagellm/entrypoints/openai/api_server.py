"""The OpenAI-compatible HTTP server: routes, middleware, lifespan, and running uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import math
import signal
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from starlette.middleware.cors import CORSMiddleware

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.chat_template import ContentFormat, check_template_kwargs
from pagellm.entrypoints.openai.errors import (
    APIError,
    bad_request,
    failure,
    install_error_handlers,
    unreadable_body,
    validated,
    validation_error,
)
from pagellm.entrypoints.openai.http_metrics import HttpMetricsMiddleware
from pagellm.entrypoints.openai.json_text import JSONResponse
from pagellm.entrypoints.openai.messages_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
)
from pagellm.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from pagellm.entrypoints.openai.middleware import (
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    LoadTrackingMiddleware,
    RequestIdMiddleware,
    ServerLoad,
)
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.responses_protocol import (
    DeletedResponse,
    InputItemList,
    ResponseObject,
    ResponsesRequest,
)
from pagellm.entrypoints.openai.serving import ServerContext
from pagellm.entrypoints.openai.serving_chat import create_chat_completion
from pagellm.entrypoints.openai.serving_completion import create_completion
from pagellm.entrypoints.openai.serving_kv_events import kv_events_stream
from pagellm.entrypoints.openai.serving_messages import count_tokens, create_message
from pagellm.entrypoints.openai.serving_responses import (
    cancel_response,
    create_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from pagellm.entrypoints.openai.serving_tokenization import (
    detokenize,
    tokenize,
    tokenizer_info,
)
from pagellm.entrypoints.openai.stats_logger import log_stats_forever
from pagellm.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS

logger = logging.getLogger("pagellm.server")

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
# How long after aborting the unfinished requests uvicorn waits for their handlers to
# return before it cancels them.
_SHUTDOWN_BACKSTOP_S = 5


@dataclass
class ServerSettings:
    """How the server listens and guards itself (the engine is configured separately)."""

    model_names: list[str]
    # Other names requests may give, not listed (the model path as given: vLLM's name).
    model_aliases: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | list[str] | None = None  # one key or several (vLLM's list), non-empty
    admin_api_key: list[str] | None = None  # for the cache's event stream and reset
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    log_stats_interval: float | None = 5.0  # None: no stats log lines
    shutdown_timeout: float = 10
    log_level: str = "info"
    tool_call_parser: str | None = None  # --enable-auto-tool-choice --tool-call-parser
    reasoning_parser: str | None = None  # --reasoning-parser
    response_role: str = "assistant"  # chat answers' role (vLLM's --response-role)
    chat_template_content_format: ContentFormat = "auto"  # see ChatOptions
    # vLLM's: tool_choice "none" leaves the tools out of the prompt, not only uncalled.
    exclude_tools_when_tool_choice_none: bool = False
    # vLLM's CORS options: no origin allowed by default (no cross-origin browser access).
    allowed_origins: list[str] = field(default_factory=list)
    allow_credentials: bool = False
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (vLLM's option)
    # vLLM's request log: a line per request as it arrives and ends, the end's with the
    # generated text (at most max_log_len characters of it) if enable_log_outputs, which
    # turns the log on too.
    enable_log_requests: bool = False
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    enable_server_load_tracking: bool = False  # GET /load (vLLM's option)
    # Seconds a stream may be silent before an SSE comment keeps proxies from closing it.
    sse_keep_alive_interval: float | None = None
    # vLLM's answer defaults: logprobs' tokens as `token_id:N` unless a request says,
    # usage in every stream (on each chunk too), chat template variables under a
    # request's own.
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_request_id_headers: bool = False  # X-Request-Id on every answer (vLLM's)
    # vLLM's HTTP options: uvicorn's log level (else log_level), its access log
    # (on at debug unless disabled), FastAPI's /docs pages, the path a proxy mounts the
    # app under, and HTTPS.
    uvicorn_log_level: str | None = None
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: list[str] = field(default_factory=list)
    disable_fastapi_docs: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = ssl.CERT_NONE  # ask clients for certificates (vLLM's option)
    launch_time: float = field(default_factory=time.perf_counter)
    # host:port as bound (the real port when --port 0 let the OS choose), for the log.
    address: str = ""

    def __post_init__(self) -> None:
        # An interval of 0 would make the stats logger a busy loop.
        if self.log_stats_interval is not None and not self.log_stats_interval > 0:
            raise ValueError(f"log_stats_interval must be > 0 or None, got "
                             f"{self.log_stats_interval!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0 or None, got {self.max_log_len!r}")
        if self.sse_keep_alive_interval is not None and not self.sse_keep_alive_interval > 0:
            raise ValueError(f"sse_keep_alive_interval must be > 0 or None, got "
                             f"{self.sse_keep_alive_interval!r}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout!r}")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)} "
                             f"or None, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} "
                             f"or None, got {self.reasoning_parser!r}")
        keys = self.api_keys
        if keys is not None and (not keys or not all(keys)):
            raise ValueError("api_key must be a non-empty key or a list of them, or None to "
                             "serve without one")
        admin = self.admin_api_key
        if admin is not None and (not admin or not all(admin)):
            raise ValueError("admin_api_key must be a non-empty list of keys, or None")
        check_template_kwargs(self.default_chat_template_kwargs,
                              "default_chat_template_kwargs (--default-chat-template-kwargs)")
        asks_client = self.ssl_cert_reqs != ssl.CERT_NONE
        if (self.ssl_keyfile or self.ssl_ca_certs or asks_client) and not self.ssl_certfile:
            raise ValueError("HTTPS needs a certificate: ssl_keyfile / ssl_ca_certs / "
                             "ssl_cert_reqs (--ssl-keyfile / --ssl-ca-certs / "
                             "--ssl-cert-reqs) were given without ssl_certfile "
                             "(--ssl-certfile)")
        if asks_client and not self.ssl_ca_certs:
            raise ValueError("ssl_cert_reqs (--ssl-cert-reqs) asks clients for certificates, "
                             "which need ssl_ca_certs (--ssl-ca-certs) to be checked against")
        if self.ssl_certfile:
            self._check_tls()

    @property
    def api_keys(self) -> list[str] | None:
        """The keys asked for, as a list (api_key may be one)."""
        return [self.api_key] if isinstance(self.api_key, str) else self.api_key

    def _check_tls(self) -> None:
        """Loads the certificate, key and CAs as uvicorn will, so that a bad file fails
        before the model loads, not after."""
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 "
                             f"(required), got {self.ssl_cert_reqs!r}")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(str(self.ssl_certfile), self.ssl_keyfile)
            if self.ssl_ca_certs:
                context.load_verify_locations(self.ssl_ca_certs)
        except (ssl.SSLError, OSError) as error:
            raise ValueError(f"cannot serve HTTPS with --ssl-certfile {self.ssl_certfile}"
                             f"{f' --ssl-keyfile {self.ssl_keyfile}' if self.ssl_keyfile else ''}"
                             f": {error}") from error


def _access(settings: ServerSettings) -> str:
    """Who may call, for the ready line: an operator sees at once that a key they meant
    to give (an empty secret, a misspelt variable) did not arrive."""
    keys = settings.api_keys
    access = (f"API key required, {len(keys)} accepted" if keys
              else "no API key: open to every client that reaches it")
    if settings.admin_api_key:
        access += "; an admin key for the cache's events and reset"
    return access


def create_app(engine: AsyncLLMEngine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving `engine`; shutting the app down shuts the engine down."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stats_task = (None if settings.log_stats_interval is None else
                      asyncio.create_task(log_stats_forever(engine, settings.log_stats_interval)))
        logger.info("PageLLM server ready in %.2f s, serving %s on %s://%s (%s)",
                    time.perf_counter() - settings.launch_time, ", ".join(settings.model_names),
                    "https" if settings.ssl_certfile else "http", settings.address,
                    _access(settings))
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            context.tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(engine.shutdown)
            logger.info("shutting down: engine stopped")

    docs: dict[str, Any] = {} if not settings.disable_fastapi_docs else {
        "docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="PageLLM OpenAI-compatible API", lifespan=lifespan,
                  default_response_class=JSONResponse, **docs)
    # The root path is the app's, set as vLLM sets it (FastAPI's argument for it is
    # deprecated), so a request reaches its route with or without the prefix: through
    # a proxy that strips it or one that does not.
    app.root_path = settings.root_path
    _document_errors(app)
    context = ServerContext(
        engine, list(settings.model_names),
        ServerMetrics(engine, settings.model_names[0], settings.enable_log_requests,
                      settings.enable_log_outputs, settings.max_log_len),
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        return_tokens_as_token_ids=settings.return_tokens_as_token_ids,
        force_include_usage=settings.enable_force_include_usage,
        default_chat_template_kwargs=dict(settings.default_chat_template_kwargs),
        response_role=settings.response_role,
        chat_template_content_format=settings.chat_template_content_format,
        exclude_tools_when_tool_choice_none=settings.exclude_tools_when_tool_choice_none,
        sse_keep_alive=settings.sse_keep_alive_interval,
        model_aliases=list(settings.model_aliases))
    stored = ResponseStore()
    install_error_handlers(app)
    load = ServerLoad()
    if settings.enable_server_load_tracking:  # inside the guards: what they refuse is no load
        app.add_middleware(LoadTrackingMiddleware, load=load)

        @app.get("/load")
        async def server_load() -> Response:
            return JSONResponse({"server_load": load.requests})

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_keys is not None or settings.admin_api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_keys=settings.api_keys,
                           admin_keys=settings.admin_api_key)
    # Outside the guards, so their 401s and 413s are counted too (vLLM's instrumentator).
    app.add_middleware(HttpMetricsMiddleware, metrics=context.metrics.http)
    if settings.allowed_origins:
        # Outside the key guard: a browser's preflight is answered before the key is
        # asked for (it carries none), and the other answers, a 401 too, carry the CORS
        # headers.
        app.add_middleware(CORSMiddleware, allow_origins=settings.allowed_origins,
                           allow_credentials=settings.allow_credentials,
                           allow_methods=settings.allowed_methods,
                           allow_headers=settings.allowed_headers)
    if settings.enable_request_id_headers:  # outermost: every answer carries it
        app.add_middleware(RequestIdMiddleware)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _guarded(create_completion(context, body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _guarded(create_chat_completion(context, body, request))

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's inference route, as vLLM serves it: a body with messages is a
        chat request, one with a prompt a completion request."""
        body = await _json_body(request)
        if isinstance(body, dict) and "messages" in body:
            return await _guarded(create_chat_completion(
                context, validated(ChatCompletionRequest, body), request))
        if isinstance(body, dict) and "prompt" in body:
            return await _guarded(create_completion(
                context, validated(CompletionRequest, body), request))
        raise bad_request("/invocations takes a chat completion request (with messages) "
                          "or a completion request (with prompt)")

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await _guarded(create_response(context, stored, body, request))

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> ResponseObject:
        return retrieve_response(stored, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(response_id: str, after: str | None = None, limit: int = 20,
                              order: str = "desc") -> InputItemList:
        return list_input_items(stored, response_id, after, limit, order)

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(response_id: str) -> DeletedResponse:
        return delete_response(stored, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> ResponseObject:
        return cancel_response(stored, response_id)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await _guarded(create_message(context, body, request))

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(context, body)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.engine.model_root,
                                         max_model_len=engine.max_model_len)
                               for name in context.model_names])

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> ModelCard:
        context.check_model(name, named=True)
        return ModelCard(id=name, root=engine.engine.model_root,
                         max_model_len=engine.max_model_len)

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(context, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(context, body)

    if settings.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info_route() -> Response:
            return JSONResponse(tokenizer_info(context.engine.tokenizer))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False) -> Response:
        """vLLM's (in its dev mode): a cold cache for the next measurement. It fails
        (`success` false) while requests hold blocks, unless
        `?reset_running_requests=true` preempts them; the caller may retry."""
        return JSONResponse({"success": await engine.reset_prefix_cache(
            reset_running_requests)})

    @app.get("/kv_cache_events")
    async def kv_cache_events() -> Response:
        return kv_events_stream(engine)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": importlib.metadata.version("pagellm")})

    # /ping is vLLM's second name for it (SageMaker probes GET and POST /ping).
    @app.get("/health")
    @app.get("/ping")
    @app.post("/ping")
    async def health() -> Response:
        if not engine.is_running:
            raise APIError(503, "The engine is not running.")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(context.metrics.render(), media_type=CONTENT_TYPE)

    return app


def _document_errors(app: FastAPI) -> None:
    """The OpenAPI document as the server answers: a request it cannot take is a 400 in
    OpenAI's error shape (ErrorResponse), not FastAPI's 422, which it never sends."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            error = {"description": "Bad Request", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for operation in (op for path in schema.get("paths", {}).values()
                              for op in path.values()):
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses["400"] = error
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            described = ErrorResponse.model_json_schema(
                ref_template="#/components/schemas/{model}")
            schemas.update(described.pop("$defs", {}), ErrorResponse=described)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


async def _json_body(request: Request) -> Any:
    """The request's JSON, with the 400s FastAPI's routes give a body they cannot read."""
    body = await request.body()
    if not body:
        raise validation_error([{"type": "missing", "loc": ("body",)}])
    try:
        return json.loads(body)
    except json.JSONDecodeError as error:
        raise validation_error([{"type": "json_invalid", "loc": ("body", error.pos),
                                 "ctx": {"error": error.msg}}]) from error
    except (UnicodeDecodeError, RecursionError) as error:
        raise bad_request(unreadable_body(error) or str(error)) from error


async def _guarded(handler: Awaitable[Response]) -> Response:
    """Any unexpected failure of one request becomes that request's 500, logged once;
    left to Starlette it would also be re-raised into the server and logged again."""
    try:
        return await handler
    except APIError:
        raise
    except Exception as error:  # noqa: BLE001 - one request's bug must not escape
        raise failure(error) from error


@contextlib.contextmanager
def _signals_end_gracefully() -> Iterator[None]:
    """After its graceful shutdown uvicorn raises the signal it caught again, so the
    process would die by SIGTERM (or KeyboardInterrupt) although everything finished
    cleanly; with these handlers in place the re-raised signal is a no-op and the process
    exits 0, which is what supervisors read as a clean stop."""
    previous = {sig: signal.signal(sig, lambda *_: None)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _GracefulServer(uvicorn.Server):
    """uvicorn, but requests still running when the grace period ends are aborted through
    the engine instead of having their tasks cancelled.

    Aborted that way, a stream ends with an error event and `[DONE]`, a non-streamed
    request gets a 503, and every handler returns normally; uvicorn's own cancellation
    (kept as a backstop) would cut connections mid-response and log each as a crash.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.engine.kv_events is not None:
            self.engine.kv_events.close()  # a follower's stream never ends by itself
        aborter = asyncio.create_task(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
            if self.force_exit:
                await self._end_forced()
        finally:
            aborter.cancel()

    async def _abort_after_grace(self) -> None:
        """Aborts what still runs when the grace period ends, or at once on a second
        Ctrl-C (uvicorn's force exit)."""
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        logger.info("shutting down: %s, aborting unfinished requests",
                    "forced" if self.force_exit else "grace period over")
        await asyncio.to_thread(self.engine.shutdown)

    async def _end_forced(self) -> None:
        """On a force exit uvicorn stops waiting for handlers and skips the app's
        shutdown, so the handlers would be cancelled mid-response (each logged as a
        crash, and streams cut without `[DONE]`). Instead the requests are aborted, the
        handlers get a moment to write their last event, and the app shuts down."""
        await asyncio.to_thread(self.engine.shutdown)
        deadline = time.monotonic() + _SHUTDOWN_BACKSTOP_S
        while self.server_state.tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.lifespan.shutdown()


class _AccessLogFilter(logging.Filter):
    """Drops uvicorn's request lines for some paths (health probes, say), whatever their
    query string."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3:
            return str(args[2]).split("?", 1)[0] not in self.paths
        return True


def run_server(engine: AsyncLLMEngine, settings: ServerSettings, sock: socket.socket
               ) -> None:
    """Serves until SIGINT/SIGTERM: uvicorn stops accepting, running requests get
    `shutdown_timeout` seconds to finish, the rest are aborted, then the engine stops.
    `sock` is already bound to the settings' address (see `serve.bind`)."""
    config = uvicorn.Config(
        create_app(engine, settings), host=settings.host, port=settings.port,
        log_level=settings.uvicorn_log_level or settings.log_level,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout) + _SHUTDOWN_BACKSTOP_S,
        access_log=(settings.uvicorn_log_level or settings.log_level) in ("debug", "trace")
        and not settings.disable_uvicorn_access_log,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile, ssl_ca_certs=settings.ssl_ca_certs,
        ssl_cert_reqs=settings.ssl_cert_reqs)
    if settings.disable_access_log_for_endpoints:
        # After the Config, whose logging set-up would otherwise replace the filter.
        logging.getLogger("uvicorn.access").addFilter(
            _AccessLogFilter(settings.disable_access_log_for_endpoints))
    with _signals_end_gracefully():
        _GracefulServer(config, engine, settings.shutdown_timeout).run(sockets=[sock])


if __name__ == "__main__":
    # vLLM's older entry point, `python -m vllm.entrypoints.openai.api_server --model M`,
    # which Dockerfiles and Kubernetes manifests still run: `pagellm serve` with the same
    # options, rather than a module that loads and exits 0 serving nothing.
    import sys

    from pagellm.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
