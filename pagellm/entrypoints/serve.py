"""`pagellm serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.chat_template import CONTENT_FORMATS
from pagellm.entrypoints.engine_args import (
    add_chat_template_arg,
    add_engine_args,
    byte_size,
    json_object,
    whole_number,
)
from pagellm.model.resolve import looks_like_model, served_model_name

if TYPE_CHECKING:
    from pagellm.entrypoints.openai.api_server import ServerSettings


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/responses and "
                    "/v1/models over HTTP, OpenAI-compatible, Anthropic's /v1/messages, "
                    "vLLM's /tokenize, /detokenize and /reset_prefix_cache, /health, "
                    "/metrics (Prometheus) and /version, and with --enable-kv-cache-events "
                    "/kv_cache_events.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (same as --model)")
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                       help="address to bind (default: %(default)s)")
    group.add_argument("--port", type=whole_number(0, 65535), default=8000, metavar="PORT",
                       help="port to bind (default: %(default)s)")
    group.add_argument("--uds", default=None, metavar="PATH",
                       help="listen on this Unix domain socket instead of --host and --port")
    add_answer_args(group)
    group.add_argument("--api-key", nargs="+", metavar="KEY", default=None,
                       help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1 "
                            "requests and the endpoints that show or change the cache or "
                            "the template, for one of these keys (default: "
                            "$PAGELLM_API_KEY, else vLLM's $VLLM_API_KEY, else no key)")
    group.add_argument("--admin-api-key", nargs="+", metavar="KEY", default=None,
                       help="require one of these keys instead on the prefix cache's event "
                            "stream and reset (/kv_cache_events, /reset_prefix_cache), "
                            "which concern every tenant: --api-key's keys then do not "
                            "open them (default: $PAGELLM_ADMIN_API_KEY, else none)")
    group.add_argument("--max-request-bytes", type=byte_size, default="8MiB", metavar="SIZE",
                       help="largest request body accepted, larger gets 413 "
                            "(default: %(default)s)")
    group.add_argument("--log-stats-interval", type=_seconds(positive=True), default=5.0,
                       metavar="S",
                       help="seconds between stats log lines while busy (default: %(default)s)")
    group.add_argument("--disable-log-stats", action="store_true",
                       help="no stats log lines (vLLM's name; /metrics still counts)")
    group.add_argument("--shutdown-timeout", type=_seconds(positive=False), default=10,
                       metavar="S",
                       help="on SIGINT/SIGTERM, seconds running requests get to finish "
                            "before they are aborted (default: %(default)s)")
    group.add_argument("--allowed-origins", type=_json_strings, default=[], metavar="JSON",
                       help='origins browsers may call from, as a JSON list (vLLM\'s), e.g. '
                            '\'["https://app.example"]\' or \'["*"]\' (default: none)')
    group.add_argument("--allow-credentials", action="store_true",
                       help="let cross-origin browser requests carry credentials")
    group.add_argument("--allowed-methods", type=_json_strings, default=["*"], metavar="JSON",
                       help="HTTP methods allowed cross-origin, a JSON list (default: all)")
    group.add_argument("--allowed-headers", type=_json_strings, default=["*"], metavar="JSON",
                       help="request headers allowed cross-origin, a JSON list (default: all)")
    group.add_argument("--enable-kv-cache-events", action="store_true",
                       help="stream the prefix cache's changes (blocks stored, evicted, "
                            "cleared) at GET /kv_cache_events, for prefix-aware routers")
    group.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve GET /tokenizer_info: the tokenizer's configuration and "
                            "chat template (vLLM's; lm-evaluation-harness's remote "
                            "tokenizer reads it)")
    group.add_argument("--enable-log-requests", action="store_true",
                       help="log each request as it arrives (prompt tokens, sampling) and "
                            "as it ends (prompt tokens from the prefix cache, tokens "
                            "generated, first-token and total time)")
    group.add_argument("--enable-log-outputs", action="store_true",
                       help="--enable-log-requests, and the log line of a request's end "
                            "holds the text it generated")
    group.add_argument("--max-log-len", type=whole_number(0), default=None, metavar="N",
                       help="characters of generated text a log line holds at most "
                            "(default: all)")
    # vLLM's older flag for what is now the default (no request log lines).
    group.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="usage in every streamed answer, on each chunk too, whatever "
                            "the request's stream_options say")
    group.add_argument("--sse-keep-alive-interval", type=_seconds(positive=False), default=0,
                       metavar="S",
                       help="send an SSE comment on a stream silent this many seconds "
                            "(queued, in a long prefill, between slow tokens), so proxies "
                            "with read timeouts keep it open (default: 0, never)")
    group.add_argument("--enable-request-id-headers", action="store_true",
                       help="every answer carries X-Request-Id: the client's, or a new one")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="uvicorn's log level (default: --log-level); at debug or trace "
                            "it logs every request line")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no request lines, whatever the log level")
    group.add_argument("--disable-access-log-for-endpoints", type=_paths, default=[],
                       metavar="PATHS",
                       help="no request lines for these comma-separated paths, e.g. "
                            "/health,/metrics,/ping")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="serve GET /load: the generation requests in flight (vLLM's "
                            "server_load, which load balancers poll)")
    group.add_argument("--disable-fastapi-docs", action="store_true",
                       help="no /docs, /redoc or /openapi.json pages")
    group.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix a proxy serves the app under (ASGI root_path)")
    group.add_argument("--ssl-keyfile", type=_readable_file, default=None, metavar="FILE",
                       help="serve HTTPS with this private key (with --ssl-certfile)")
    group.add_argument("--ssl-certfile", type=_readable_file, default=None, metavar="FILE",
                       help="serve HTTPS with this certificate")
    group.add_argument("--ssl-ca-certs", type=_readable_file, default=None, metavar="FILE",
                       help="CA certificates to check client certificates against (with "
                            "--ssl-cert-reqs)")
    group.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                       help="ask clients for a certificate: 0 no, 1 optional, 2 required "
                            "(Python's ssl.CERT_*; default: %(default)s)")
    group.add_argument("--log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug"),
                       help="server log level (default: %(default)s)")
    add_chat_template_arg(parser)
    add_engine_args(parser)


def add_answer_args(group: Any) -> None:
    """The options that shape the API's answers, shared by serve and run-batch: the
    model's names and the parsers of its tool calls and reasoning."""
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) requests use; the first is reported in responses "
                            "(default: the model path's name)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='answer tool_choice "auto" (the default with tools), reading the '
                            "model's tool calls with --tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the model's tool-call syntax: hermes (<tool_call> blocks: "
                            "Qwen2.5, Qwen3, Hermes, ...) or llama3_json (Llama 3.1-3.3)")
    group.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="the model's reasoning syntax, read into chat's `reasoning`: "
                            "deepseek_r1 (<think> ... </think>: DeepSeek R1 and its distills)")
    group.add_argument("--chat-template-content-format", default="auto",
                       choices=CONTENT_FORMATS,
                       help="a message's content as the chat template gets it: one string, "
                            "or OpenAI's list of text parts (openai); auto picks openai "
                            "for a template that loops over a message's content "
                            "(default: %(default)s)")
    group.add_argument("--response-role", default="assistant", metavar="ROLE",
                       help="the role of chat answers to a conversation ending with the "
                            "generation prompt (default: %(default)s)")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='with tool_choice "none", the tools are left out of the prompt '
                            "(by default the template still shows them)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name each token `token_id:N` (requests may say "
                            "otherwise with the field of that name)")
    group.add_argument("--default-chat-template-kwargs", type=json_object, default={},
                       metavar="JSON",
                       help="chat template variables for every request, under a request's "
                            "own chat_template_kwargs, e.g. '{\"enable_thinking\": false}'")
    # vLLM's switch for usage.prompt_tokens_details: PageLLM always reports the prompt
    # tokens served from the prefix cache there, so the flag is taken and changes nothing.
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help=argparse.SUPPRESS)


