"""What a side-by-side run concludes: ratios against PageLLM with caching, greedy
agreement between contenders, and the issue's targets, each PASS, FAIL or n/a."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pagellm.bench.metrics import RequestRecord, RunResult
from pagellm.bench.workloads import default_params

PAGELLM = "pagellm"
PAGELLM_NOCACHE = "pagellm-nocache"
HF_GENERATE = "hf-generate"
HF_CONTINUOUS = "hf-cb"
VLLM = "vllm"
VLLM_NOCACHE = "vllm-nocache"
TRANSFORMERS = (HF_GENERATE, HF_CONTINUOUS)


@dataclass
class Comparison:
    """One workload in one mode, every contender run one after another on it."""

    label: str
    workload: str
    mode: str
    params: dict[str, Any]
    concurrency: int
    runs: list[RunResult] = field(default_factory=list)
    agreement: dict[str, dict[str, float]] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    request_rate: float | None = None
    failed: list[str] = field(default_factory=list)  # contenders that raised

    @property
    def paced(self) -> bool:
        """Online requests sent at a finite rate: the client, not the engine, then sets
        the throughput, as long as the engine keeps up."""
        return self.mode == "online" and self.request_rate is not None \
            and math.isfinite(self.request_rate)

    def run(self, contender: str) -> RunResult | None:
        return next((r for r in self.runs if r.contender == contender), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(a: float, b: float) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b


def add_ratios(comparison: Comparison) -> None:
    """Each contender against the first run (the first contender listed that ran):
    throughput as contender/baseline, TTFT as contender/baseline (so >1 means slower)."""
    if not comparison.runs:
        return
    base = comparison.runs[0]
    for run in comparison.runs:
        comparison.ratios[run.contender] = {
            "output_tokens_per_s": _ratio(run.output_tokens_per_s, base.output_tokens_per_s),
            "ttft_mean": _ratio(run.ttft["mean"], base.ttft["mean"]),
        }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def agreement(reference: list[RequestRecord], other: list[RequestRecord],
              first: int) -> dict[str, float]:
    """On the first `first` requests: the fraction of identical greedy outputs and the
    mean length of the common prefix (how far they go together before they part)."""
    pairs = [(a.output_ids, b.output_ids)
             for a, b in zip(reference[:first], other[:first], strict=False)
             if a.output_ids and b.output_ids]
    if not pairs:
        return {"compared": 0, "identical": math.nan, "mean_common_prefix": math.nan,
                "mean_length": math.nan}
    return {"compared": len(pairs),
            "identical": sum(a == b for a, b in pairs) / len(pairs),
            "mean_common_prefix": sum(common_prefix(a, b) for a, b in pairs) / len(pairs),
            "mean_length": sum(len(a) for a, _ in pairs) / len(pairs)}


@dataclass
class Target:
    """One of the issue's targets checked on one comparison."""

    target: str
    where: str
    measured: str
    status: str
    note: str = ""


def _status(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def _fmt(value: float, suffix: str = "x") -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2f}{suffix}"


def _throughput_target(comp: Comparison, target: str, where: str, ratio: float,
                       goal: float, note: str = "", shown: str | None = None) -> Target:
    """A throughput ratio is a verdict only where the engine sets the pace: with paced
    online arrivals every contender that keeps up serves what the client sends (a
    multi-turn conversation's later turns follow its answers, but its start is paced), so
    the ratio is shown but the target is n/a there (latency is what such a run compares)."""
    shown = _fmt(ratio) if shown is None else shown
    if comp.paced:
        paced = (f"arrivals paced at {comp.request_rate:g}/s set most of the throughput; "
                 "compare TTFT")
        return Target(target, where, shown, "n/a", f"{note}; {paced}" if note else paced)
    return Target(target, where, shown,
                  _status(None if math.isnan(ratio) else ratio >= goal), note)


FLOAT32 = "float32"


def run_precision(engine_kwargs: dict[str, Any]) -> str:
    """What PageLLM computed in, as the report names it: float32 (the model's, the
    targets'), int8 activations, or float32 with a KV pool of another type."""
    if engine_kwargs.get("quantize_activations"):
        return "int8 activations"
    kv_dtype = engine_kwargs.get("kv_cache_dtype")
    if kv_dtype not in (None, "auto", FLOAT32):
        return f"{FLOAT32}, {kv_dtype} KV pool"
    return FLOAT32


