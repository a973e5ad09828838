"""`pagellm chat`: an interactive conversation in the terminal.

The whole conversation is re-sent each turn, as an OpenAI client would; the line after
each reply shows how much of that prompt came from the prefix cache, which is the point
of the exercise: every earlier turn should be a hit.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagellm.core.sampling_params import SamplingParams
from pagellm.engine.chat_template import Message, render_chat
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.entrypoints.engine_args import add_chat_template_arg, add_engine_args
from pagellm.entrypoints.sampling_args import add_sampling_args, sampling_params_from_args

HELP = "Commands: /reset clears the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a reply."


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat", help="chat with the model in the terminal",
        description="An interactive chat that keeps the conversation and shows, after each "
                    "reply, how many prompt tokens came from the prefix cache. " + HELP)
    parser.add_argument("--system", metavar="TEXT", help="system prompt of the conversation")
    add_sampling_args(parser, max_tokens=512, temperature=0.7)
    add_chat_template_arg(parser)
    add_engine_args(parser)


def reply(engine: LLMEngine, conversation: list[Message], params: SamplingParams,
          turn: int) -> RequestOutput | None:
    """Streams the assistant's reply to stdout; None if the user interrupted it."""
    request_id = f"chat-{turn}"
    engine.add_request(request_id, render_chat(engine.tokenizer, conversation), params)
    shown = 0
    output: RequestOutput | None = None
    print("assistant> ", end="", flush=True)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                print(text[shown:], end="", flush=True)
                shown = len(text)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        print("\n[interrupted]", file=sys.stderr)
        return None
    print()
    return output


def run(args: argparse.Namespace, engine: LLMEngine) -> int:
    params = sampling_params_from_args(args, engine.generation_defaults.sampling)
    system: list[Message] = [{"role": "system", "content": args.system}] if args.system else []
    conversation = list(system)
    print(HELP, file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not sys.stdin.isatty():
            print(line)  # piped input is not echoed: the transcript shows it after the prompt
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            conversation = list(system)
            print("[conversation cleared]", file=sys.stderr)
            continue
        conversation.append({"role": "user", "content": text})
        turn += 1
        started = time.perf_counter()
        try:
            output = reply(engine, conversation, params, turn)
        except ValueError as error:
            conversation.pop()
            print(f"[error: {error}; try /reset]", file=sys.stderr)
            continue
        if output is None or output.error is not None:
            conversation.pop()
            if output is not None:
                print(f"[error: {output.error}]", file=sys.stderr)
            continue
        completion = output.outputs[0]
        conversation.append({"role": "assistant", "content": completion.text})
        print(f"[prompt {len(output.prompt_token_ids)} tokens, {output.num_cached_tokens} from "
              f"the prefix cache; reply {len(completion.token_ids)} tokens in "
              f"{time.perf_counter() - started:.2f} s]", file=sys.stderr)
