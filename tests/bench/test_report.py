"""The report writes valid JSON (missing figures as null), a Markdown page with the
targets and every table, and three real PNG images."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pagellm.bench.compare import Comparison, add_ratios, agreement, evaluate_targets
from pagellm.bench.metrics import RequestRecord, summarize
from pagellm.bench.report import JSON_NAME, BenchReport, read_report, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(cached: int | None, ttft: float) -> list[RequestRecord]:
    return [RequestRecord(prompt_len=100, output_len=3, output_ids=[1, 2, 3], arrival=0.0,
                          first_token=ttft + i, finish=ttft + i + 1.0,
                          token_times=[ttft + i, ttft + i + 0.5, ttft + i + 1.0],
                          cached_tokens=cached)
            for i in range(4)]


def _report() -> BenchReport:
    timings = {"schedule_s": 0.01, "prepare_s": 0.02, "forward_s": 1.0, "sample_s": 0.1,
               "update_s": 0.01, "steps": 5.0}
    on = summarize("pagellm", "shared-prefix", "offline", _records(64, 0.1), 2.0,
                   peak_rss_mb=900.0, startup_s=1.0, timings=timings)
    off = summarize("pagellm-nocache", "shared-prefix", "offline", _records(0, 1.0), 6.0,
                    timings=timings)
    hf = summarize("hf-generate", "shared-prefix", "offline", _records(None, 2.0), 9.0)
    offline = Comparison("shared-prefix", "shared-prefix", "offline", {}, 4, [on, off, hf])
    add_ratios(offline)
    offline.agreement = {"hf-generate": agreement(_records(0, 0), _records(0, 0), 8)}
    offline.notes.append("vllm skipped: no --vllm-python given")
    online = Comparison("shared-prefix", "shared-prefix", "online", {}, 4,
                        [summarize("pagellm", "shared-prefix", "online", _records(64, 0.2), 3.0)])
    comparisons = [offline, online]
    return BenchReport({"date": "today", "seed": 0}, comparisons, evaluate_targets(comparisons))


def test_report_writes_json_markdown_and_pngs(tmp_path: Path) -> None:
    report = _report()
    report.comparisons[0].runs[2].itl["p99"] = math.nan
    paths = write_report(report, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == ["hit_rate.png", "results.json", "results.md", "throughput.png", "ttft.png"]

    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["meta"]["seed"] == 0
    runs = data["comparisons"][0]["runs"]
    assert [r["contender"] for r in runs] == ["pagellm", "pagellm-nocache", "hf-generate"]
    assert runs[2]["itl"]["p99"] is None and runs[2]["hit_rate"] is None
    assert runs[0]["hit_rate"] == 0.64
    assert {t["status"] for t in data["targets"]} <= {"PASS", "FAIL", "n/a"}

    text = (tmp_path / "out" / "results.md").read_text()
    assert text.startswith("# PageLLM benchmark results")
    assert "## Targets" in text and "**FAIL**" in text and "**n/a**" in text
    assert "## shared-prefix — offline" in text and "## shared-prefix — online" in text
    assert "| pagellm | 2.00 |" in text
    assert "bookkeeping share" in text and "Greedy agreement" in text
    assert "vllm skipped" in text

    for name in ("throughput.png", "ttft.png", "hit_rate.png"):
        blob = (tmp_path / "out" / name).read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 5000


def test_a_report_reads_back_from_its_json_with_targets_evaluated_afresh(tmp_path: Path) -> None:
    report = _report()
    write_report(report, tmp_path)
    again = read_report(tmp_path / JSON_NAME)
    assert again.meta == report.meta
    assert [c.label for c in again.comparisons] == [c.label for c in report.comparisons]
    assert again.comparisons[0].runs[0].ttft == report.comparisons[0].runs[0].ttft
    assert [(t.target, t.status) for t in again.targets] == [
        (t.target, t.status) for t in report.targets]


def test_an_older_int8_report_reads_back_unjudged(tmp_path: Path) -> None:
    """Reports written before "PageLLM precision" was kept name the mode in their engine
    settings: an int8 run's targets must come back n/a, not judged as float32's."""
    report = _report()
    report.meta["engine settings"] = {"quantize_activations": True}
    write_report(report, tmp_path)
    judged = {t.target: t.status for t in read_report(tmp_path / JSON_NAME).targets}
    assert set(judged.values()) == {"n/a"}
    report.meta["engine settings"] = "defaults"
    write_report(report, tmp_path)
    again = {t.target: t.status for t in read_report(tmp_path / JSON_NAME).targets}
    assert "FAIL" in again.values()  # float32's, judged