def take_model_tag(args: argparse.Namespace) -> None:
    """`pagellm serve MODEL` is `--model MODEL`; both, disagreeing, is an error."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model "
                         f"{args.model!r}")
    args.model = args.model_tag


def check_parser_args(args: argparse.Namespace) -> None:
    """The parser names, and vLLM's rule: --enable-auto-tool-choice needs
    --tool-call-parser (a parser alone leaves "auto" refused)."""
    from pagellm.entrypoints.openai.tool_calls import TOOL_CALL_PARSERS

    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                         f"got {args.tool_call_parser!r}")
    from pagellm.entrypoints.openai.reasoning import REASONING_PARSERS

    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
                         f"got {args.reasoning_parser!r}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the model's "
                         "tool-call syntax, e.g. hermes)")


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings, as vLLM takes its CORS options."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f'not a JSON list of strings: {text[:100]!r} (example: '
                                         '\'["https://app.example"]\')')
    return value


def _api_keys(given: list[str] | None, model: str | None,
              option: str = "--api-key") -> list[str] | None:
    """The keys to ask for, without empty ones; `--api-key ""` alone (an unset variable
    in `--api-key "$KEY"`) is refused rather than leaving the server open, and so is a
    model taken for a key (`--api-key KEY MODEL`: the keys run to the next option, as in
    vLLM), which would serve the default model instead."""
    if given is None:
        return None
    if model is None and len(given) > 1 and looks_like_model(given[-1]):
        raise ValueError(f"{option} takes every word after it as a key, {given[-1]!r} "
                         f"too: give the model first (pagellm serve MODEL {option} KEY)")
    keys = [key for key in given if key]
    if not keys:
        raise ValueError(f"{option} is given, but empty: give a key, or leave the option "
                         "out to serve without one")
    return keys


def _environment_keys(*names: str) -> list[str] | None:
    """The key in the first of these variables that is set. Set but empty (an empty
    Kubernetes secret, `KEY=` in a compose file) is refused as `--api-key ""` is, rather
    than serving without a key; a trailing newline (a secret made from a file) is no part
    of a key anyone sends."""
    for name in names:
        if name in os.environ:
            key = os.environ[name].strip()
            if not key:
                raise ValueError(f"${name} is set, but empty: give a key, or unset it to "
                                 "serve without one")
            return [key]
    return None


def _paths(text: str) -> list[str]:
    """vLLM's comma-separated list of URL paths, each starting with '/'."""
    paths = [path.strip() for path in text.split(",") if path.strip()]
    bad = [path for path in paths if not path.startswith("/")]
    if bad:
        raise argparse.ArgumentTypeError(f"paths must start with '/': {', '.join(bad)}")
    return paths


