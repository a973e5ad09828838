"""Writes a benchmark's results: JSON (everything, for tools), Markdown (the tables a
person reads, targets first) and PNG plots (throughput, TTFT distribution, hit rate over
time)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagellm.bench.compare import FLOAT32, Comparison, Target, evaluate_targets, run_precision
from pagellm.bench.metrics import RunResult

# The meta entry the targets read back: they are judged for float32 only.
PRECISION_KEY = "PageLLM precision"
JSON_NAME = "results.json"
MARKDOWN_NAME = "results.md"
PLOT_NAMES = ("throughput.png", "ttft.png", "hit_rate.png")


@dataclass
class BenchReport:
    meta: dict[str, Any]
    comparisons: list[Comparison]
    targets: list[Target] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "targets": [asdict(t) for t in self.targets],
                "comparisons": [c.to_dict() for c in self.comparisons]}


def _clean(value: Any) -> Any:
    """NaN and infinity become null: JSON has no such numbers, and a missing figure
    must not read as a real one."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(report: BenchReport, path: Path) -> None:
    path.write_text(json.dumps(_clean(report.to_dict()), indent=1, allow_nan=False) + "\n")


def read_report(path: Path) -> BenchReport:
    """A report back from its JSON, targets evaluated afresh, so a change to the report
    or to the targets can be rendered without running the engines again."""
    data = json.loads(path.read_text())
    comparisons = []
    for raw in data["comparisons"]:
        fields = dict(raw, runs=[RunResult(**run) for run in raw["runs"]])
        comparisons.append(Comparison(**fields))
    # A report from before PRECISION_KEY was kept says it in its engine settings.
    settings = data["meta"].get("engine settings")
    precision = data["meta"].get(
        PRECISION_KEY, run_precision(settings) if isinstance(settings, dict) else FLOAT32)
    return BenchReport(data["meta"], comparisons, evaluate_targets(comparisons, precision))


def _num(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value * scale:.{digits}f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]


def _runs_table(comp: Comparison) -> list[str]:
    header = ["contender", "wall s", "req/s", "out tok/s", "total tok/s", "out tok/s vs first",
              "TTFT ms mean / p50 / p90 / p99", "ITL ms mean / p50 / p90 / p99", "hit rate",
              "prompt tokens computed / cached", "peak RSS MB", "start-up s"]
    rows = []
    for run in comp.runs:
        ratio = comp.ratios.get(run.contender, {}).get("output_tokens_per_s", math.nan)
        ttft = " / ".join(_num(run.ttft[k], 0, 1000) for k in ("mean", "p50", "p90", "p99"))
        # .get: reports written before ITL's p90 was kept read back with none.
        itl = " / ".join(_num(run.itl.get(k), 1, 1000) for k in ("mean", "p50", "p90", "p99"))
        computed = ("n/a" if run.computed_prompt_tokens is None
                    else f"{run.computed_prompt_tokens}{'' if run.computed_measured else '*'}")
        tokens = f"{computed} / {_num(run.cached_prompt_tokens, 0)}"
        rows.append([run.contender, _num(run.wall_s, 2), _num(run.requests_per_s, 2),
                     _num(run.output_tokens_per_s, 1), _num(run.total_tokens_per_s, 0),
                     _num(ratio, 2) + "x" if not math.isnan(ratio) else "n/a", ttft, itl,
                     _num(run.hit_rate, 3), tokens, _num(run.peak_rss_mb, 0),
                     _num(run.startup_s, 1)])
    return _table(header, rows)


def _steps_table(comp: Comparison) -> list[str]:
    runs = [r for r in comp.runs if r.step_breakdown]
    if not runs:
        return []
    header = ["contender", "steps", "schedule ms", "prepare ms", "forward ms", "sample ms",
              "update ms", "bookkeeping share"]
    rows = [[r.contender, _num(r.step_breakdown.get("steps"), 0),
             *(_num(r.step_breakdown.get(k), 3) for k in
               ("schedule", "prepare", "forward", "sample", "update")),
             _num(r.bookkeeping_share, 2, 100) + "%"] for r in runs]
    return ["", "Per step (mean ms), from the engine's own timings:", "",
            *_table(header, rows)]


def _agreement_table(comp: Comparison) -> list[str]:
    if not comp.agreement:
        return []
    reference = comp.runs[0].contender if comp.runs else "?"
    header = ["contender", "requests compared", "identical", "mean common prefix / length"]
    rows = [[name, str(a["compared"]), _num(a["identical"], 2),
             f"{_num(a['mean_common_prefix'], 1)} / {_num(a['mean_length'], 1)}"]
            for name, a in comp.agreement.items()]
    return ["", f"Greedy agreement with {reference} on the first requests:", "",
            *_table(header, rows)]


