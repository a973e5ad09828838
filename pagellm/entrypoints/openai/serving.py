"""What both generation endpoints share: model check, context-length check, starting the
engine requests of one HTTP request, merging their outputs, and usage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import uuid
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from pagellm.core.sampling_params import BeamSearchParams, SamplingParams
from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from pagellm.engine.chat_template import ContentFormat
from pagellm.engine.outputs import CompletionOutput, RequestOutput
from pagellm.engine.text import TextTooLong, encode_text
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.logprobs import TokenText
from pagellm.entrypoints.openai.metrics import ServerMetrics
from pagellm.entrypoints.openai.protocol import (
    PromptTokensDetails,
    SamplingFields,
    StreamOptions,
    UsageInfo,
)

T = TypeVar("T")

# Completions one HTTP request may ask for (prompts x n). Each is a full engine request,
# so this bounds how much of the engine one client can occupy with a single call.
MAX_CHOICES = 256


# Options OpenAI or vLLM define that this server does not implement, and why.
_REFUSED = {
    "suffix": "insertion (fill in the middle) is not implemented",
    "audio": "only text output is produced",
    "functions": "function calling is not implemented",
    "function_call": "function calling is not implemented",
}


def is_set(value: Any) -> bool:
    """Whether a client asked for something: false, null and empty mean no (0 means 0)."""
    return value is not None and value is not False and value not in ("", [], {})


def refuse_set(body: Any, refused: dict[str, str]) -> None:
    """A 400 naming the first option of `refused` (option: why) that the client set."""
    for option, reason in refused.items():
        if is_set(getattr(body, option, None)):
            raise bad_request(f"{option} is not supported: {reason}", param=option)


def check_supported(body: SamplingFields) -> None:
    """A 400 naming the first option set that this server would otherwise ignore while
    it changes what the client gets back, or that makes no sense without a stream."""
    refuse_set(body, _REFUSED)
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true",
                          param="stream_options")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise bad_request("modalities: only text output is produced", param="modalities")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of is not supported (only best_of == n, here {body.n}); "
                          "ask for n completions and rank them yourself", param="best_of")


# SamplingParams fields that beam search does not follow (it ranks the model's own
# logprobs and ends a beam only at EOS or the length limit). Each would change a sampled
# answer, so with use_beam_search it is refused, not ignored.
_SAMPLING_ONLY = ("top_p", "top_k", "min_p", "min_tokens", "stop", "stop_token_ids",
                  "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "prompt_logprobs", "logit_bias", "allowed_token_ids", "bad_words",
                  "structured_outputs", "spaces_between_special_tokens")


def request_defaults(context: ServerContext, body: SamplingFields) -> Mapping[str, Any]:
    """The values a request's unset fields take: the model's generation config's (see
    GenerationDefaults), but for beam search only its max_tokens: a search follows none
    of the sampling options, so the model's top_p must not make it refuse a request."""
    sampling = context.engine.generation_defaults.sampling
    if body.use_beam_search:
        return {name: value for name, value in sampling.items() if name == "max_tokens"}
    return sampling


def beam_search_params(body: SamplingFields, params: SamplingParams, format_param: str
                       ) -> BeamSearchParams:
    """vLLM's `use_beam_search`: `n` is the beam width and the n best sequences are the
    choices, best first. They are known only when the search ends, so a stream sends
    each whole then (as vLLM's chat does). `temperature` may be omitted or 0 (the search
    is deterministic); a seed changes nothing."""
    plain = SamplingParams()
    for name in _SAMPLING_ONLY:
        if getattr(params, name) != getattr(plain, name):
            param = format_param if name == "structured_outputs" else name
            if name == "prompt_logprobs" and body.prompt_logprobs is None:
                param = "echo"  # completions' echo with logprobs scores the prompt
            raise bad_request(f"{param} is not supported with use_beam_search (it scores "
                              "the generated tokens only)" if name == "prompt_logprobs"
                              else f"{param} is not supported with use_beam_search",
                              param=param)
    assert params.max_tokens is not None  # resolved against the context by now
    try:
        return BeamSearchParams(
            beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
            temperature=body.temperature or 0.0,
            length_penalty=1.0 if body.length_penalty is None else body.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens, logprobs=params.logprobs)
    except ValueError as error:
        field_name, rest = str(error).split(" ", 1)
        param = "n" if field_name == "beam_width" else field_name
        raise bad_request(f"{param} {rest} (with use_beam_search)", param=param) from error


