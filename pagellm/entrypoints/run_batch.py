"""`pagellm run-batch`: a file of OpenAI batch requests answered offline, as vLLM's
`vllm run-batch` and OpenAI's Batch API take them.

Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each output line,
in input order, is `{"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}`. The bodies go through the server's own app in this process (no
socket), so a line is answered exactly as `pagellm serve` answers it: the same checks,
defaults and errors, and one prefix cache, so lines that share a system prompt or a
document compute it once. Every line is submitted at once, as vLLM does, and the
scheduler batches them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pagellm.engine.async_engine import AsyncLLMEngine
from pagellm.entrypoints import serve
from pagellm.entrypoints.engine_args import add_chat_template_arg, add_engine_args
from pagellm.entrypoints.generate import check_input_file, json_line, print_summary, writable

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run-batch", help="answer a file of OpenAI batch requests offline",
        description="Answer an OpenAI batch file (JSONL lines of {\"custom_id\", \"method\": "
                    "\"POST\", \"url\", \"body\"}, url one of " + ", ".join(URLS) + ") as "
                    "the server would, writing one result line per request in input order "
                    "(vLLM's `vllm run-batch`).")
    parser.add_argument("-i", "--input-file", required=True, metavar="FILE",
                        help="the batch file (JSONL): a path, or an http(s) URL to GET")
    parser.add_argument("-o", "--output-file", required=True, metavar="FILE",
                        help="where the results go (JSONL): a path, or an http(s) URL to "
                             "PUT them to")
    serve.add_answer_args(parser.add_argument_group("answer options"))
    add_chat_template_arg(parser)
    add_engine_args(parser)


def is_url(place: str) -> bool:
    """Whether an input or output file is a web address (vLLM's run-batch takes them)."""
    return place.startswith(("http://", "https://"))


def check_args(args: argparse.Namespace) -> None:
    """Options that can be checked before the engine loads; ValueError names the problem.
    An input URL is fetched here, last, so that one that fails does so before the model
    loads (and a bad option before a long download)."""
    if is_url(args.output_file):
        _check_url(args.output_file, "--output-file")
    elif not writable(Path(args.output_file)):
        raise ValueError(f"--output-file {args.output_file}: cannot write there (is "
                         f"{Path(args.output_file).parent} a writable folder?)")
    serve.check_parser_args(args)
    if is_url(args.input_file):
        _check_url(args.input_file, "--input-file")
        args.input_data = _download(args.input_file)
    else:
        check_input_file(Path(args.input_file), "--input-file", "a batch file")


def _shown(url: str) -> str:
    """A URL as messages show it: without its query, which for a presigned URL is the
    signature that grants access."""
    return url.split("?", 1)[0] + ("?..." if "?" in url else "")


def _check_url(url: str, option: str) -> None:
    import httpx

    try:
        httpx.URL(url)
    except httpx.InvalidURL as error:
        raise ValueError(f"{option} {_shown(url)}: not a valid URL: {error}") from None


def _download(url: str) -> bytes:
    import httpx

    try:
        reply = httpx.get(url, follow_redirects=True, timeout=300)
    except httpx.HTTPError as error:  # a malformed URL was refused by _check_url
        raise ValueError(f"--input-file {_shown(url)}: cannot fetch it: {error}") from None
    if reply.status_code != 200:
        raise ValueError(f"--input-file {_shown(url)}: GET answered {reply.status_code}")
    return reply.content


def _upload(url: str, data: bytes, attempts: int = 5, delay: float = 5.0) -> str | None:
    """PUTs the results, in `attempts` tries `delay` s apart as vLLM makes them (a large
    upload may time out); the last failure's description, or None once one succeeded."""
    import httpx

    failure = None
    for attempt in range(1, attempts + 1):
        try:
            reply = httpx.put(url, content=data, timeout=1000, follow_redirects=True)
            if 200 <= reply.status_code < 300:
                return None
            failure = f"PUT answered {reply.status_code}: {reply.text[:200]}"
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            failure = str(error) or type(error).__name__
        if attempt < attempts:
            print(f"uploading the results to {_shown(url)} failed ({failure}); retrying "
                  f"in {delay:g} s", file=sys.stderr)
            time.sleep(delay)
    return failure


def read_requests(data: bytes) -> list[dict[str, Any]]:
    """The batch file's requests, blank lines skipped; a line that is not one keeps its
    problem under "error" (and its custom_id where it has one), so the others still run."""
    requests = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        request = _request(number, raw)
        if "error" not in request:
            if request["custom_id"] in seen:
                # Its result could not be matched to it (OpenAI's rule).
                request["error"] = (f"line {number}: custom_id {request['custom_id']!r} "
                                    "is used by an earlier line; each request needs its own")
            seen.add(request["custom_id"])
        requests.append(request)
    return requests


def _request(number: int, raw: bytes) -> dict[str, Any]:
    try:
        line = json_line(number, raw)
    except ValueError as error:
        return {"error": str(error)}
    if not isinstance(line, dict):
        return {"error": f"line {number}: must be a JSON object"}
    request = {"custom_id": line.get("custom_id"), "url": line.get("url"),
               "body": line.get("body")}
    if not isinstance(request["custom_id"], str):
        return {**request, "error": f"line {number}: custom_id must be a string"}
    if line.get("method") != "POST":
        return {**request, "error": f"line {number}: method must be \"POST\", got "
                                    f"{line.get('method')!r}"}
    if request["url"] not in URLS:
        return {**request, "error": f"line {number}: url must be one of {', '.join(URLS)}, "
                                    f"got {request['url']!r}"}
    if not isinstance(request["body"], dict):
        return {**request, "error": f"line {number}: body must be a JSON object"}
    if request["body"].get("stream") is True:
        return {**request, "error": f"line {number}: a batch request cannot stream; leave "
                                    "out body.stream"}
    return request


_JSON = {"content-type": "application/json"}


def _error_body(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error body, as the server writes it (its modules are imported once a
    batch runs, not to parse the command line)."""
    from pagellm.entrypoints.openai.errors import APIError

    return APIError(status, message).body()


def result_line(request: dict[str, Any], status: int, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's result line. A failed request keeps its status and error body, and also
    gets "error" in the shape OpenAI gives that field, {code, message}, so that readers
    which check only that field (vLLM's run-batch fills it for every failure) see it."""
    error = body.get("error") if status != 200 else None
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.get("custom_id"),
            "response": {"status_code": status,
                         "request_id": body.get("id") or f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None if error is None else {
                "code": error.get("code") or error.get("type"), "message": error.get("message")}}


def _jsonl(line: dict[str, Any]) -> str:
    """A result line as UTF-8 JSON text; one that echoes a lone surrogate back (the
    Responses API echoes metadata as given) is written with escapes instead."""
    text = json.dumps(line, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(line)
    return text + "\n"


def _usage_totals(lines: list[dict[str, Any]]) -> dict[str, int]:
    """Prompt, cached and generated tokens of the answered lines, whichever API's usage
    names they are reported under."""
    totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}
    for line in lines:
        usage = line["response"]["body"].get("usage") or {}
        details = (usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
                   or {})
        totals["prompt_tokens"] += usage.get("prompt_tokens", usage.get("input_tokens", 0))
        totals["cached_tokens"] += details.get("cached_tokens") or 0
        totals["completion_tokens"] += usage.get("completion_tokens",
                                                 usage.get("output_tokens", 0))
    return totals


async def answer_all(engine: AsyncLLMEngine, args: argparse.Namespace,
                     requests: list[dict[str, Any]],
                     results: list[dict[str, Any] | None]) -> None:
    """Fills in each request's result line (in `results`, by position, as each ends),
    from the server's app in this process."""
    import httpx

    from pagellm.entrypoints.openai.api_server import ServerSettings, create_app

    app = create_app(engine, ServerSettings(**serve.answer_settings(args),
                                            log_stats_interval=None))
    bar = tqdm(total=len(requests), desc="Answering", unit="request", file=sys.stderr)

    async def answer(client: httpx.AsyncClient, index: int) -> None:
        request = requests[index]
        if "error" in request:
            line = result_line(request, 400, _error_body(400, request["error"]))
        else:
            try:
                # The body as the file wrote it (NaN, lone surrogate escapes), for the
                # server to judge as it would judge it over HTTP.
                reply = await client.post(request["url"], headers=_JSON, content=json.dumps(
                    request["body"], ensure_ascii=True).encode())
                line = result_line(request, reply.status_code, reply.json())
            except Exception as error:  # noqa: BLE001 - one line's failure is its own
                line = result_line(request, 500, _error_body(
                    500, f"internal error while answering this request: {error!r}"))
        results[index] = line
        bar.update(1)

    try:
        async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app, raise_app_exceptions=False),
                base_url="http://batch", timeout=None) as client:
            await asyncio.gather(*(answer(client, i) for i in range(len(requests))))
    finally:
        bar.close()


