"""The bodies of Anthropic's Messages API (`POST /v1/messages`), as pydantic models.

Parsed as strictly as the OpenAI bodies (see protocol.py). Content blocks and tools stay
plain dicts: their kinds are checked where they become a chat conversation
(serving_messages.py), with errors that name the block (`messages[1].content[0]`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from pagellm.entrypoints.openai.protocol import Seed, StrictModel, WithoutNulls


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: Any  # a string or content blocks, checked where they become chat messages


class MessagesRequest(StrictModel):
    """Anthropic's fields, then the sampling extras vLLM's Messages API takes too."""

    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage]
    system: Any = None  # a string or text blocks, checked with the messages
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    # vLLM's Messages API range (Anthropic's own is [0, 1]).
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its format: structured output
    output_format: dict[str, Any] | None = None  # the older SDKs' place for the format
    # vLLM's extras.
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: int = 0
    seed: Seed | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    structured_outputs: dict[str, Any] | None = None
    # Known, and refused when set.
    mcp_servers: Any = None
    container: Any = None
    thread: Any = None


class CountTokensRequest(StrictModel):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: Any = None
    tools: list[dict[str, Any]] | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class MessagesUsage(BaseModel):
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, the rest were
    read from the prefix cache (nothing is ever written on request: the cache is
    automatic), so their sum is the prompt, as vLLM counts it."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class ContentBlock(WithoutNulls):
    """A text block (`text`), a tool_use block (`id`, `name`, `input`) or, with a
    reasoning parser, a thinking block (`thinking`, `signature`)."""

    type: Literal["text", "tool_use", "thinking"]
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class StreamEvent(WithoutNulls):
    """One event of a streamed message; its fields depend on `type`."""

    type: str
    message: MessagesResponse | None = None
    index: int | None = None
    content_block: ContentBlock | None = None
    delta: dict[str, Any] | None = None
    usage: dict[str, int] | None = None
    error: dict[str, str] | None = None
