"""`pagellm generate`: complete prompts offline, from arguments or a JSONL file.

Completions go to stdout (plain text for prompt arguments, JSONL for --input or
--output); token counts, cache hits and the progress bar go to stderr, so the output
pipes cleanly.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from pagellm.core.sampling_params import GUIDED_FIELDS, SamplingParams
from pagellm.engine.chat_template import render_chat
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.outputs import RequestOutput
from pagellm.entrypoints.engine_args import add_chat_template_arg, add_engine_args
from pagellm.entrypoints.sampling_args import add_sampling_args, sampling_params_from_args

# A JSONL line may set these for itself (vLLM's names, as in its batch files); they
# override the command line's. Every other key is the caller's, echoed back untouched,
# except the ones a result line has no room for (refused rather than ignored) and near
# misses of a sampling name (a typo that would silently change nothing). `extra_args`
# holds data for the caller's own code, which a line's other keys already are.
_NO_ROOM = frozenset({"n", "logprobs", "prompt_logprobs", "detokenize", "output_kind"})
LINE_SAMPLING_KEYS = (frozenset(f.name for f in dataclasses.fields(SamplingParams))
                      - _NO_ROOM - {"extra_args"})
# The server's ways of giving a format: refused in a line rather than echoed back unused.
_SERVER_FORMAT_KEYS = frozenset({"response_format", *GUIDED_FIELDS})


@dataclass
class Job:
    """One input prompt: what to echo back, its token ids and its own sampling (None: the
    command line's), or why it cannot run."""

    index: int
    record: dict[str, Any]
    token_ids: list[int] | None = None
    error: str | None = None
    params: SamplingParams | None = None
    cache_salt: str | None = None
    priority: int = 0


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate", help="complete prompts offline",
        description="Complete prompts given as arguments, or one per line of a JSONL file "
                    "(a JSON string, {\"prompt\": ...} or {\"messages\": [...]}). A line's "
                    "object may also set its own sampling with SamplingParams' names "
                    "(max_tokens, temperature, top_p, stop, seed, ...), cache_salt and "
                    "priority, over the options'; other keys are echoed back.")
    parser.add_argument("prompt", nargs="*", help="prompts to complete")
    parser.add_argument("--input", type=Path, metavar="FILE", help="JSONL file of prompts")
    parser.add_argument("--output", type=Path, metavar="FILE",
                        help="write JSONL results here (default: stdout)")
    parser.add_argument("--system", metavar="TEXT", help="system prompt: each prompt becomes a user "
                                         "message after it, through the chat template")
    parser.add_argument("--chat", action="store_true",
                        help="send each prompt as a user message through the chat template")
    parser.add_argument("--cache-salt", metavar="SALT", help="isolate these requests' prefix cache")
    add_sampling_args(parser, max_tokens=64, temperature=0.0)
    add_chat_template_arg(parser)
    add_engine_args(parser)


def check_args(args: argparse.Namespace) -> None:
    """Options that can be checked before the engine loads; ValueError names the problem."""
    if args.input is None and not args.prompt:
        raise ValueError("give a prompt argument or --input FILE")
    if args.input is not None and args.prompt:
        raise ValueError("give prompt arguments or --input FILE, not both")
    if args.input is not None:
        check_input_file(args.input, "--input", "a file of prompts")
    if args.output is not None and not writable(args.output):
        raise ValueError(f"--output {args.output}: cannot write there (is "
                         f"{args.output.parent} a writable folder?)")


def check_input_file(path: Path, option: str, holds: str) -> None:
    """ValueError naming `option` unless `path` can be read as a file (not is_file(): a
    pipe, /dev/stdin or <(...), is a fine input)."""
    if not path.exists():
        raise ValueError(f"{option} {path}: no such file")
    if path.is_dir():
        raise ValueError(f"{option} {path}: is a directory, not {holds}")


def json_line(number: int, raw: bytes) -> Any:
    """Line `number` of a JSON-lines file, decoded on its own (a byte that is not UTF-8
    spoils only its line; a byte-order mark may open the file); ValueError naming the
    line and what it is not."""
    try:
        return json.loads(raw.decode("utf-8-sig" if number == 1 else "utf-8"))
    except UnicodeDecodeError as error:
        raise ValueError(f"line {number}: not UTF-8 text: {error}") from None
    except (ValueError, RecursionError) as error:  # not JSON, or nested or long past reading
        raise ValueError(f"line {number}: not JSON: {error}") from None