def run(args: argparse.Namespace, engine: AsyncLLMEngine) -> int:
    """Answers the file, writes the results and a summary line; 1 if any request failed
    (its line says why), as `generate` does. Interrupted (Ctrl-C), it still writes every
    result line, those not answered yet saying so, and returns 130."""
    started = time.perf_counter()
    requests: list[dict[str, Any]] = []
    results: list[dict[str, Any] | None] = []
    interrupted = False
    try:
        data = getattr(args, "input_data", None)
        requests = read_requests(Path(args.input_file).read_bytes() if data is None else data)
        results = [None] * len(requests)
        asyncio.run(answer_all(engine, args, requests, results))
    except KeyboardInterrupt:
        interrupted = True
    finally:
        engine.shutdown()
    lines = [line if line is not None else result_line(request, 503, _error_body(
                 503, "not answered: the run was interrupted"))
             for request, line in zip(requests, results, strict=True)]
    failure = _write_results(args.output_file, "".join(_jsonl(line) for line in lines))
    answered = [line for line in lines if line["error"] is None]
    print_summary(len(lines), len(lines) - len(answered), _usage_totals(answered),
                  time.perf_counter() - started, "requests")
    if interrupted:
        return 130
    return 0 if len(answered) == len(lines) and failure is None else 1


def _write_results(place: str, text: str) -> str | None:
    """Writes the results to a file, or PUTs them to a URL; why the upload failed, if
    it did. The upload's results wait in a local file meanwhile, removed once sent and
    named if every try fails or the upload is interrupted, so that none is lost."""
    if not is_url(place):
        Path(place).write_text(text, encoding="utf-8")
        return None
    handle, name = tempfile.mkstemp(prefix="pagellm-batch-", suffix=".jsonl")
    with os.fdopen(handle, "w", encoding="utf-8") as kept:
        kept.write(text)
    failure: str | None = "interrupted"
    try:
        failure = _upload(place, text.encode())
    finally:
        if failure is None:
            os.unlink(name)
        else:
            print(f"error: uploading the results to {_shown(place)} failed ({failure}); "
                  f"they are in {name}", file=sys.stderr)
    return failure


if __name__ == "__main__":
    # vLLM's `python -m vllm.entrypoints.openai.run_batch -i IN -o OUT --model M`:
    # `pagellm run-batch` with the same options.
    from pagellm.entrypoints.cli import main

    sys.exit(main(["run-batch", *sys.argv[1:]]))
