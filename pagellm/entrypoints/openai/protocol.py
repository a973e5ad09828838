"""The request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are parsed strictly: OpenAI rejects `"temperature": "0.5"` or `"n": true`, and a
client that sends them has a bug it should hear about, not a silent coercion. An integral
number is an integer, though: JSON has one kind of number, so `"max_tokens": 8.0` (a
Python client's `int * 0.25`) means 8, as vLLM reads it; 8.5 is refused. Ranges are
not repeated here: `SamplingParams` owns them, so the HTTP API and the Python API can
never disagree about what is valid. Unknown fields are ignored, as vLLM does, so clients
that send options for other servers keep working; but the known options this server
cannot honour (`suffix`, beam search) are declared here so that
`check_supported` can refuse them with a 400: ignoring them would answer 200 with the
wrong kind of output.
"""

from __future__ import annotations

import logging
import time
import types
import uuid
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

logger = logging.getLogger(__name__)

TokenIds = list[int]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# A request's seed, within 64 bits as vLLM's API takes it: a larger one would be reduced
# modulo 2**64 by the sampler, 2**64 drawing as seed 0 does.
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


def _takes_null(annotation: Any) -> bool:
    return annotation is None or annotation is Any or type(None) in get_args(annotation)


def _options(annotation: Any) -> tuple[Any, ...]:
    """The types a field takes: a union's members, each without its Annotated metadata."""
    members = (get_args(annotation) if get_origin(annotation) in (Union, types.UnionType)
               else (annotation,))
    return tuple(get_args(m)[0] if get_origin(m) is Annotated else m for m in members)


def _integral_as_int(options: tuple[Any, ...], value: Any) -> Any:
    """`value` with its integral floats made ints where the field's `options` take an int
    and no float (token ids in lists included): strict parsing would refuse 8.0 for an
    integer."""
    if isinstance(value, float):
        wanted = int in options and float not in options
        return int(value) if wanted and value.is_integer() else value
    if isinstance(value, list):
        items = tuple(member for option in options if get_origin(option) is list
                      for member in _options(get_args(option)[0]))
        if items:
            return [_integral_as_int(items, item) for item in value]
    return value


class StrictModel(BaseModel):
    """A request body. A null where the field takes none means "not given", as OpenAI's
    and vLLM's servers read it (clients that send every field write `"stream": null`):
    the default applies. Where a field takes null, null keeps its own meaning. An
    integral number given for an integer is that integer (see above). The fields it
    ignores are named in a debug line, as vLLM names them: a front-end's
    Ollama-style `num_ctx`, say, that an operator thought was applied."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _as_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if logger.isEnabledFor(logging.DEBUG) and (ignored := data.keys() - cls.model_fields.keys()):
            logger.debug("The following fields were present in the request but ignored: %s",
                         sorted(map(str, ignored)))
        fields = cls.model_fields
        return {key: _integral_as_int(_options(fields[key].annotation), value)
                if key in fields else value
                for key, value in data.items()
                if value is not None or key not in fields
                or _takes_null(fields[key].annotation) or fields[key].is_required()}


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk too


class SamplingFields(StrictModel):
    """Fields shared by both endpoints, with OpenAI's defaults and vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Seed | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, and the
    # guided_* fields of vLLM before 0.11 (see structured_outputs_of).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    echo: bool = False
    best_of: int | None = None
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None  # vLLM's: the answer's id (after the X-Request-Id header)
    # vLLM's: which end truncate_prompt_tokens cuts, "left" (the default: the prompt's
    # last tokens are kept) or "right" (its first).
    truncation_side: Literal["left", "right"] | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's default
    # vLLM's: the prompt's and each choice's token ids beside the text (RL rollouts).
    return_token_ids: bool | None = None
    modalities: list[str] | None = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False  # vLLM's: n beams, the best n returned
    length_penalty: float | None = None  # beam search's (1.0 when not given)
    # Known, and refused when set (see check_supported).
    suffix: Any = None
    audio: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    add_special_tokens: bool = True


class ChatMessage(StrictModel):
    """Any role, as in vLLM: the chat template decides what it accepts. The content's
    parts are read (and refused, naming the part) where the conversation is checked."""

    role: str
    content: str | list[str | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None

    @property
    def completion_budget(self) -> tuple[int | None, str]:
        """The tokens asked for and the field that asked: max_completion_tokens, OpenAI's
        newer name, over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a parser's reasoning out
    # OpenAI's; to the template as `reasoning_effort`, and `enable_thinking` unless
    # "none" (vLLM's rule: templates such as Qwen3's opt in to thinking by it).
    reasoning_effort: ReasoningEffort | None = None
    # Known, and refused when set (see check_supported).
    chat_template: Any = None
    functions: Any = None
    function_call: Any = None


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: a `prompt` (as completions encode it) or `messages` (as chat
    completions render them), so a client can see exactly the tokens a request sends."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    # Known, and refused when set, as for chat completions.
    chat_template: Any = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: TokenIds


# ---- responses ------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class OmitsAbsent(BaseModel):
    """Leaves out the fields in `absent_if_null` when they are null: extras only some
    requests ask for, which the others' clients never see (some schemas reject null)."""

    absent_if_null: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items()
                if value is not None or key not in self.absent_if_null}


class CompletionChoice(OmitsAbsent):
    absent_if_null = ("prompt_token_ids", "token_ids")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    # With return_token_ids (vLLM's): the prompt's ids (a stream's first chunk of the
    # choice) and the choice's generated ids (a stream's new ones).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OmitsAbsent):
    absent_if_null = ("tool_calls", "reasoning", "reasoning_content")

    role: str = "assistant"
    content: str | None = None
    # Left out unless the answer calls tools, as OpenAI's answers leave it out: a client
    # reading `message.get("tool_calls", [])` must not get null, and one sending the
    # message back must not send an empty list (Llama 3.1's template refuses it).
    tool_calls: list[ToolCall] | None = None
    # With --reasoning-parser: vLLM's field, and its older name many clients read (both
    # left out when there is none).
    reasoning: str | None = None
    reasoning_content: str | None = None


class WithoutNulls(BaseModel):
    """Stream pieces leave out what they do not carry, as OpenAI's and vLLM's do: strict
    client schemas reject `"role": null`."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(WithoutNulls):
    """A stream's piece of a tool call: the first names the call (id, type, function
    name), the next ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(OmitsAbsent):
    absent_if_null = ("token_ids",)

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's)


class ChatCompletionResponse(OmitsAbsent):
    absent_if_null = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM's)


class ChatDelta(WithoutNulls):
    """A stream's increment (the role only in the first chunk)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # as in ChatResponseMessage
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(OmitsAbsent):
    absent_if_null = ("token_ids",)

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # the new ones, with return_token_ids (vLLM's)


class ChatCompletionChunk(OmitsAbsent):
    absent_if_null = ("prompt_token_ids",)

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # the first chunk's, with return_token_ids


class ModelPermission(BaseModel):
    """vLLM's (OpenAI's old) permission record; some clients read its flags."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """vLLM's model card: `root` is the model the server loaded (as given, else its
    local directory), `parent` a base model (none: no adapters here)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: TokenIds
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