def writable(path: Path) -> bool:
    """Whether `path` can be opened for writing: an existing file (/dev/stdout too), or a
    new one in a writable folder."""
    if path.exists():
        return not path.is_dir() and os.access(path, os.W_OK)
    return path.parent.is_dir() and os.access(path.parent, os.W_OK)


def read_records(args: argparse.Namespace) -> list[dict[str, Any] | str]:
    """The inputs as records; a line that cannot be one is kept as an error message, so
    the other lines still run. Lines are decoded one by one: a byte that is not UTF-8
    spoils only its line, and a byte-order mark at the start is allowed."""
    if args.input is None:
        return [{"prompt": prompt} for prompt in args.prompt]
    records: list[dict[str, Any] | str] = []
    with args.input.open("rb") as lines:
        for number, raw in enumerate(lines, 1):
            records.extend(_record(number, raw) if raw.strip() else [])
    return records


def _record(number: int, raw: bytes) -> list[dict[str, Any] | str]:
    try:
        value = json_line(number, raw)
    except ValueError as error:
        return [str(error)]
    if isinstance(value, str):
        value = {"prompt": value}
    if not isinstance(value, dict):
        kind = {bool: "a boolean", int: "a number", float: "a number", list: "an array"}
        return [f"line {number}: must be a JSON string or object, got "
                f"{kind.get(type(value), 'null')}"]
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return [f"line {number}: not valid Unicode text (a lone surrogate escape)"]
    return [value]


def to_job(engine: LLMEngine, index: int, record: dict[str, Any] | str,
           args: argparse.Namespace, params: SamplingParams) -> Job:
    if isinstance(record, str):
        return Job(index, {}, error=record)
    try:
        # The engine checks the salt when the line is submitted; the priority is checked
        # here, since lines are ordered by it before that.
        return Job(index, record, token_ids=_token_ids(engine, record, args),
                   params=_line_params(record, params),
                   cache_salt=record.get("cache_salt", args.cache_salt),
                   priority=engine.check_priority(record.get("priority", 0)))
    except (ValueError, TypeError, KeyError) as error:
        return Job(index, record, error=str(error))


def _line_params(record: dict[str, Any], params: SamplingParams) -> SamplingParams | None:
    """The line's own sampling over the command line's, validated; None when it sets
    none."""
    if "n" in record and record["n"] != 1:
        raise ValueError("n must be 1 here (a line's result holds one completion); repeat "
                         "the line instead")
    refused = sorted(set(record) & (_NO_ROOM - {"n"}))
    if refused:
        raise ValueError(f"{refused[0]} is not supported in a line: its result holds the "
                         "text and token counts only (the Python API and the server return it)")
    server_only = sorted(set(record) & _SERVER_FORMAT_KEYS)
    if server_only:
        raise ValueError(f"{server_only[0]} is the server's spelling: a line sets its format "
                         'with structured_outputs, e.g. {"structured_outputs": {"choice": '
                         '["yes", "no"]}}')
    for key in record:
        close = difflib.get_close_matches(key, LINE_SAMPLING_KEYS, n=1, cutoff=0.85)
        if key not in LINE_SAMPLING_KEYS and close:
            raise ValueError(f"unknown key {key!r}: did you mean {close[0]!r}?")
    own = {key: value for key, value in record.items() if key in LINE_SAMPLING_KEYS}
    if "logit_bias" in own and isinstance(own["logit_bias"], dict):
        own["logit_bias"] = {int(token): bias for token, bias in own["logit_bias"].items()}
    return params.clone(**own) if own else None


def _token_ids(engine: LLMEngine, record: dict[str, Any], args: argparse.Namespace
               ) -> list[int]:
    messages = record.get("messages")
    if messages is None:
        prompt = record.get("prompt")
        if isinstance(prompt, list) and args.system is None and not args.chat:
            return engine.tokenize_prompt(prompt)[1]
        if not isinstance(prompt, str):
            raise ValueError("a line needs a 'prompt' (a string, or token ids without "
                             "--system and --chat) or a 'messages' list")
        if args.system is None and not args.chat:
            return engine.tokenize_prompt(prompt)[1]
        messages = [{"role": "user", "content": prompt}]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    if args.system is not None:
        messages = [{"role": "system", "content": args.system}, *messages]
    return render_chat(engine.tokenizer, messages)