def _readable_file(text: str) -> str:
    """A file checked before the model loads, not after."""
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"not a readable file: {text!r}")
    return text


def _seconds(positive: bool) -> Callable[[str], float]:
    """A duration option: > 0 where 0 would mean a busy loop, else >= 0."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (value > 0 if positive else value >= 0) or math.isinf(value):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(f"seconds must be a number {bound}, got {text!r}")
        return value
    return parse


def bind(args: argparse.Namespace) -> socket.socket:
    """The server's socket, bound before the model loads (as vLLM does): a taken port or
    an address this machine does not have fails at once instead of after the load, and
    no other process can take the port meanwhile. Raises OSError naming the address."""
    if args.uds is not None:
        return _bind_unix(args.uds)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as error:
        raise OSError(f"cannot listen on {args.host}:{args.port}: {error}") from error
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {args.host}:{args.port}: {error}") from error
    return sock


def _bind_unix(path: str) -> socket.socket:
    """A Unix domain socket at `path`, listening at once (connections wait in its
    backlog until the model has loaded), so another server started meanwhile finds it
    taken; any local user may connect (use --api-key to ask for a key). A socket file
    left by a server that is gone is replaced; one a server listens on, or a file of
    another kind, is not."""
    try:
        if os.path.exists(path):
            if not stat.S_ISSOCK(os.stat(path).st_mode):
                raise OSError("it exists and is not a socket")
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(path)
                except ConnectionRefusedError:
                    os.unlink(path)
                else:
                    raise OSError("another server is listening on it")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Open to every local user, as uvicorn's own --uds leaves it and as a port on
            # 127.0.0.1 is: a proxy's workers (nginx's run as nobody) must connect.
            os.chmod(path, 0o666)
            sock.listen()
        except OSError:
            sock.close()
            raise
    except OSError as error:
        raise OSError(f"cannot listen on {path}: {error}") from error
    return sock


def unix_file(sock: socket.socket) -> tuple[str, tuple[int, int]] | None:
    """A Unix socket's file as bound: its path, and its inode and creation time (an
    inode number is reused at once by the next file) to know it again; None for TCP."""
    if sock.family != socket.AF_UNIX:
        return None
    path = sock.getsockname()
    return path, _identity(path)


def remove_unix_file(file: tuple[str, tuple[int, int]] | None) -> None:
    """Removes the socket file the server bound, unless it is gone or another server's
    has replaced it since."""
    if file is None:
        return
    path, identity = file
    with contextlib.suppress(FileNotFoundError):
        if _identity(path) == identity:
            os.unlink(path)


def _identity(path: str) -> tuple[int, int]:
    status = os.stat(path)
    return status.st_ino, status.st_ctime_ns


def address_of(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}"
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def served_model_names(args: argparse.Namespace) -> list[str]:
    """The names the server lists and answers to: --served-model-name's, else the model's
    short name."""
    if args.served_model_name:
        return list(args.served_model_name)
    return [served_model_name(args.model)]


def model_aliases(args: argparse.Namespace) -> list[str]:
    """Without --served-model-name, the model as given, which vLLM serves it under and so
    its clients send (`"model": "/models/Qwen3-0.6B"`): answered to, not listed, so a
    model picker shows the model once."""
    if args.served_model_name or not args.model or args.model in served_model_names(args):
        return []
    return [args.model]


def answer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ServerSettings of `add_answer_args`' options (vLLM's rule: the tool-call
    parser reads "auto" calls only with --enable-auto-tool-choice)."""
    return {"model_names": served_model_names(args), "model_aliases": model_aliases(args),
            "tool_call_parser": args.tool_call_parser if args.enable_auto_tool_choice else None,
            "reasoning_parser": args.reasoning_parser,
            "response_role": args.response_role,
            "chat_template_content_format": args.chat_template_content_format,
            "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none,
            "return_tokens_as_token_ids": args.return_tokens_as_token_ids,
            "default_chat_template_kwargs": args.default_chat_template_kwargs}


