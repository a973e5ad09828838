"""What the engine hands back: vLLM-shaped records, so client code carries over."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from pagellm.core.sampling_params import RequestOutputKind


@dataclass(frozen=True)
class TokenLogprob:
    """One token's entry at a position, as vLLM's `Logprob`: its logprob, its rank in
    the vocabulary (1 = likeliest), and its text."""

    logprob: float
    rank: int
    decoded_token: str | None


@dataclass(frozen=True)
class _Texts:
    """Token texts already decoded: a pickled or copied `Logprob`'s `decode`."""

    texts: dict[int, str]

    def __call__(self, token_id: int) -> str:
        return self.texts[token_id]


@dataclass
class Logprob(Mapping[int, TokenLogprob]):
    """One position: the chosen token's logprob and the top alternatives.

    It is also the read-only mapping vLLM gives for a position, {token id: TokenLogprob}
    with the chosen token first and then the top ones, so vLLM code (`lp[token_id]
    .logprob`, `lp.items()`, `.decoded_token`) runs unchanged. `decode` turns a token id
    into its text when an entry is read, so the engine never decodes alternatives nobody
    looks at.

    `text_offset` is where the token's text begins in the sample's text, in characters
    (the completions API reports it); tokens that share one character all point at it.
    """

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[tuple[int, float]]
    text_offset: int = 0
    decode: Callable[[int], str] | None = field(default=None, repr=False, compare=False)

    def _entries(self) -> dict[int, tuple[float, int]]:
        entries = {self.token_id: (self.logprob, self.rank)}
        for rank, (token_id, logprob) in enumerate(self.top_logprobs, 1):
            entries.setdefault(token_id, (logprob, rank))
        return entries

    def __getitem__(self, token_id: int) -> TokenLogprob:
        logprob, rank = self._entries()[token_id]
        return TokenLogprob(logprob, rank,
                            None if self.decode is None else self.decode(token_id))

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())

    def __getstate__(self) -> dict[str, object]:
        """Pickled and deep-copied (Ray, multiprocessing queues) with its entries' texts,
        not with the engine's decoder: a copy of every output would carry the whole
        tokenizer along."""
        state = dict(self.__dict__)
        if self.decode is not None and not isinstance(self.decode, _Texts):
            state["decode"] = _Texts({token_id: self.decode(token_id) for token_id in self})
        return state

    def __repr__(self) -> str:
        """As the dict vLLM gives: {token id: TokenLogprob(...)}, the chosen token first."""
        return repr(dict(self.items()))

    def __eq__(self, other: object) -> bool:
        """Equal to another position field by field, and to a plain mapping when their
        {token id: TokenLogprob} items are (as vLLM's dicts compare)."""
        if isinstance(other, Logprob):
            return (self.token_id, self.logprob, self.rank, self.top_logprobs,
                    self.text_offset) == (other.token_id, other.logprob, other.rank,
                                          other.top_logprobs, other.text_offset)
        if isinstance(other, Mapping):
            return dict(self.items()) == dict(other.items())
        return NotImplemented


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

    def finished(self) -> bool:
        """A method, as in vLLM (where `RequestOutput.finished` is a field)."""
        return self.finish_reason is not None

    @property
    def lora_request(self) -> None:
        """vLLM's field: always None (no adapters here), for code that reads it."""
        return None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (time.monotonic) of the request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # One entry per generated token: left out of the repr, which a notebook shows whole
    # (a 2,000-token answer's repr was 34 KB of timestamps).
    token_times: list[float] = field(default_factory=list, repr=False)

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

    # vLLM's fields for what PageLLM does not run (adapters, encoder-decoder models, KV
    # transfer between instances): always None, so code written for vLLM reads them.
    @property
    def lora_request(self) -> None:
        return None

    @property
    def encoder_prompt(self) -> None:
        return None

    @property
    def encoder_prompt_token_ids(self) -> None:
        return None

    @property
    def kv_transfer_params(self) -> None:
        return None


class OutputShaper:
    """A request's outputs as its `output_kind` asks, made from the engine's cumulative
    ones: each whole, only what is new since the last one shaped, or the final one
    only. Shaping from cumulative outputs keeps DELTA right when a reader skipped some
    (the async engine keeps only each request's newest output): the next delta holds
    everything since the last one read. A DELTA sample that finished is not sent again
    (as in vLLM: a reader counting finish reasons counts each once)."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._sent: dict[int, tuple[int, int, int]] = {}  # index: text, tokens, logprobs
        self._finished_sent: set[int] = set()
        self._prompt_logprobs_sent = False

    def wants(self, finished: bool) -> bool:
        """Whether an output is handed on at all (FINAL_ONLY: only the last), so that
        one held back need not be built."""
        return finished or self.kind is not RequestOutputKind.FINAL_ONLY

    def __call__(self, output: RequestOutput) -> RequestOutput | None:
        """The output to hand on, or None where FINAL_ONLY holds it back."""
        if not self.wants(output.finished):
            return None
        if self.kind is not RequestOutputKind.DELTA:
            return output
        completions = []
        for completion in output.outputs:
            if completion.index in self._finished_sent:
                continue
            if completion.finished():
                self._finished_sent.add(completion.index)
            text, tokens, logprobs = self._sent.get(completion.index, (0, 0, 0))
            completions.append(dataclasses.replace(
                completion, text=completion.text[text:],
                token_ids=completion.token_ids[tokens:],
                logprobs=None if completion.logprobs is None else completion.logprobs[logprobs:]))
            self._sent[completion.index] = (len(completion.text), len(completion.token_ids),
                                            len(completion.logprobs or ()))
        prompt_logprobs = None if self._prompt_logprobs_sent else output.prompt_logprobs
        self._prompt_logprobs_sent = True
        return dataclasses.replace(output, outputs=completions, prompt_logprobs=prompt_logprobs)