def evaluate_targets(comparisons: list[Comparison],
                     precision: str = FLOAT32) -> list[Target]:
    """The issue's targets, on every comparison they apply to. A target whose contender
    was not run (vLLM without --vllm-python, no comparison at 64 running requests) is
    listed as n/a with the reason, so the report never hides one. The per-workload targets
    apply to the standard comparisons (labelled with their workload's name); a derived
    one, such as a shared-prefix run shaped for 64 running requests, only feeds the
    bookkeeping target. They are stated for PageLLM in float32: a run in another
    `precision` (see run_precision) has its ratios shown, not judged."""
    targets = _judged_targets(comparisons)
    if precision != FLOAT32:
        note = f"not judged: the targets are stated for float32 (this run: {precision})"
        targets = [Target(t.target, t.where, t.measured, "n/a", note) for t in targets]
    return targets


def _judged_targets(comparisons: list[Comparison]) -> list[Target]:
    targets: list[Target] = []
    for comp in comparisons:
        if comp.label == comp.workload:
            targets += _workload_targets(comp)
    at_64 = [c for c in comparisons
             if (run := c.run(PAGELLM)) is not None and run.bookkeeping_share is not None
             and (run.peak_decoding or 0) >= 64]
    for comp in at_64:
        share = comp.run(PAGELLM).bookkeeping_share  # type: ignore[union-attr]
        assert share is not None
        targets.append(Target("bookkeeping <= 5% of step time at 64 running requests",
                              f"{comp.label} ({comp.mode})", _fmt(share * 100, "%"),
                              _status(None if math.isnan(share) else share <= 0.05),
                              "(schedule + prepare + update) / step, every step of the run"))
    if not at_64:
        targets.append(Target("bookkeeping <= 5% of step time at 64 running requests", "-",
                              "n/a", "n/a", "no offline run had 64 requests decoding at once"))
    return targets


def _workload_targets(comp: Comparison) -> list[Target]:
    """The targets of one standard comparison; verdicts only at the workload's default
    sizes, which the targets are stated for (a shrunk run's ratios are shown, not judged:
    8 requests cannot show what caching buys 32)."""
    targets: list[Target] = []
    where = f"{comp.label} ({comp.mode})"
    on, off = comp.run(PAGELLM), comp.run(PAGELLM_NOCACHE)
    if comp.workload == "shared-prefix" and on and off:
        speedup = _ratio(on.output_tokens_per_s, off.output_tokens_per_s)
        targets.append(_throughput_target(
            comp, "caching on >= 8x output throughput of caching off", where, speedup, 8))
        ttft = _ratio(off.ttft["mean"], on.ttft["mean"])
        targets.append(Target("caching on: mean TTFT >= 10x lower than off", where,
                              _fmt(ttft), _status(None if math.isnan(ttft) else ttft >= 10)))
    if comp.workload == "no-sharing" and on and off:
        kept = _ratio(on.output_tokens_per_s, off.output_tokens_per_s)
        targets.append(_throughput_target(
            comp, "no-sharing: caching costs <= 2% throughput", where, kept, 0.98,
            shown=_fmt((1 - kept) * 100 if not math.isnan(kept) else kept, "%")))
    if on is not None:
        targets += _against_others(comp, on, where)
    sizes = default_params(comp.workload)
    changed = sorted(k for k, v in sizes.items() if comp.params.get(k, v) != v)
    if changed:
        note = (f"not judged: the targets are stated for the default sizes "
                f"({', '.join(f'{k}={sizes[k]}' for k in changed)})")
        targets = [Target(t.target, t.where, t.measured, "n/a", note) for t in targets]
    return targets


def _against_others(comp: Comparison, on: RunResult, where: str) -> list[Target]:
    """PageLLM with caching against vLLM with caching and the faster transformers."""
    targets: list[Target] = []
    vllm = comp.run(VLLM)
    missing = ("" if vllm else "vLLM failed (see the notes)" if VLLM in comp.failed
               else "vLLM with caching not run (give --vllm-python)")
    ratio = _ratio(on.output_tokens_per_s, vllm.output_tokens_per_s) if vllm else math.nan
    targets.append(_throughput_target(
        comp, "PageLLM(caching) >= 2x vLLM-cpu(caching) throughput", where, ratio, 2,
        missing))
    ttft = _ratio(vllm.ttft["mean"], on.ttft["mean"]) if vllm else math.nan
    targets.append(Target("PageLLM(caching): lower mean TTFT than vLLM-cpu(caching)", where,
                          _fmt(ttft), _status(None if math.isnan(ttft) else ttft > 1),
                          missing or "vLLM's mean TTFT / PageLLM's"))
    hf = [r for r in comp.runs if r.contender in TRANSFORMERS]
    if hf:
        best = max(hf, key=lambda r: r.output_tokens_per_s or 0.0)
        ratio = _ratio(on.output_tokens_per_s, best.output_tokens_per_s)
        targets.append(_throughput_target(
            comp, "PageLLM(caching) >= 5x transformers throughput", where, ratio, 5,
            f"against the faster transformers contender, {best.contender}"))
    return targets
