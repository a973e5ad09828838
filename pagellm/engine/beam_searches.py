"""The engine's beam searches in flight, each run as steps of ordinary requests.

A step of a search queues one one-token request per beam through the engine's own
`add_request`, whose prompt is the beam's whole sequence and which asks for the logprobs
of the continuations the step ranks (see beam_search.py for why that costs at most a
block's worth of tokens per beam). The engine hands every step's outputs to `collect`,
which keeps those of these requests to itself: once all beams of a step are in, the
search advances, then queues its next step or puts its own output in their place.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.core.sampling_params import MAX_LOGPROBS, BeamSearchParams, SamplingParams
from pagellm.engine.beam_search import BeamSearch
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.metrics import CompletionEnd, RequestEnd
from pagellm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from pagellm.engine.llm_engine import LLMEngine


@dataclass
class _Run:
    """A search: its selection state, and the requests of its current step, whose
    results `tops` collects by beam."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    search: BeamSearch
    step_params: SamplingParams
    cache_salt: str | None
    priority: int
    metrics: RequestMetrics
    pending: list[str] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)
    num_cached_tokens: int | None = None


class BeamSearches:
    """The searches of one engine, by request id, and the step requests they own."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._runs: dict[str, _Run] = {}
        self._steps: dict[str, tuple[_Run, int]] = {}  # step request id -> (search, beam)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is one of a search's step requests."""
        return request_id in self._steps

    def start(self, request_id: str, text: str | None, token_ids: list[int],
              params: BeamSearchParams, cache_salt: str | None, arrival_time: float,
              priority: int) -> None:
        """Starts a search with its prompt as the first step. A ValueError (a width too
        large for the model's EOS tokens, more logprobs than a step ranks) queues
        nothing."""
        engine = self._engine
        num_candidates = params.candidates(len(engine.eos_token_ids))
        if num_candidates > MAX_LOGPROBS:
            raise ValueError(
                f"beam_width {params.beam_width} ranks {num_candidates} continuations a "
                f"step with this model's {len(engine.eos_token_ids)} EOS tokens; at most "
                f"{MAX_LOGPROBS} can be read (set ignore_eos, or a smaller beam_width)")
        if params.logprobs is not None and params.logprobs > num_candidates:
            raise ValueError(f"logprobs must be at most {num_candidates} with beam_width "
                             f"{params.beam_width} (the continuations a step ranks), got "
                             f"{params.logprobs}")
        search = BeamSearch(params, engine.eos_token_ids,
                            min(params.max_tokens, engine.max_model_len - len(token_ids)))
        run = _Run(request_id, text, token_ids, params, search,
                   SamplingParams(temperature=0.0, max_tokens=1, logprobs=num_candidates,
                                  detokenize=False),
                   cache_salt, priority, RequestMetrics(arrival_time))
        self._queue_step(run)
        self._runs[request_id] = run

    def abort(self, request_id: str) -> None:
        """Ends a search now, with its step's requests."""
        self._end(self._runs[request_id], None)

    def _end(self, run: _Run, reason: str | None) -> None:
        """Ends a search unfinished (aborted, or failed: `reason` "error") and records it
        as one request of `beam_width` completions."""
        del self._runs[run.request_id]
        for step_id in run.pending:
            if self._steps.pop(step_id, None) is not None:  # not yet collected
                self._engine._end_aborted(step_id, record=False)
        run.metrics.finished_time = time.monotonic()
        self._engine.latencies.ended(_request_end(run, [reason] * run.params.beam_width,
                                                  completed=reason is not None))

    def step_ids(self) -> list[tuple[str, str]]:
        """(step request id, its search's id) of every step request not yet collected."""
        return [(step_id, run.request_id) for step_id, (run, _) in self._steps.items()]

    def started(self) -> set[str]:
        """The searches that have finished a step."""
        return {run.request_id for run in self._runs.values()
                if run.metrics.first_token_time is not None}

    def _queue_step(self, run: _Run) -> None:
        """One request per running beam, in the search's place in the queue (its arrival
        time and priority), with an id of the search's own. A caller adding that id
        while the step runs is refused; one who took it first gets to keep it, and the
        step's id is extended."""
        run.pending = []
        run.tops = [None] * len(run.search.running)
        engine = self._engine
        for index, beam in enumerate(run.search.running):
            step_id = f"{run.request_id}/beam{len(beam.token_ids)}.{index}"
            while engine.has_request(step_id):
                step_id += "'"
            engine.add_request(step_id, run.prompt_token_ids + beam.token_ids,
                               run.step_params, arrival_time=run.metrics.arrival_time,
                               priority=run.priority, cache_salt=run.cache_salt)
            run.pending.append(step_id)
            self._steps[step_id] = (run, index)

    def collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's `outputs` less those of step requests, plus the outputs of the
        searches that ended (done, or failed with a step's error)."""
        if not self._steps:
            return outputs
        kept: list[RequestOutput] = []
        ended: set[str] = set()
        for output in outputs:
            owner = self._steps.pop(output.request_id, None)
            if owner is None:
                if output.request_id not in ended:
                    kept.append(output)
                continue
            run, beam = owner
            if output.error is not None:
                ended.update(run.pending)
                self._end(run, "error")
                kept.append(self._output(run, output.error))
                continue
            if run.num_cached_tokens is None:  # the prompt's own step
                run.num_cached_tokens = output.num_cached_tokens
                assert output.metrics is not None
                run.metrics.first_scheduled_time = output.metrics.first_scheduled_time
            logprobs = output.outputs[0].logprobs
            assert output.finished and logprobs
            run.tops[beam] = logprobs[0].top_logprobs
            if all(top is not None for top in run.tops):
                self._advance(run, kept)
        return kept

    def _advance(self, run: _Run, kept: list[RequestOutput]) -> None:
        """Takes a step's results: each running beam gained a token (the first step's
        is the first token of all `beam_width` sequences the search returns)."""
        extended = len(run.search.running)
        run.search.advance([top for top in run.tops if top is not None])
        now = time.monotonic()
        metrics = run.metrics
        latencies = self._engine.latencies
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            for _ in range(run.params.beam_width):
                latencies.first_token(now - metrics.arrival_time)
        else:
            assert metrics.last_token_time is not None
            for _ in range(extended):
                latencies.token_gap(now - metrics.last_token_time)
        metrics.last_token_time = now
        metrics.token_times.append(now)
        if run.search.done:
            metrics.finished_time = now
            del self._runs[run.request_id]
            latencies.ended(_request_end(
                run, [beam.finish_reason for beam in run.search.finished], completed=True))
            kept.append(self._output(run))
        else:
            self._queue_step(run)

    def _output(self, run: _Run, error: str | None = None) -> RequestOutput:
        """The search's sequences as completions, best first, detokenized as any
        request's: `token_ids` keep the EOS that ended a beam, whose text only shows with
        include_stop_str_in_output, and each logprob's text_offset points into `text`
        (with `params.logprobs` of its alternatives)."""
        params = run.params
        engine = self._engine
        decode = engine.decode_token
        completions = []
        for index, beam in enumerate([] if error is not None else run.search.finished):
            detokenizer = IncrementalDetokenizer(engine.tokenizer, run.prompt_token_ids, [],
                                                 params.include_stop_str_in_output,
                                                 params.skip_special_tokens)
            logprobs = []
            for position, logprob in enumerate(beam.logprobs):
                logprobs.append(dataclasses.replace(
                    logprob, text_offset=len(detokenizer.text),
                    top_logprobs=logprob.top_logprobs[:params.logprobs], decode=decode))
                ends = position == len(beam.token_ids) - 1 and beam.finish_reason == "stop"
                if not ends or params.include_stop_str_in_output:
                    detokenizer.add_token(logprob.token_id)
            detokenizer.finish()
            completions.append(CompletionOutput(index, detokenizer.text,
                                                list(beam.token_ids), beam.finish_reason,
                                                None, logprobs, beam.cum_logprob))
        return RequestOutput(run.request_id, run.prompt, run.prompt_token_ids, completions,
                             True, run.num_cached_tokens or 0, run.metrics,
                             error=error)


def _request_end(run: _Run, reasons: list[str | None], completed: bool) -> RequestEnd:
    """A search as the metrics record it: one request of `beam_width` completions, the
    finished beams' lengths first, then the running ones' (none before its first step),
    all ending at the search's last token. Its steps' requests are each preempted or
    not; the search counts none."""
    search = run.search
    lengths = [len(beam.token_ids) for beam in [*search.finished, *search.running]]
    lengths = (lengths + [0] * len(reasons))[:len(reasons)]
    return RequestEnd(run.metrics, [CompletionEnd(reason, length)
                                    for reason, length in zip(reasons, lengths, strict=True)],
                      len(run.prompt_token_ids), run.params.max_tokens, completed)
