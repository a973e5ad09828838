"""What the engine hands back: vLLM-shaped records, so client code carries over."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One generated position: the chosen token's logprob and the top alternatives.

    `text_offset` is where the token's text begins in the sample's text, in characters
    (the completions API reports it); tokens that share one character all point at it.
    """

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]
    text_offset: int = 0


@dataclass
class CompletionOutput:
    """One of the request's n samples, cumulative so far.

    While the request runs, `text` may hold back a few trailing characters that could be
    the start of a stop string, so a streamed prefix never has to be taken back.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of the request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step (or its rejection, with `error` set)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it); filled in as the prompt is computed.
    prompt_logprobs: list[Logprob | None] | None = None