def server_settings(args: argparse.Namespace, launch_time: float, address: str
                    ) -> ServerSettings:
    # Imported here so the offline subcommands work without the server extra installed.
    from pagellm.entrypoints.openai.api_server import ServerSettings

    return ServerSettings(
        **answer_settings(args), host=args.host, port=args.port,
        api_key=(_environment_keys("PAGELLM_API_KEY", "VLLM_API_KEY")
                 if args.api_key is None else _api_keys(args.api_key, args.model)),
        admin_api_key=(_environment_keys("PAGELLM_ADMIN_API_KEY")
                       if args.admin_api_key is None
                       else _api_keys(args.admin_api_key, args.model, "--admin-api-key")),
        max_request_bytes=args.max_request_bytes,
        log_stats_interval=None if args.disable_log_stats else args.log_stats_interval,
        shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
        allowed_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
        enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_log_requests=args.enable_log_requests,
        enable_log_outputs=args.enable_log_outputs, max_log_len=args.max_log_len,
        enable_server_load_tracking=args.enable_server_load_tracking,
        sse_keep_alive_interval=args.sse_keep_alive_interval or None,
        enable_force_include_usage=args.enable_force_include_usage,
        enable_request_id_headers=args.enable_request_id_headers,
        uvicorn_log_level=args.uvicorn_log_level,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        disable_access_log_for_endpoints=args.disable_access_log_for_endpoints,
        disable_fastapi_docs=args.disable_fastapi_docs, root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        launch_time=launch_time, address=address)


def run(engine: AsyncLLMEngine, settings: ServerSettings, sock: socket.socket) -> int:
    from pagellm.entrypoints.openai.api_server import run_server

    file = unix_file(sock)
    try:
        run_server(engine, settings, sock)
    finally:
        remove_unix_file(file)  # uvicorn closes the socket but leaves its file
    return 0
