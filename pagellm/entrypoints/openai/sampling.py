"""From a request body to `SamplingParams`, with errors that name the request's field.

`SamplingParams` validates every value and names the field in its message; here that
name is mapped back to what the client sent (chat's `top_logprobs` is the engine's
`logprobs`, `max_completion_tokens` its `max_tokens`), so the 400 points at the client's
own field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagellm.core.sampling_params import (
    FORMAT_KINDS,
    GUIDED_FIELDS,
    SamplingParams,
    StructuredOutputsParams,
    clamp_logit_bias,
)
from pagellm.entrypoints.openai.errors import APIError, bad_request
from pagellm.entrypoints.openai.protocol import SamplingFields

# What an unset field means where the model's generation config sets nothing.
_NEUTRAL = SamplingParams()


def build_sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
    defaults: Mapping[str, Any],
    field_names: dict[str, str] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's sampling options, validated; raises a 400 APIError naming the field.

    A field the request leaves unset (or null) takes its value from `defaults` (see
    `request_defaults`), else its neutral value; so does `max_tokens`, before it is
    fitted to the context.

    Two checks need the vocabulary, which `SamplingParams` does not know, and both guard
    the whole batch: a token id outside it in `stop_token_ids`, or a `top_k` too big for
    the sampler's int64 tensors, would fail the step of every request scheduled with it.
    `top_k` above the vocabulary means "no limit", so it is clamped; a stop token outside
    the vocabulary is a client error.
    """
    def value(name: str) -> Any:
        given = getattr(request, name)
        return defaults.get(name, getattr(_NEUTRAL, name)) if given is None else given

    logit_bias = _logit_bias(request.logit_bias, vocab_size)
    for token in request.stop_token_ids or []:
        if not 0 <= token < vocab_size:
            raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}), got "
                              f"{token}", param="stop_token_ids", code="invalid_value")
    try:
        return SamplingParams(
            n=request.n,
            temperature=value("temperature"),
            top_p=value("top_p"),
            top_k=min(value("top_k"), vocab_size),
            min_p=value("min_p"),
            seed=request.seed,
            max_tokens=defaults.get("max_tokens") if max_tokens is None else max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            include_stop_str_in_output=request.include_stop_str_in_output,
            presence_penalty=value("presence_penalty"),
            frequency_penalty=value("frequency_penalty"),
            repetition_penalty=value("repetition_penalty"),
            logprobs=logprobs,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            allowed_token_ids=request.allowed_token_ids,
            bad_words=request.bad_words,
            structured_outputs=structured_outputs,
        )
    except ValueError as error:
        raise _named(str(error), field_names or {}) from error




@dataclass(frozen=True)
class RequestFormat:
    """The request's format and the field that carried it, which errors about the
    format name (the engine finds one that does not compile)."""

    params: StructuredOutputsParams | None
    field: str


def structured_outputs_of(request: SamplingFields, tool_schema: dict[str, Any] | None = None
                          ) -> RequestFormat:
    """The request's format, from whichever field the client used: `response_format`
    (OpenAI: json_object, or json_schema with its `schema`), `structured_outputs`
    (vLLM's dict), vLLM's older `guided_*` fields, or a forced tool call's schema
    (`tool_schema`, see tool_calls.py), which replaces any other. They may be combined (a
    schema with structured_outputs' whitespace options), but two formats are a 400, as
    is a response_format type other than text, json_object and json_schema. One format
    given twice with the same value is taken once."""
    fields: dict[str, Any] = {}
    origin: dict[str, str] = {}

    def put(key: str, value: Any, source: str) -> None:
        if tool_schema is not None and key in FORMAT_KINDS and source != "tool_choice":
            return  # a forced call's schema replaces every other format (see below)
        if fields.get(key, object()) == value:
            return  # the same format twice (guidance sends guided_* and structured_outputs)
        clash = key if key in fields else next(
            (other for other in fields if other in FORMAT_KINDS and key in FORMAT_KINDS
             and origin[other] != source), None)
        if clash is not None:
            raise bad_request(f"{source} sets {key}, but {origin[clash]} already sets "
                              f"{clash}; give one format", param=source)
        fields[key] = value
        origin[key] = source

    for key, value in (request.structured_outputs or {}).items():
        if value is not None:  # vLLM's dataclass serialised whole: null means unset
            put(key, value, "structured_outputs")
    for name, key in GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            put(key, value, name)
    # A forced call is the whole answer: no content is left for another format to shape,
    # so the call's schema replaces it, unread, as vLLM's does (options such as
    # structured_outputs' whitespace ones still apply).
    response_format = request.response_format if tool_schema is None else None
    kind = None if response_format is None else response_format.get("type")
    if kind == "json_object":
        put("json_object", True, "response_format")
    elif kind == "json_schema":
        put("json", _response_schema(response_format), "response_format")
    elif response_format is not None and kind != "text":
        raise bad_request(f"response_format type must be 'text', 'json_object' or "
                          f"'json_schema', got {kind!r}", param="response_format")
    if tool_schema is not None:
        put("json", tool_schema, "tool_choice")
    if not fields and request.structured_outputs is None:
        return RequestFormat(None, "structured_outputs")
    try:
        params = StructuredOutputsParams.from_dict(fields)
    except ValueError as error:
        param = next((origin[key] for key in fields if f".{key} " in str(error)),
                     next(iter(origin.values()), "structured_outputs"))
        raise bad_request(str(error), param=param, code="invalid_value") from error
    return RequestFormat(params, origin.get(params.kind, "structured_outputs"))


def _response_schema(response_format: Any) -> Any:
    """The schema of OpenAI's {"type": "json_schema", "json_schema": {"name": ...,
    "schema": {...}, "strict": ...}}."""
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise bad_request("response_format of type 'json_schema' needs json_schema.schema, "
                          "the JSON schema of the answer", param="response_format")
    return spec["schema"]


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """JSON object keys are strings: OpenAI's logit_bias is {"token id": bias}, read as
    Python's int() reads them (" 21285" and "+21285" too), as vLLM reads them. Values are
    clamped to [-100, 100], as vLLM's server does, so a client banning a token with -1e9
    works here too."""
    if bias is None:
        return None
    by_id: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                              f"{key!r}", param="logit_bias", code="invalid_value")
        if math.isnan(value):
            raise bad_request(f"logit_bias[{key}] must be a number, got NaN",
                              param="logit_bias", code="invalid_value")
        by_id[token_id] = clamp_logit_bias(value)
    return by_id


def _named(message: str, field_names: dict[str, str]) -> APIError:
    field, _, rest = message.partition(" ")
    field = field.split("[")[0]
    param = field_names.get(field, field)
    if param != field:
        message = f"{param} {rest}"
    return bad_request(message, param=param, code="invalid_value")
