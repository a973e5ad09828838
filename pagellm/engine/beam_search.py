"""Beam search on the prefix cache, ranked as transformers' `generate(num_beams=k)` ranks.

A step of a search asks the engine for the next token of every live beam as an ordinary
one-token request whose prompt is the beam's whole sequence, with the logprobs of its
best continuations. Whatever a beam shares with the prompt and with its parent beam, up
to the last full block, comes from the prefix cache, so a step computes at most one
block's worth of tokens per beam however long the prompt (vLLM v1 runs its beam search
the same way). Below the engine's loop nothing knows about beams: they are scheduled,
preempted and evicted like any request. beam_searches.py runs the steps.

`BeamSearch` is the selection, kept apart from the engine so it can be checked against
transformers' own loop: each step ranks the best `candidates` continuations of all beams
by cumulative logprob; those of the first `beam_width` that end (EOS, or the length
limit) are scored `cumulative logprob / length ** length_penalty` and kept if among the
best `beam_width` finished so far; the best `beam_width` that go on are the next beams.
The search stops at the length limit, or once `beam_width` sequences have finished and
the best running beam, scored at its current length, cannot beat the worst of them
(transformers' default `early_stopping=False` heuristic). Scores are summed in float64
(transformers: float32), so only a true near-tie can rank differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagellm.core.sampling_params import BeamSearchParams
from pagellm.engine.outputs import Logprob


@dataclass
class BeamSearchSequence:
    """One returned sequence, in vLLM's shape: `tokens` is the prompt followed by the
    generated tokens (EOS included when it ended the beam), `text` their text, and
    `logprobs` one entry per generated token (its logprob, rank and the step's best
    alternatives)."""

    tokens: list[int]
    logprobs: list[Logprob]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class Beam:
    """A generated continuation of the prompt: its tokens, their logprobs, their sum,
    and, once finished, its score and why it ended ("stop" on EOS, else "length")."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    cum_logprob: float = 0.0
    score: float = 0.0
    finish_reason: str | None = None


@dataclass(frozen=True)
class _Candidate:
    cum_logprob: float
    beam: int
    rank: int
    token_id: int
    logprob: float


class BeamSearch:
    """The beams of one prompt, advanced one step at a time by `advance`."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int],
                 max_new_tokens: int) -> None:
        self.width = params.beam_width
        self.length_penalty = params.length_penalty
        self.stop_tokens = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = params.candidates(len(eos_token_ids))
        self.max_new_tokens = max_new_tokens
        self.running = [Beam()]
        self.finished: list[Beam] = []
        self.done = False

    def advance(self, tops: list[list[tuple[int, float]]]) -> None:
        """One step: `tops[i]` holds running beam i's best continuations, (token id,
        logprob) best first, at least `num_candidates` of them."""
        assert not self.done and len(tops) == len(self.running)
        ranked = sorted(
            (_Candidate(self.running[beam].cum_logprob + logprob, beam, rank, token, logprob)
             for beam, top in enumerate(tops)
             for rank, (token, logprob) in enumerate(top[:self.num_candidates], 1)),
            # Ties go to the earlier beam, then the smaller token id (transformers' topk
            # leaves their order to the device).
            key=lambda c: (-c.cum_logprob, c.beam, c.token_id))[:self.num_candidates]
        length = len(self.running[0].token_ids) + 1
        at_limit = length >= self.max_new_tokens
        going_on: list[Beam] = []
        for position, candidate in enumerate(ranked):
            parent = self.running[candidate.beam]
            ends = at_limit or candidate.token_id in self.stop_tokens
            if ends and position >= self.width:
                continue  # only the best `width` may finish
            if not ends and len(going_on) == self.width:
                continue
            top = tops[candidate.beam]
            beam = Beam(parent.token_ids + [candidate.token_id],
                        parent.logprobs + [Logprob(
                            candidate.token_id, candidate.logprob, candidate.rank,
                            top[:self.num_candidates])],
                        candidate.cum_logprob)
            if ends:
                beam.score = length_score(beam.cum_logprob, length, self.length_penalty)
                beam.finish_reason = ("stop" if candidate.token_id in self.stop_tokens
                                      else "length")
                self.finished.append(beam)
            else:
                going_on.append(beam)
        # Stable: among equal scores the earlier finished stays ahead.
        self.finished.sort(key=lambda b: -b.score)
        del self.finished[self.width:]
        self.running = going_on  # empty only at the limit, where every candidate ends
        self.done = at_limit or (
            len(self.finished) == self.width
            and length_score(going_on[0].cum_logprob, length, self.length_penalty)
            <= self.finished[-1].score)


def length_score(cum_logprob: float, length: int, penalty: float) -> float:
    """`cum_logprob / length ** penalty`, transformers' score of a finished beam, for
    any finite penalty: a divisor past the floats' range scores 0, and one that
    underflows to 0 scores -inf (0 for a certain beam). Raised inside the engine's step,
    the arithmetic errors would fail every request in it, not only this one."""
    try:
        return cum_logprob / math.pow(length, penalty)
    except OverflowError:
        return -0.0 if cum_logprob < 0 else 0.0
    except ZeroDivisionError:
        return -math.inf if cum_logprob < 0 else 0.0
