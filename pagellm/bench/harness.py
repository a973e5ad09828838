"""Runs one workload through one contender offline: the whole list at once, or a
multi-turn workload round by round (every conversation's next turn once all answers of
the previous round are in, which keeps the turns of each conversation in order)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pagellm.bench.contender import Contender, GenerateRequest
from pagellm.bench.memory import PeakRSS
from pagellm.bench.metrics import RequestRecord, RunResult, summarize
from pagellm.bench.workloads import ConversationState, Tokenizer, Workload

logger = logging.getLogger(__name__)


def warmup_prompt(workload: Workload, tokenizer: Tokenizer) -> list[int]:
    """A short prompt run once before measuring (offline and by each server online), so
    lazy initialisation (allocator, kernels, thread pools) is not billed to the first
    measured requests. The first 16 tokens of the workload's first prompt (a multi-turn
    workload's first turn), valid for any vocabulary, in reverse, so it shares no prefix
    with any prompt; engines with a cache also forget it before an offline run."""
    if workload.is_multi_turn:
        first = ConversationState(workload.conversations[0]).next_prompt(tokenizer)
    else:
        first = list(workload.prompts[0])
    return list(reversed(first[:16]))


def answer_text(tokenizer: Tokenizer, output_ids: list[int]) -> str:
    """What a chat client puts back into the history: the answer's text, special tokens
    (the EOS that ended it) left out."""
    return tokenizer.decode(output_ids, skip_special_tokens=True).strip()


@dataclass
class OfflineRun:
    """A run's figures and its records (the records feed the agreement check)."""

    result: RunResult
    records: list[RequestRecord]


def run_offline(contender: Contender, workload: Workload, tokenizer: Tokenizer) -> OfflineRun:
    """Starts the contender, runs the workload once, closes it; start-up is timed apart.

    Flat workloads ignore EOS so every contender does the same work; multi-turn answers
    end at EOS, as chat answers do, because their text goes into the next turn.
    """
    try:
        startup = contender.start(workload.kv_cache_tokens,
                                  warmup_prompt(workload, tokenizer))
        logger.info("%s started in %.1f s; running %s (%d requests)", contender.name,
                    startup, workload.name, workload.num_requests)
        with PeakRSS(contender.process_id()) as peak:
            origin = time.perf_counter()
            if workload.is_multi_turn:
                records = _run_rounds(contender, workload, tokenizer, origin)
            else:
                records = contender.generate(
                    GenerateRequest(workload.prompts, workload.output_len), origin)
            wall = time.perf_counter() - origin
        result = summarize(contender.name, workload.name, "offline", records, wall,
                           peak_rss_mb=peak.mb, startup_s=startup,
                           timings=contender.timings(), engine=contender.stats())
    finally:
        contender.close()
    return OfflineRun(result, records)


def _run_rounds(contender: Contender, workload: Workload, tokenizer: Tokenizer,
                origin: float) -> list[RequestRecord]:
    states = [ConversationState(script) for script in workload.conversations]
    records: list[RequestRecord] = []
    while not all(state.done for state in states):
        active = [state for state in states if not state.done]
        prompts = [state.next_prompt(tokenizer) for state in active]
        round_records = contender.generate(
            GenerateRequest(prompts, workload.output_len, ignore_eos=False), origin)
        for state, record in zip(active, round_records, strict=True):
            state.record_answer(answer_text(tokenizer, record.output_ids))
        records.extend(round_records)
    return records