def run_jobs(engine: LLMEngine, jobs: list[Job], params: SamplingParams,
             progress: bool) -> Iterator[tuple[Job, RequestOutput | None]]:
    """Yields each job with its output, in input order, as soon as it and those before
    it are done.

    The first valid prompt (of the best priority) runs alone until its prompt is
    computed: requests admitted in the same step cannot share blocks (only computed blocks
    are cached), so a shared system prompt would otherwise be computed once per prompt of
    the first batch.
    """
    pending = [job for job in jobs if job.error is None]
    done: dict[int, RequestOutput] = {}
    bar = tqdm(total=len(pending), desc="Generating", unit="prompt", disable=not progress,
               file=sys.stderr)
    next_to_yield = 0

    def submit(job: Job) -> None:
        assert job.token_ids is not None
        try:
            engine.add_request(str(job.index), job.token_ids, job.params or params,
                               cache_salt=job.cache_salt, priority=job.priority)
        except ValueError as error:
            job.error = str(error)
            bar.update(1)

    try:
        first = min(pending, key=lambda job: (job.priority, job.index), default=None)
        if first is not None:
            submit(first)
            while engine.has_unfinished_requests() and not _collect(engine.step(), done, bar):
                pass
        for job in pending:
            if job is not first:
                submit(job)
        while True:
            while next_to_yield < len(jobs) and (
                    jobs[next_to_yield].error is not None or jobs[next_to_yield].index in done):
                job = jobs[next_to_yield]
                yield job, done.pop(job.index, None)
                next_to_yield += 1
            if not engine.has_unfinished_requests():
                break
            _collect(engine.step(), done, bar)
    finally:
        bar.close()
        for job in pending:
            engine.abort_request(str(job.index))


def _collect(outputs: list[RequestOutput], done: dict[int, RequestOutput], bar: Any) -> bool:
    """Stores finished outputs; True once any output (a computed prompt) was seen."""
    for output in outputs:
        if output.finished:
            done[int(output.request_id)] = output
            bar.update(1)
    return bool(outputs)


def result_record(job: Job, output: RequestOutput | None) -> dict[str, Any]:
    record = dict(job.record)
    if output is None or output.error is not None:
        record["error"] = job.error if output is None else output.error
        return record
    completion = output.outputs[0]
    record.update(text=completion.text, finish_reason=completion.finish_reason,
                  prompt_tokens=len(output.prompt_token_ids),
                  completion_tokens=len(completion.token_ids),
                  cached_tokens=output.num_cached_tokens)
    return record


def run(args: argparse.Namespace, engine: LLMEngine) -> int:
    params = sampling_params_from_args(args, engine.generation_defaults.sampling)
    jobs = [to_job(engine, i, r, args, params) for i, r in enumerate(read_records(args))]
    jsonl = args.input is not None or args.output is not None
    out: TextIO = args.output.open("w", encoding="utf-8") if args.output else sys.stdout
    started = time.perf_counter()
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
    failures = 0
    try:
        for job, output in run_jobs(engine, jobs, params, progress=args.input is not None):
            record = result_record(job, output)
            for key in totals:
                totals[key] += record.get(key, 0)
            failures += "error" in record
            if jsonl:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
            elif "error" in record:
                print(f"error: {record['error']}", file=sys.stderr)
            else:
                print(record["text"], file=out, flush=True)
                print(f"[{record['prompt_tokens']} prompt tokens, {record['cached_tokens']} "
                      f"from the prefix cache; {record['completion_tokens']} generated, "
                      f"finish: {record['finish_reason']}]", file=sys.stderr)
    finally:
        if args.output:
            out.close()
    print_summary(len(jobs), failures, totals, time.perf_counter() - started, "prompts")
    return 1 if failures else 0


def print_summary(count: int, failures: int, totals: dict[str, int], seconds: float,
                  unit: str) -> None:
    """One line on stderr: how many `unit` succeeded, and the tokens, cached share and
    speed of the run."""
    prompt, cached = totals["prompt_tokens"], totals["cached_tokens"]
    share = 100.0 * cached / prompt if prompt else 0.0
    print(f"{count - failures}/{count} {unit} done in {seconds:.2f} s: {prompt} prompt tokens "
          f"({cached} from the prefix cache, {share:.0f}%), {totals['completion_tokens']} "
          f"generated ({totals['completion_tokens'] / max(seconds, 1e-9):.1f} tok/s)",
          file=sys.stderr)