@dataclass
class ServerContext:
    """What every handler needs: the engine, the names it answers to, the metrics."""

    engine: AsyncLLMEngine
    model_names: list[str]
    metrics: ServerMetrics
    tool_call_parser: str | None = None  # for tool_choice "auto" (see tool_calls.py)
    reasoning_parser: str | None = None  # chat's reasoning (see reasoning.py)
    # vLLM's server-wide answer defaults (--return-tokens-as-token-ids,
    # --enable-force-include-usage, --default-chat-template-kwargs, and the two below).
    return_tokens_as_token_ids: bool = False
    force_include_usage: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    response_role: str = "assistant"  # --response-role
    chat_template_content_format: ContentFormat = "auto"  # --chat-template-content-format
    exclude_tools_when_tool_choice_none: bool = False  # --exclude-tools-when-tool-choice-none
    sse_keep_alive: float | None = None  # seconds (--sse-keep-alive-interval); None: never
    model_aliases: list[str] = field(default_factory=list)  # answered to, not listed
    tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenizer"))

    async def off_loop(self, function: Callable[..., T], *args: Any) -> T:
        """Runs tokenizer work (encoding prompts, rendering a chat) on the server's
        tokenizer thread: a few megabytes of text take seconds to encode, which on the
        event loop would stall every other request and stream. One thread, as in vLLM,
        so encodes queue instead of taking the cores from the engine; the short decodes
        of the engine and the handlers run beside it (a fast tokenizer's encode and
        decode only read it). After shutdown a late request fails: the server is going
        away anyway."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread,
                                          functools.partial(function, *args))

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def token_text(self, as_ids: bool | None = None) -> TokenText:
        """How a request's logprobs name tokens: by text, or as `token_id:N` where the
        request (`as_ids`; None where it does not say, or cannot) or else the server asks
        for ids."""
        return TokenText(self.engine.tokenizer,
                         self.return_tokens_as_token_ids if as_ids is None else as_ids)

    def check_model(self, requested: str | None, named: bool = False) -> None:
        """404 for a model this server does not serve; an omitted or empty model means
        ours (as in vLLM), unless the model must be `named` (GET /v1/models/NAME)."""
        if ((requested or named) and requested not in self.model_names
                and requested not in self.model_aliases):
            raise APIError(404, f"The model `{requested}` does not exist.", param="model",
                           code="model_not_found")


@dataclass
class Prompt:
    """One prompt, tokenized by the server (text kept for outputs that echo it)."""

    text: str | None
    token_ids: list[int]


def encode(tokenizer: Any, text: str, param: str, add_special_tokens: bool,
           max_model_len: int | None = None) -> list[int]:
    """Tokenizes client text; text the tokenizer cannot take is a 400 naming `param`, and
    with `max_model_len` so is text too long to fit, found before it is tokenized."""
    try:
        return encode_text(tokenizer, text, param, add_special_tokens, max_model_len)
    except TextTooLong as error:
        raise bad_request(str(error), param=param, code=CONTEXT_LENGTH_EXCEEDED) from error
    except ValueError as error:
        raise bad_request(str(error), param=param) from error


def check_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"This request asks for {num_prompts * n} completions ({num_prompts} prompts x "
            f"n={n}); the limit is {MAX_CHOICES}.", param="n")


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for that 400


def fits_context(max_model_len: int, prompt_len: int, max_tokens: int | None) -> bool:
    """Whether a prompt and its completion budget (None: the rest of the context, at
    least one token) fit in the model's context."""
    budget = max_model_len - prompt_len if max_tokens is None else max_tokens
    return prompt_len < max_model_len and prompt_len + budget <= max_model_len


def truncated(params: SamplingParams, token_ids: list[int], max_model_len: int,
              side: str | None) -> list[int]:
    """The prompt as `truncate_prompt_tokens` keeps it, from its end, or from its start
    for vLLM's `truncation_side` "right"; a setting that cannot keep any is a 400
    naming it."""
    try:
        return params.truncate(token_ids, max_model_len, keep_start=side == "right")
    except ValueError as error:
        raise bad_request(str(error), param="truncate_prompt_tokens") from error


def length_bound(params: SamplingParams, max_model_len: int) -> int | None:
    """The context a prompt's text must fit, checked by its length before it is tokenized
    (`encode`, `render_messages`): none for a prompt to be cut to fit
    (`truncate_prompt_tokens`), which may be any length."""
    return max_model_len if params.truncate_prompt_tokens is None else None


def request_ids(prefix: str, raw: Request, chosen: str | None) -> tuple[str, str]:
    """The answer's id and the name its engine requests take (`-0`, `-1`, ...), as vLLM
    builds them: `prefix` and the client's X-Request-Id, else the body's request_id,
    else a new id. A client's may be sent by two requests at once (a gateway's retry),
    so their engine requests then get a part of their own."""
    given = raw.headers.get("x-request-id") or chosen
    if not given:
        fresh = f"{prefix}{uuid.uuid4().hex}"
        return fresh, fresh
    answer = f"{prefix}{given}"
    return answer, f"{answer}-{uuid.uuid4().hex[:8]}"


def check_max_tokens(requested: int | None, max_model_len: int, param: str) -> None:
    """vLLM's 400 for a completion budget past the whole context; one that only the
    prompt leaves no room for is cut to fit (see resolve_max_tokens), as vLLM cuts it."""
    if requested is not None and requested > max_model_len:
        raise bad_request(f"{param}={requested} cannot be greater than max_model_len="
                          f"{max_model_len}. Please request fewer output tokens.",
                          param=param, code="invalid_value")


