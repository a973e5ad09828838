"""The bodies of OpenAI's Responses API (`POST /v1/responses`), as pydantic models.

Parsed as strictly as the chat and completion bodies (see protocol.py): unknown fields
are ignored, known ones this server cannot honour are declared so that responses_to_chat
can refuse them with a 400. The input items and tools stay plain dicts here: their many
kinds are checked where they are turned into a chat conversation, with messages that name
the item (`input[2].call_id`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pagellm.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    Seed,
    StrictModel,
    WithoutNulls,
)


class ResponsesRequest(StrictModel):
    """OpenAI's fields, then the sampling extras vLLM's Responses API takes too."""

    model: str | None = None
    input: str | list[Any]  # items, checked in responses_to_chat (errors name the item)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    metadata: dict[str, str] | None = None
    user: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's, as in chat
    # Accepted and echoed: they change nothing for the models this server runs.
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None  # counts built-in tools' calls, of which there are none
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's sampling extras (as in its ResponsesRequest).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    # Known, and refused when set (see responses_to_chat.check_options).
    background: bool = False
    conversation: Any = None
    prompt: Any = None


# Of a response and of each output item.
Status = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Status


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The answer's reasoning, with a reasoning parser (as vLLM gives it: the text in
    `content`, no summary)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    status: Status


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(BaseModel):
    """A response as OpenAI returns it: the output and usage, and the request's settings
    echoed back."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Status
    error: None = None  # a failed request is an HTTP error or an "error" event instead
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    top_logprobs: int
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    truncation: str
    metadata: dict[str, str]
    store: bool
    background: bool = False
    reasoning: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    user: str | None = None


class InputItemList(BaseModel):
    """A page of a response's input items (GET /v1/responses/{id}/input_items)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class StreamEvent(WithoutNulls):
    """One event of a streamed response (its fields depend on `type`; the unused stay
    out of the JSON)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputItem | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[ChatTokenLogprob] | None = None
    # An "error" event's.
    code: str | None = None
    message: str | None = None
    param: str | None = None