def markdown(report: BenchReport) -> str:
    meta = report.meta
    lines = ["# PageLLM benchmark results", ""]
    lines += [f"- {key}: {value}" for key, value in meta.items()]
    lines += ["", "## Targets", ""]
    lines += _table(["target", "where", "measured", "status", "note"],
                    [[t.target, t.where, t.measured, f"**{t.status}**", t.note]
                     for t in report.targets])
    for comp in report.comparisons:
        params = ", ".join(f"{k}={v}" for k, v in comp.params.items())
        peaks = ", ".join(f"{r.contender} {r.peak_decoding}" for r in comp.runs
                          if r.peak_decoding is not None)
        lines += ["", f"## {comp.label} — {comp.mode}", "", f"Workload `{comp.workload}`: "
                  f"{params}; at most {comp.concurrency} requests admitted at once"
                  + (f" (most decoding at once, measured: {peaks})" if peaks else "") + ".",
                  ""]
        lines += _runs_table(comp)
        lines += _steps_table(comp)
        lines += _agreement_table(comp)
        notes = comp.notes + [f"{r.contender}: {n}" for r in comp.runs for n in r.notes]
        if notes:
            lines += ["", *(f"- {n}" for n in notes)]
    lines += ["", "TTFT: first token minus arrival (offline: all requests of a call arrive "
              "at its start). ITL: gaps between a request's successive tokens (chunks, when "
              "streamed). Hit rate: prompt tokens served from the prefix cache over prompt "
              "tokens. Prompt tokens computed: counted by the engine, prompts computed "
              "again after a preemption included; * marks prompt minus cached, where the "
              "contender does not count them. Bookkeeping share: (schedule + prepare inputs + update) / step time. "
              "Peak RSS: the contender's processes, sampled during the run: a server's or "
              "the vLLM driver's own, summed; for in-process contenders (PageLLM offline, "
              "transformers) the benchmark process, so it includes the interpreter, torch "
              "and what earlier contenders left to the allocator. Start-up (load and one "
              "warm-up request) is reported apart and not counted in throughput.",
              ""]
    return "\n".join(lines)


def _contenders(report: BenchReport) -> list[str]:
    names: list[str] = []
    for comp in report.comparisons:
        names += [r.contender for r in comp.runs if r.contender not in names]
    return names


def plot_throughput(report: BenchReport, path: Path) -> None:
    """Output tokens/s per contender, grouped by comparison, one panel per mode."""
    import matplotlib.pyplot as plt

    modes = sorted({c.mode for c in report.comparisons}) or ["offline"]
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 4 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        comps = [c for c in report.comparisons if c.mode == mode]
        names = _contenders(BenchReport(report.meta, comps))
        width = 0.8 / max(len(names), 1)
        values: list[float] = []
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, comp in enumerate(comps):
                run = comp.run(name)
                if run is not None and run.output_tokens_per_s > 0:
                    xs.append(j + i * width)
                    ys.append(run.output_tokens_per_s)
            if xs:
                ax.bar(xs, ys, width, label=name)
                values += ys
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(comps))])
        ax.set_xticklabels([c.label for c in comps], rotation=15)
        # A log axis only where the bars span more than a factor of 20, so that small
        # differences are not drawn as large ones.
        spread = max(values) / min(values) if values else 1.0
        ax.set_yscale("log" if spread > 20 else "linear")
        ax.set_ylabel("output tokens/s" + (" (log)" if spread > 20 else ""))
        ax.set_title(f"Throughput, {mode}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grid(count: int) -> tuple[int, int]:
    cols = min(3, max(count, 1))
    return -(-max(count, 1) // cols), cols


def plot_ttft(report: BenchReport, path: Path) -> None:
    """Each comparison's TTFT distribution per contender (box plots, log scale)."""
    import matplotlib.pyplot as plt

    comps = report.comparisons
    rows, cols = _grid(len(comps))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(comps):]:
        ax.set_visible(False)
    for ax, comp in zip(axes.flat, comps, strict=False):
        runs = [r for r in comp.runs if r.ttft_samples]
        if runs:
            ax.boxplot([[t * 1000 for t in r.ttft_samples] for r in runs])
            ax.set_xticks(range(1, len(runs) + 1), [r.contender for r in runs], rotation=20,
                          fontsize=8)
            ax.set_yscale("log")
        ax.set_ylabel("TTFT ms (log)")
        ax.set_title(f"{comp.label} ({comp.mode})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_rate(report: BenchReport, path: Path) -> None:
    """Cumulative prefix-cache hit rate after each finished request, per contender."""
    import matplotlib.pyplot as plt

    comps = [c for c in report.comparisons if any(r.hit_rate_timeline for r in c.runs)]
    rows, cols = _grid(len(comps))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(comps):]:
        ax.set_visible(False)
    for ax, comp in zip(axes.flat, comps, strict=False):
        for run in comp.runs:
            if run.hit_rate_timeline:
                xs, ys = zip(*run.hit_rate_timeline, strict=True)
                ax.plot(xs, ys, marker=".", label=run.contender)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("seconds since start")
        ax.set_ylabel("hit rate so far")
        ax.set_title(f"{comp.label} ({comp.mode})", fontsize=10)
        ax.legend(fontsize=8)
    if not comps:
        axes[0, 0].set_visible(True)
        axes[0, 0].text(0.5, 0.5, "no contender reported cache hits", ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: BenchReport, out_dir: Path) -> list[Path]:
    """Writes JSON, Markdown and the plots into `out_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / JSON_NAME, out_dir / MARKDOWN_NAME, *(out_dir / n for n in PLOT_NAMES)]
    write_json(report, paths[0])
    paths[1].write_text(markdown(report))
    plot_throughput(report, paths[2])
    plot_ttft(report, paths[3])
    plot_hit_rate(report, paths[4])
    return paths
