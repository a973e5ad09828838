"""From a request body to `SamplingParams`, with errors that name the request's field.

`SamplingParams` validates every value and names the field in its message; here that
name is mapped back to what the client sent (chat's `top_logprobs` is the engine's
`logprobs`, `max_completion_tokens` its `max_tokens`), so the 400 points at the client's
own field.
"""

from __future__ import annotations

import math

from pagellm.core.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.protocol import SamplingFields


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def build_sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    field_names: dict[str, str] | None = None,
) -> SamplingParams:
    """The request's sampling options, validated; raises a 400 APIError naming the field.

    Two checks need the vocabulary, which `SamplingParams` does not know, and both guard
    the whole batch: a token id outside it in `stop_token_ids`, or a `top_k` too big for
    the sampler's int64 tensors, would fail the step of every request scheduled with it.
    `top_k` above the vocabulary means "no limit", so it is clamped; a stop token outside
    the vocabulary is a client error.
    """
    top_k = request.top_k or 0
    logit_bias = _logit_bias(request.logit_bias, vocab_size)
    for token in request.stop_token_ids or []:
        if not 0 <= token < vocab_size:
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}), got "
                              f"{token}", param="stop_token_ids", code="invalid_value")
    try:
        return SamplingParams(
            n=request.n,
            temperature=_or(request.temperature, 1.0),
            top_p=_or(request.top_p, 1.0),
            top_k=min(top_k, vocab_size),
            min_p=_or(request.min_p, 0.0),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            presence_penalty=_or(request.presence_penalty, 0.0),
            frequency_penalty=_or(request.frequency_penalty, 0.0),
            repetition_penalty=_or(request.repetition_penalty, 1.0),
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
        )
    except ValueError as error:
        raise _named(str(error), field_names or {}) from error


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """JSON object keys are strings: OpenAI's logit_bias is {"token id": bias}. Values are
    clamped to [-100, 100], as vLLM's server does, so a client banning a token with -1e9
    works here too."""
    if bias is None:
        return None
    by_id: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                              f"{key!r}", param="logit_bias", code="invalid_value")
        if math.isnan(value):
            raise bad_request(f"logit_bias[{key}] must be a number, got NaN",
                              param="logit_bias", code="invalid_value")
        by_id[int(key)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
    return by_id


def _named(message: str, field_names: dict[str, str]) -> APIError:
    field, _, rest = message.partition(" ")
    field = field.split("[")[0]
    param = field_names.get(field, field)
    if param != field:
        message = f"{param} {rest}"
    return bad_request(message, param=param, code="invalid_value")
