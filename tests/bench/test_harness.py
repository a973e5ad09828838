"""The offline harness with a stand-in contender: flat workloads go in one call,
multi-turn workloads go round by round with each answer in the next turn's prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagellm.bench.contender import GenerateRequest
from pagellm.bench.harness import run_offline
from pagellm.bench.metrics import RequestRecord
from pagellm.bench.workloads import build_workload


class EchoContender:
    """Answers every prompt with the same few tokens, and remembers what it was sent."""

    name = "echo"

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer
        self.calls: list[GenerateRequest] = []
        self.started_with: tuple[int | None, list[int]] | None = None
        self.closed = False

    def start(self, kv_cache_tokens: int | None, warmup: list[int]) -> float:
        self.started_with = (kv_cache_tokens, warmup)
        return 0.5

    def generate(self, request: GenerateRequest, origin: float) -> list[RequestRecord]:
        self.calls.append(request)
        return [RequestRecord(prompt_len=len(p), output_len=len(self.answer),
                              output_ids=list(self.answer), arrival=0.0, first_token=0.1,
                              finish=0.2, token_times=[0.1, 0.15, 0.2], cached_tokens=0)
                for p in request.prompts]

    def process_id(self) -> int | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"calls": len(self.calls)}

    def timings(self) -> dict[str, float] | None:
        return None

    def close(self) -> None:
        self.closed = True


def test_flat_workload_is_one_call_with_eos_ignored(tokenizer: Any) -> None:
    workload = build_workload("eviction", tokenizer, num_requests=5, num_prefixes=3,
                              prefix_len=32, suffix_len=8, output_len=3)
    contender = EchoContender([11, 12, 13])
    run = run_offline(contender, workload, tokenizer)
    (call,) = contender.calls
    assert call.ignore_eos and call.max_tokens == 3 and list(call.prompts) == list(workload.prompts)
    assert contender.started_with is not None
    assert contender.started_with[0] == workload.kv_cache_tokens
    assert contender.started_with[1] == list(reversed(workload.prompts[0][:16]))
    assert contender.closed
    assert run.result.num_requests == 5 and run.result.output_tokens == 15
    assert run.result.startup_s == 0.5 and run.result.engine == {"calls": 1}


def test_multi_turn_goes_round_by_round_with_the_answers_in_the_history(tokenizer: Any) -> None:
    workload = build_workload("multi-turn", tokenizer, num_conversations=2, num_turns=3,
                              system_len=32, user_len=16, output_len=3)
    answer = tokenizer.encode(" Blue whales sing.", add_special_tokens=False)
    contender = EchoContender(answer)
    run = run_offline(contender, workload, tokenizer)
    assert len(contender.calls) == 3
    assert all(not call.ignore_eos and len(call.prompts) == 2 for call in contender.calls)
    for earlier, later in zip(contender.calls, contender.calls[1:], strict=False):
        for before, after in zip(earlier.prompts, later.prompts, strict=True):
            assert list(after[: len(before)]) == list(before)
            assert len(after) > len(before)
    assert "Blue whales sing." in tokenizer.decode(list(contender.calls[1].prompts[0]))
    assert tokenizer.decode(list(contender.calls[2].prompts[1])).count("Blue whales sing.") == 2
    assert run.result.num_requests == 6


def test_repeats_alternate_the_order_and_report_the_median(tokenizer: Any,
                                                          monkeypatch: Any) -> None:
    from pagellm.bench import suite

    order: list[str] = []

    def factory(name: str, options: suite.BenchOptions) -> EchoContender:
        contender = EchoContender([5, 6])
        contender.name = name
        order.append(name)
        return contender

    monkeypatch.setattr(suite, "_offline_contender", factory)
    workload = build_workload("shared-prefix", tokenizer, num_requests=2, prefix_len=32,
                              suffix_len=4, output_len=2)
    options = suite.BenchOptions(model_dir=Path("unused"),
                                 contenders=("pagellm", "pagellm-nocache"), repeats=3)
    comparison = suite.run_comparison(workload, "offline", options, tokenizer)
    assert order == ["pagellm", "pagellm-nocache", "pagellm-nocache", "pagellm",
                     "pagellm", "pagellm-nocache"]
    assert [r.contender for r in comparison.runs] == ["pagellm", "pagellm-nocache"]
    assert all(any("median of 3 repeats" in n for n in r.notes) for r in comparison.runs)
    assert comparison.agreement["pagellm-nocache"]["identical"] == 1.0