def resolve_max_tokens(max_model_len: int, prompt_len: int, max_tokens: int | None,
                       min_tokens: int, prompt_param: str, limit: int | None = None) -> int:
    """The completion budget of a prompt: as asked but no more than the context leaves
    (as vLLM does: the completion then ends with finish_reason "length"), or, if None,
    all the context left; never more than `limit`, an operator's max_new_tokens (see
    GenerationDefaults).

    Raises OpenAI's "maximum context length" 400, naming both numbers, when the prompt
    leaves no room for a single token, and a 400 naming min_tokens when it leaves fewer
    than those, or the cap is below them.
    """
    room = max_model_len - prompt_len
    if room < 1:
        completion = max(max_tokens or 1, 1)
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + completion} tokens ({prompt_len} in the prompt, "
            f"{completion} for the completion). Please reduce the length of the prompt.",
            param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    if min_tokens > room:
        raise bad_request(
            f"min_tokens is {min_tokens}, but the context of {max_model_len} tokens leaves "
            f"{room} after the prompt's {prompt_len}", param="min_tokens",
            code=CONTEXT_LENGTH_EXCEEDED)
    if limit is not None and min_tokens > limit:
        raise bad_request(f"min_tokens is {min_tokens}, but the server's max_new_tokens "
                          f"(--generation-config) stops every request at {limit}",
                          param="min_tokens")
    budget = room if max_tokens is None else min(max_tokens, room)
    return budget if limit is None else min(budget, limit)


async def start_requests(
    context: ServerContext,
    base_id: str,
    prompts: list[Prompt],
    params: Sequence[SamplingParams | BeamSearchParams],
    cache_salt: str | None,
    arrival_time: float,
    prompt_param: str,
    priority: int,
    format_param: str,
    logprobs_param: str = "logprobs",
) -> list[RequestStream]:
    """Queues one engine request per prompt; all or none (an error aborts the started).
    An engine error names its field as the client sent it: `format_param` for the
    format's, `logprobs_param` for the logprobs count's (chat's is `top_logprobs`)."""
    streams: list[RequestStream] = []
    try:
        for index, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            engine_prompt: Any = ({"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
                                  if prompt.text is not None else prompt.token_ids)
            streams.append(await context.engine.add_request(
                f"{base_id}-{index}", engine_prompt, sampling, arrival_time=arrival_time,
                priority=priority, cache_salt=cache_salt))
            context.metrics.log_received(streams[-1].request_id, len(prompt.token_ids),
                                         sampling)
    except BaseException as error:
        for stream in streams:
            stream.abort()
            context.metrics.log_aborted(stream.request_id, None)
        if isinstance(error, ValueError):
            message = str(error)
            param = next((name for name in ("cache_salt", "priority", "allowed_token_ids",
                                           "bad_words")
                          if message.startswith(name)), prompt_param)
            if message.startswith("beam_width"):  # too wide for the model's EOS tokens
                param = "n"
            elif message.startswith("logprobs"):  # more than a beam search step ranks
                param = logprobs_param
                message = logprobs_param + message[len("logprobs"):]
            if message.startswith("structured_outputs"):
                param = format_param
                if format_param != "structured_outputs" and "." in message.split(" ")[0]:
                    # Said with the field the client used: "response_format is not ...".
                    message = format_param + message[message.index(" "):]
            raise bad_request(message, param=param) from error
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
    latest: dict[int, RequestOutput] = {}
    finished: set[int] = set()
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                latest[index] = output
                if output.finished:
                    metrics.log_finished(output)
                    finished.add(index)
                else:
                    pending[asyncio.ensure_future(streams[index].__anext__())] = index
                yield index, output
    finally:
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as lost
            task.cancel()
        for index, stream in enumerate(streams):
            if index not in finished:
                metrics.log_aborted(stream.request_id, latest.get(index))
            stream.abort()


async def final_outputs(streams: list[RequestStream], metrics: ServerMetrics
                        ) -> list[RequestOutput]:
    """The finished output of every stream, in prompt order."""
    last: dict[int, RequestOutput] = {}
    async with aclosing(merged(streams, metrics)) as outputs:
        async for index, output in outputs:
            last[index] = output
    return [last[index] for index in range(len(streams))]


@dataclass(frozen=True)
class UsageReport:
    """Where a stream reports usage (`stream_options`): in a last chunk of its own
    (`include_usage`), and also on every chunk, counting the tokens so far (vLLM's
    `continuous_usage_stats`, which needs `include_usage`)."""

    at_end: bool
    on_every_chunk: bool

    @classmethod
    def of(cls, options: StreamOptions | None, forced: bool) -> UsageReport:
        """`forced`: the server's --enable-force-include-usage, which (as vLLM's) reports
        both ways whatever the request says."""
        if forced:
            return cls(True, True)
        if options is None or not options.include_usage:
            return cls(False, False)
        return cls(True, options.continuous_usage_stats)


def choice_usage(output: RequestOutput, completion: CompletionOutput) -> UsageInfo:
    """A streamed choice's usage so far (continuous usage): its prompt and its own
    tokens, as vLLM counts each chunk."""
    return usage([dataclasses.replace(output, outputs=[completion])])


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    """OpenAI's usage: each prompt counted once (whatever n), every completion token."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
