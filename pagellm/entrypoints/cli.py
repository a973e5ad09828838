"""The `pagellm` command: serve, run-batch, generate, chat, bench.

serve, run-batch, generate and chat take the engine options (one definition, in
engine_args) plus their own; options are validated before the model loads, so a typo fails in
milliseconds, and a model that cannot load ends with one clear line instead of a
traceback. bench builds its own engines (one per contender) from its own options.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pagellm
from pagellm.bench.cli import add_bench_parser, run_bench
from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.engine.chat_template import load_chat_template, use_chat_template
from pagellm.engine.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints import chat, generate, run_batch, serve
from pagellm.entrypoints.config_file import with_config_file
from pagellm.entrypoints.engine_args import EngineArgs, dashed_flags, unrecognized
from pagellm.entrypoints.sampling_args import sampling_params_from_args
from pagellm.logger import LOG_FORMAT
from pagellm.model import cpu_kernels, file_lock, gguf_loader

logger = logging.getLogger(__name__)

# The environment variables PageLLM reads (a test checks the source for others).
ENVIRONMENT_VARIABLES = ("PAGELLM_API_KEY", "PAGELLM_ADMIN_API_KEY", "PAGELLM_CACHE_DIR",
                         "PAGELLM_CPU_ISA")


def _warn_unknown_variables() -> None:
    """A misspelt variable (`PAGELLM_APIKEY`) was ignored without a word, leaving a server
    open that was meant to ask for a key; vLLM warns about unknown VLLM_ variables too."""
    for name in sorted(os.environ):
        if name.startswith("PAGELLM_") and name not in ENVIRONMENT_VARIABLES:
            close = difflib.get_close_matches(name, ENVIRONMENT_VARIABLES, n=1)
            logger.warning("unknown environment variable %s, ignored%s", name,
                           f" (did you mean {close[0]}?)" if close else "")


def _non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options given (on the command line or in --config), as vLLM's server logs them
    at start: what a ConfigMap really set is in the log, not only in /v1/models. Keys
    show as '***'."""
    defaults = vars(args.command_parser.parse_args([]))  # typed, as given values are
    given = {name: value for name, value in vars(args).items()
             if name not in ("command", "command_parser")
             and value != defaults.get(name)}
    return {name: "***" if name.endswith("api_key") else value
            for name, value in given.items()}


# vLLM's commands of the same names that are other tools, the arguments that show one
# was meant, and what to say.
_OTHER_TOOLS = {
    "chat": ({"--url", "--quick", "-q", "--model-name", "--system-prompt"},
             "vLLM's `vllm chat` is a client of a running server; `pagellm chat` loads the "
             "model and chats with it itself (any OpenAI client talks to `pagellm serve`)"),
    "bench": ({"serve", "latency", "throughput", "sweep", "startup"},
              "vLLM's `vllm bench serve|latency|throughput` are other tools: `pagellm "
              "bench` runs its own workloads against the engines side by side "
              "(`--workload`), and `vllm bench serve --base-url URL` measures `pagellm "
              "serve` too"),
}


def _other_tool(command: str, unknown: list[str]) -> str:
    """A pointer to what `command` is, where its unrecognized arguments are those of
    vLLM's command of that name."""
    signs, note = _OTHER_TOOLS.get(command, (set(), ""))
    given = {token.split("=")[0] for token in unknown}
    return f"; {note}" if given & signs else ""


def _option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of every command, with its action (argparse keeps them in a
    private map)."""
    commands = [action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction)]
    return {flag: action for choices in commands for command in choices.values()
            for flag, action in command._option_string_actions.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagellm",
        description="PageLLM: LLM inference with a paged KV cache and automatic prefix "
                    "caching.")
    parser.add_argument("--version", action="version",
                        version=f"pagellm {pagellm.__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (serve, run_batch, generate, chat):
        module.add_parser(subparsers)
    add_bench_parser(subparsers)
    for command_parser in subparsers.choices.values():
        # Errors found after parsing are reported with the subcommand's own usage line.
        command_parser.set_defaults(command_parser=command_parser)
        # No prefixes of flags: vLLM's --tokenizer must not be read as --tokenizer-mode.
        command_parser.allow_abbrev = False
        # Read before parsing (see config_file.py); here for --help.
        command_parser.add_argument("--config", metavar="FILE.yaml",
                                    help="options from a YAML file (vLLM's), under those "
                                         "given on the command line")
    return parser


def _runner(args: argparse.Namespace, launch_time: float) -> Callable[[Any], int]:
    """The subcommand to run once the engine is up; checks its own options first."""
    if args.command == "serve":
        serve.check_parser_args(args)
        sock = serve.bind(args)
        try:  # the settings are checked before the model loads, not after
            settings = serve.server_settings(args, launch_time, serve.address_of(sock))
        except ValueError:
            file = serve.unix_file(sock)
            sock.close()
            serve.remove_unix_file(file)
            raise
        return lambda engine: serve.run(engine, settings, sock)
    if args.command == "run-batch":
        run_batch.check_args(args)
        return lambda engine: run_batch.run(args, engine)
    sampling_params_from_args(args)
    if args.command == "generate":
        generate.check_args(args)
    module: Any = generate if args.command == "generate" else chat
    return lambda engine: int(module.run(args, engine))


def _start(args: argparse.Namespace, config: EngineConfig, chat_template: str | None
           ) -> tuple[LLMEngine | AsyncLLMEngine, LLMEngine]:
    """The engine the subcommand runs and the `LLMEngine` inside it: the server's is built
    on the thread that will step it (see `AsyncLLMEngine`). A `--chat-template` is set on
    the tokenizer as part of the build, before the server copies it for its own thread."""

    def build() -> LLMEngine:
        engine = LLMEngine(config)
        if chat_template is not None:
            use_chat_template(engine.tokenizer, chat_template)
        return engine

    if args.command in ("serve", "run-batch"):
        try:
            engine = AsyncLLMEngine(build)
        except KeyboardInterrupt:
            # The build goes on in its thread, inside torch; an interpreter shutdown around
            # it can abort the process, so leave at once with the usual status (and
            # without the compiler the build may have started).
            cpu_kernels.stop_builds()
            print("pagellm: interrupted while starting", file=sys.stderr)
            sys.stderr.flush()
            os._exit(130)
        return engine, engine.engine
    plain = build()
    return plain, plain


def main(argv: Sequence[str] | None = None) -> int:
    launch_time = time.perf_counter()
    parser = build_parser()
    try:  # vLLM's --config FILE.yaml: options kept in a file
        argv = with_config_file(dashed_flags(list(sys.argv[1:] if argv is None else argv)),
                                _option_actions(parser))
    except ValueError as error:
        parser.error(str(error))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported with the subcommand's usage, as its bad values are
        args.command_parser.error(unrecognized(unknown) + _other_tool(args.command, unknown))
    if args.command == "bench":
        with _terminate_as_interrupt():
            try:
                return run_bench(args)
            except KeyboardInterrupt:
                # Contenders and their processes were ended on the way out.
                print(f"pagellm bench: interrupted; no results written (any in "
                      f"{args.output_dir} are an earlier run's)", file=sys.stderr)
                return 130
    level = args.log_level.upper() if args.command == "serve" else "WARNING"
    logging.basicConfig(level=level, format=LOG_FORMAT)
    _warn_unknown_variables()
    if args.command == "serve":
        logger.info("non-default args: %s", _non_default_args(args))
    if args.command != "serve":
        # A first start converts the model and builds the kernels (up to a minute and
        # more): say so, rather than leave the other commands silent that long.
        for first_start in (gguf_loader.logger, file_lock.logger, cpu_kernels.build_logger):
            first_start.setLevel(logging.INFO)
    try:
        if args.command == "serve":
            serve.take_model_tag(args)
        config = EngineArgs.from_cli_args(args)
        template = (None if args.chat_template is None
                    else load_chat_template(args.chat_template))
        run = _runner(args, launch_time)
    except ValueError as error:
        args.command_parser.error(str(error))
    except OSError as error:
        print(f"pagellm: {error}", file=sys.stderr)
        return 1
    with _terminate_as_interrupt():
        try:
            engine, inner = _start(args, config, template)
        except (ValueError, OSError) as error:
            print(f"pagellm: cannot start the engine: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("pagellm: interrupted while starting", file=sys.stderr)
            return 130
        print(f"PageLLM engine ready in {inner.startup_seconds:.2f} s "
              f"({time.perf_counter() - launch_time:.2f} s since launch)", file=sys.stderr)
        try:
            return run(engine)
        except KeyboardInterrupt:
            return 130


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (what Kubernetes and docker stop send) stops the command as Ctrl-C does,
    while the model loads too (as vLLM's server does): a process that is a container's
    PID 1 ignores a signal it has no handler for, so a pod deleted during a cold start
    loaded on until it was killed. The server's own handlers take over once it serves."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt("terminated")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
