"""The `pagellm` command: complete --help, one option mapping, and real runs of
`generate` and `chat` on the default model."""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from pagellm.engine.config import EngineConfig
from pagellm.entrypoints.cli import _option_actions, build_parser, main
from pagellm.entrypoints.config_file import with_config_file
from pagellm.entrypoints.engine_args import NOT_ON_CLI, EngineArgs, byte_size, dashed_flags
from pagellm.entrypoints.serve import (
    address_of,
    bind,
    model_aliases,
    remove_unix_file,
    served_model_names,
    server_settings,
    take_model_tag,
    unix_file,
)

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}
SMALL_ENGINE = ["--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512"]
SYSTEM = ("You are a terse assistant for a command-line test. Answer in at most five words "
          "and never ask a question back. ") * 2


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", *args],
                          input=stdin, capture_output=True, text=True, env=ENV, timeout=300)


def engine_flags() -> list[str]:
    return ["--" + f.name.replace("_", "-") for f in dataclasses.fields(EngineConfig)
            if f.name not in NOT_ON_CLI]


def test_top_level_help_lists_the_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "run-batch", "generate", "chat", "bench"):
        assert command in out


def test_bench_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--workload" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "run-batch", "generate", "chat"])
def test_subcommand_help_is_complete(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in [*engine_flags(), "--no-enable-prefix-caching"]:
        assert flag in out, flag
    own = {"serve": ["--host", "--port", "--api-key", "--served-model-name",
                     "--max-request-bytes", "--shutdown-timeout", "--allowed-origins",
                     "--enable-kv-cache-events"],
           "run-batch": ["--input-file", "--output-file", "--served-model-name",
                         "--tool-call-parser", "--chat-template"],
           "generate": ["--input", "--output", "--system", "--max-tokens", "--temperature"],
           "chat": ["--system", "--max-tokens", "--temperature"]}[command]
    for flag in own:
        assert flag in out, flag


def test_every_engine_option_maps_to_engine_config() -> None:
    parser = build_parser()
    defaults = EngineArgs.from_cli_args(parser.parse_args(["generate", "x"]))
    assert defaults == EngineArgs()  # EngineConfig's defaults
    args = parser.parse_args([
        "serve", "--model", "/models/m", "--dtype", "bfloat16", "--device", "cpu",
        "--block-size", "32", "--no-enable-prefix-caching", "--prefix-caching-hash-algo",
        "fast", "--kv-cache-memory-bytes", "64MiB", "--max-model-len", "1024",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--scheduling-policy",
        "cache_aware", "--attention-backend", "torch_ref", "--cache-dir", "/tmp/c", "--seed", "3",
        "--num-threads", "2", "--kv-cache-memory-fraction", "0.5", "--no-cpu-kernels",
        "--num-gpu-blocks-override", "40",
        "--enforce-eager", "--generation-config", "vllm", "--override-generation-config",
        '{"temperature": 0.5}'])
    config = EngineArgs.from_cli_args(args)
    assert config == EngineArgs(
        model="/models/m", dtype="bfloat16", device="cpu", block_size=32,
        enable_prefix_caching=False, prefix_caching_hash_algo="fast",
        kv_cache_memory_bytes=64 << 20, max_model_len=1024, max_num_batched_tokens=512,
        max_num_seqs=8, scheduling_policy="cache_aware", attention_backend="torch_ref",
        cache_dir=Path("/tmp/c"), seed=3, num_threads=2, kv_cache_memory_fraction=0.5,
        num_gpu_blocks_override=40, cpu_kernels=False, enforce_eager=True, generation_config="vllm",
        override_generation_config={"temperature": 0.5})


@pytest.mark.parametrize(("text", "expected"), [
    ("1024", 1024), ("64MiB", 64 << 20), ("64M", 64 << 20), ("1G", 1 << 30),
    ("0.5GiB", 1 << 29), ("16kb", 16 << 10)])
def test_byte_size(text: str, expected: int) -> None:
    assert byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-5", "0", "12XB"])
def test_byte_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


@pytest.mark.parametrize("argv", [
    ["generate", "x", "--block-size", "0"],
    ["generate", "x", "--temperature", "-1"],
    ["chat", "--top-p", "0"],
    ["serve", "--max-num-seqs", "0"],
    ["generate", "x", "--num-threads", "0"],
    ["generate", "--input", "/nonexistent/prompts.jsonl"],
    ["generate", "--input", "/tmp"],
    ["generate"],
    ["generate", "x", "--input", "/dev/null"],
    ["generate", "x", "--output", "/nonexistent/dir/out.jsonl"],
    ["serve", "--port", "99999"],
    ["serve", "--port", "http"],
    ["serve", "--log-stats-interval", "0"],
    ["serve", "--log-stats-interval", "nan"],
    ["serve", "--shutdown-timeout", "-1"],
    ["serve", "/m/a.gguf", "--model", "/m/b.gguf"],
    ["serve", "--bogus"],
    ["generate", "x", "--max-tokns", "5"],
    ["serve", "--enable-auto-tool-choice"],
    ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"],
    ["serve", "--reasoning-parser", "qwen3"],
    ["serve", "--allowed-origins", "http://app.example"],
    ["serve", "--allowed-headers", '["x", 1]'],
    ["generate", "x", "--generation-config", "/nonexistent/folder"],
    ["serve", "--override-generation-config", '{"max_tokens": 5}'],
    ["run-batch", "-o", "/tmp/out.jsonl"],
    ["run-batch", "-i", "/nonexistent/batch.jsonl", "-o", "/tmp/out.jsonl"],
    ["run-batch", "-i", "/dev/null", "-o", "/nonexistent/dir/out.jsonl"],
    ["run-batch", "-i", "/dev/null", "-o", "/tmp/o.jsonl", "--tool-call-parser", "mistral"],
    ["serve", "--max-log-len", "-1"],
    ["serve", "--sse-keep-alive-interval", "-1"],
    ["serve", "--disable-access-log-for-endpoints", "health,/metrics"],
    ["serve", "--task", "embed"],
    ["serve", "--runner", "pooling"],
])
def test_bad_options_fail_before_loading_the_model(argv: list[str],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error" in err
    assert f"usage: pagellm {argv[0]}" in err  # the subcommand's usage, not the top level


def test_vllm_only_options_say_what_to_use_instead(capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--swap-space=4", "--compilation-config=3", "--bogus"])
    err = capsys.readouterr().err
    assert ("unrecognized arguments: --swap-space=4 --compilation-config=3 --bogus; "
            "--swap-space is vLLM's: a preempted request is recomputed") in err
    assert "--compilation-config is vLLM's: nothing is compiled by torch.compile" in err
    assert "--bogus is" not in err
    # Flags asking for what PageLLM does anyway are taken; another value is refused.
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "1",
                                      "--trust-remote-code", "--enable-chunked-prefill",
                                      "--kv-cache-dtype", "auto", "--max-logprobs", "20",
                                      "--tokenizer-mode", "auto", "--load-format", "auto"])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    # vLLM's token counts: 4K = 4096, 2k = 2000, and auto for the model's context.
    counts = EngineArgs.from_cli_args(build_parser().parse_args(
        ["serve", "--max-model-len", "4K", "--max-num-batched-tokens", "2k"]))
    assert (counts.max_model_len, counts.max_num_batched_tokens) == (4096, 2000)
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["serve", "--max-model-len", "auto"])).max_model_len is None
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-len", "1.5K"])
    assert "not a number of tokens: '1.5K'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--kv-cache-dtype=fp8"])
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype: invalid choice: 'fp8'" in err and "bfloat16" in err
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["serve", "--kv-cache-dtype", "bfloat16"])).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        main(["serve", "--no-enable-chunked-prefill"])
    assert ("--enable-chunked-prefill is vLLM's: prompts are always computed in chunks"
            in capsys.readouterr().err)
    # vLLM's task and runner for a generative model; LoRA is refused with a hint.
    args = build_parser().parse_args(["serve", "--task", "generate", "--runner", "generate",
                                      "--convert", "none"])
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert EngineArgs(task="auto", runner="auto") == EngineArgs()
    with pytest.raises(TypeError, match="task is vLLM's: models are run to generate text"):
        EngineArgs(task="embed")
    with pytest.raises(SystemExit):
        main(["serve", "--enable-lora"])
    assert ("--enable-lora is vLLM's: no LoRA adapters are served; merge the adapter"
            in capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["serve", "--tensor-parallel-size=2"])
    assert ("argument --tensor-parallel-size/-tp: only 1 is taken (vLLM's option; one engine "
            "runs on one device), got '2'") in capsys.readouterr().err


def test_serve_unix_socket_problems_fail_before_loading_the_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A socket path another server listens on, or a file that is no socket, is left
    alone; a socket file left by a server that is gone is replaced."""
    live, other = tmp_path / "live.sock", tmp_path / "notes.txt"
    other.write_text("keep me")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(live))
        listening.listen()
        assert main(["serve", "--uds", str(live)]) == 1
        assert f"cannot listen on {live}: another server is listening on it" in (
            capsys.readouterr().err)
    assert main(["serve", "--uds", str(other)]) == 1
    assert f"cannot listen on {other}: it exists and is not a socket" in (
        capsys.readouterr().err)
    assert other.read_text() == "keep me"
    ours = bind(build_parser().parse_args(["serve", "--uds", str(live)]))  # the stale one
    with ours:
        assert address_of(ours) == f"unix:{live}"
        assert live.stat().st_mode & 0o777 == 0o666  # a proxy running as nobody connects
        # Listening from the bind on: a second server, started while this one loads its
        # model, finds the socket taken instead of replacing it.
        assert main(["serve", "--uds", str(live)]) == 1
        assert "another server is listening on it" in capsys.readouterr().err
        file = unix_file(ours)
    live.unlink()  # another server's socket now at the path: left alone
    with socket.socket(socket.AF_UNIX) as theirs:
        theirs.bind(str(live))
        remove_unix_file(file)
        assert live.is_socket()
    assert file is not None and file[0] == str(live)


@pytest.mark.parametrize("host", ["127.0.0.1", "999.1.1.1"])
def test_serve_address_problems_fail_before_loading_the_model(
        host: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A taken port or an address the machine lacks is reported in milliseconds."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--host", host, "--port", str(port)]) == 1
    assert time.monotonic() - started < 5
    assert f"cannot listen on {host}:{port}" in capsys.readouterr().err


def test_generate_prints_a_completion() -> None:
    result = run_cli("generate", "The capital of France is", "--max-tokens", "8", *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "engine ready in" in result.stderr
    assert "prompt tokens" in result.stderr


def test_generate_jsonl_shows_cached_tokens_for_a_repeated_system_prompt(tmp_path: Path) -> None:
    source = tmp_path / "prompts.jsonl"
    lines = [json.dumps({"prompt": "Name a fruit.", "id": "a"}), "not json",
             json.dumps("Name a colour."), json.dumps({"prompt": "Name a river."})]
    source.write_text("\n".join(lines) + "\n")
    target = tmp_path / "out.jsonl"
    result = run_cli("generate", "--input", str(source), "--output", str(target), "--system",
                     SYSTEM, "--max-tokens", "6", *SMALL_ENGINE)
    assert result.returncode == 1, result.stderr  # one line was not JSON
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(records) == 4
    assert records[0]["id"] == "a" and records[0]["text"]
    assert "not JSON" in records[1]["error"]
    assert all(r["cached_tokens"] >= 32 for r in (records[2], records[3])), records
    assert "from the prefix cache" in result.stderr


class _BatchFiles(http.server.BaseHTTPRequestHandler):
    """A web server holding batch files, as a bucket's presigned URLs do: GET reads
    one, PUT stores one (under /fail, refused)."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/fail":
            self.files[self.path] = data
        self.send_response(201 if self.path != "/fail" else 500)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_run_batch_reads_and_writes_urls_as_vllm_does() -> None:
    """vLLM's run-batch takes an http(s) URL for either file (GET the input, PUT the
    results); a URL that cannot be read, or is not one, fails before the model loads,
    naming it without its query (a presigned URL's signature)."""
    from pagellm.entrypoints.run_batch import _upload

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BatchFiles)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        _BatchFiles.files["/in.jsonl"] = json.dumps({
            "custom_id": "q", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": "The capital of France is", "max_tokens": 3}}).encode()
        result = run_cli("run-batch", "-i", f"{base}/in.jsonl", "-o", f"{base}/out.jsonl",
                         *SMALL_ENGINE)
        assert result.returncode == 0, result.stderr
        (line,) = _BatchFiles.files["/out.jsonl"].decode().splitlines()
        assert json.loads(line)["response"]["body"]["choices"][0]["text"]
        for argv, message in (
                (["-i", f"{base}/nope.jsonl?X-Signature=secret", "-o", "/tmp/o.jsonl"],
                 f"--input-file {base}/nope.jsonl?...: GET answered 404"),
                (["-i", f"{base}/in.jsonl", "-o", "http://[::1/out"],
                 "--output-file http://[::1/out: not a valid URL"),
                (["-i", "http://[::1/in", "-o", "/tmp/o.jsonl"],
                 "--input-file http://[::1/in: not a valid URL")):
            refused = run_cli("run-batch", *argv)
            assert refused.returncode == 2 and message in refused.stderr, refused.stderr
            assert "secret" not in refused.stderr
        failed = _upload(f"{base}/fail", b"x", attempts=2, delay=0)
        assert failed is not None and failed.startswith("PUT answered 500")
        assert _upload(f"{base}/kept", b"x", attempts=1) is None
    finally:
        server.shutdown()


def test_run_batch_keeps_results_it_could_not_upload(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Every try failed (or was interrupted): the results are in a local file, named."""
    from pagellm.entrypoints import run_batch

    monkeypatch.setattr(run_batch, "_upload", lambda url, data: "PUT answered 403")
    assert run_batch._write_results("https://bucket/out.jsonl?sig=s", "{}\n") == \
        "PUT answered 403"
    error = capsys.readouterr().err
    assert "uploading the results to https://bucket/out.jsonl?... failed" in error
    kept = Path(error.rsplit("they are in ", 1)[1].strip())
    assert kept.read_text() == "{}\n"
    kept.unlink()

    def interrupted(url: str, data: bytes) -> str | None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run_batch, "_upload", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_batch._write_results("https://bucket/out.jsonl", "{}\n")
    error = capsys.readouterr().err
    assert "failed (interrupted)" in error
    kept = Path(error.rsplit("they are in ", 1)[1].strip())
    assert kept.read_text() == "{}\n"
    kept.unlink()


def test_run_batch_answers_each_line_as_the_server_would(tmp_path: Path) -> None:
    """vLLM's run-batch on OpenAI's batch format: results in input order, each the
    server's answer (its status and body), a shared system prompt computed once, and a
    line that cannot run answered with its reason while the others run."""
    def line(custom_id: str, url: str, body: dict[str, object]) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    def ask(question: str) -> dict[str, object]:
        return {"model": "gpt-4o-mini", "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}

    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join([
        line("fruit", "/v1/chat/completions", ask("Name a fruit.")),
        line("river", "/v1/chat/completions", ask("Name a river.")),
        line("text", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4}),
        line("resp", "/v1/responses", {"input": "Say hi.", "max_output_tokens": 4,
                                       "metadata": {"note": "\ud800"}}),  # echoed back
        line("cold", "/v1/chat/completions", {**ask("x"), "temperature": -1}),
        line("embed", "/v1/embeddings", {"input": "x"}),
        line("stream", "/v1/completions", {"prompt": "x", "stream": True}),
        "{not json", "",
        # JSON that Python reads but HTTP clients refuse to send: the server judges it.
        line("nan", "/v1/completions", {"prompt": "x", "temperature": float("nan")}),
        line("surrogate", "/v1/completions", {"prompt": "\ud800"}),
        line("fruit", "/v1/completions", {"prompt": "x"}),  # its id is taken
        "[" * 100_000 + "]" * 100_000]) + "\n")  # nested past what Python reads
    target = tmp_path / "results.jsonl"
    result = run_cli("run-batch", "-i", str(source), "-o", str(target),
                     "--served-model-name", "gpt-4o-mini", *SMALL_ENGINE)
    assert result.returncode == 1, result.stderr  # some lines failed
    results = [json.loads(text) for text in target.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [
        "fruit", "river", "text", "resp", "cold", "embed", "stream", None, "nan", "surrogate",
        "fruit", None]
    assert [r["response"]["status_code"] for r in results] == [200] * 4 + [400] * 8
    fruit, river, text, resp = (r["response"]["body"] for r in results[:4])
    assert fruit["choices"][0]["message"]["content"] and fruit["model"] == "gpt-4o-mini"
    assert results[0]["response"]["request_id"] == fruit["id"] and results[0]["error"] is None
    assert river["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
    assert text["object"] == "text_completion" and resp["object"] == "response"
    assert "temperature" in results[4]["error"]["message"]
    # The error body as the server answers it, and OpenAI's {code, message} beside it.
    body_error = results[4]["response"]["body"]["error"]
    assert results[4]["error"] == {"code": body_error["code"] or body_error["type"],
                                   "message": body_error["message"]}
    assert "url must be one of" in results[5]["error"]["message"]
    assert "cannot stream" in results[6]["error"]["message"]
    assert "not JSON" in results[7]["error"]["message"]
    assert "temperature" in results[8]["error"]["message"]
    assert "surrogate" in results[9]["error"]["message"]
    assert "used by an earlier line" in results[10]["error"]["message"]
    assert "not JSON" in results[11]["error"]["message"]
    assert "4/12 requests done" in result.stderr and "from the prefix cache" in result.stderr


def test_generate_jsonl_bad_lines_spoil_only_themselves(tmp_path: Path) -> None:
    """Valid JSON of the wrong kind, a lone surrogate escape, a byte that is not UTF-8,
    JSON nested or long past what Python reads: each becomes an error record, and every
    other line still runs."""
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(b'\xef\xbb\xbf"first"\nnull\n5\n[["a", "b"]]\n{"prompt": "\\ud800"}\n'
                       b'"bad \xff byte"\n' + b"[" * 100_000 + b"]" * 100_000 + b"\n"
                       + b"1" * 5_000 + b'\n"last"\n')
    target = tmp_path / "out.jsonl"
    result = run_cli("generate", "--input", str(source), "--output", str(target),
                     "--max-tokens", "2", *SMALL_ENGINE)
    assert result.returncode == 1, result.stderr
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r.get("prompt") for r in records] == ["first", *[None] * 7, "last"]
    assert records[0]["text"] and records[-1]["text"]
    errors = [r["error"] for r in records[1:-1]]
    assert ["null" in errors[0], "number" in errors[1], "array" in errors[2],
            "surrogate" in errors[3], "UTF-8" in errors[4], "not JSON" in errors[5],
            "not JSON" in errors[6]] == [True] * 7, errors
    assert "Traceback" not in result.stderr


def test_generate_jsonl_lines_set_their_own_sampling() -> None:
    """vLLM's names on a line override the options for that line only; a bad value or
    n > 1 spoils only its line; other keys come back as they were."""
    lines = [{"prompt": "Count: one, two, three, four,", "max_tokens": 3, "tag": "x",
              "extra_args": "kept"},
             {"prompt": "Count: one, two, three, four,"},
             {"prompt": "Count: one, two, three, four,", "stop": [","], "max_tokens": 20},
             {"prompt": "Hi", "temperature": -1},
             {"prompt": "Hi", "n": 2},
             {"prompt": "Hi", "cache_salt": 5},
             {"prompt": "Hi", "max_token": 3},
             {"prompt": "Hi", "logprobs": 2},
             {"prompt": "Hi", "priority": 1},
             {"prompt": "Hi", "priority": "high"},
             {"prompt": [504, 3575, 282], "max_tokens": 2},
             {"prompt": [504, "x"]},
             {"prompt": "Hi", "allowed_token_ids": []},
             {"prompt": "Count: one, two, three, four,", "bad_words": [" five"]},
             {"prompt": "Is it day?", "structured_outputs": {"choice": [" yes", " no"]}},
             {"prompt": "Hi", "structured_outputs": {"regex": "("}},
             {"prompt": "Hi", "response_format": {"type": "json_object"}}]
    result = run_cli("generate", "--input", "/dev/stdin", "--max-tokens", "5", *SMALL_ENGINE,
                     stdin="".join(json.dumps(line) + "\n" for line in lines))
    assert result.returncode == 1, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert records[0]["completion_tokens"] == 3 and records[0]["tag"] == "x"
    assert records[0]["extra_args"] == "kept"  # the caller's data, as any other key
    assert records[1]["completion_tokens"] == 5
    assert records[2]["finish_reason"] == "stop" and "," not in records[2]["text"]
    assert "temperature" in records[3]["error"]
    assert "n must be 1" in records[4]["error"]
    assert "cache_salt" in records[5]["error"]
    assert "did you mean 'max_tokens'" in records[6]["error"]
    assert "logprobs is not supported" in records[7]["error"]
    assert "scheduling_policy='priority'" in records[8]["error"]  # refused, not ignored
    assert "priority must be an integer" in records[9]["error"]
    assert (records[10]["prompt_tokens"], records[10]["completion_tokens"]) == (3, 2)
    assert "prompt_token_ids must be integers" in records[11]["error"]
    assert "allowed_token_ids" in records[12]["error"]
    assert "five" in records[1]["text"] and "five" not in records[13]["text"]
    assert records[14]["text"] in (" yes", " no") and records[14]["finish_reason"] == "stop"
    assert "structured_outputs.regex is not a valid regular expression" in records[15]["error"]
    assert "response_format is the server's spelling" in records[16]["error"]


def test_unset_sampling_options_take_the_models_defaults() -> None:
    """A generation config's max_new_tokens (here laid over the model's) applies where
    --max-tokens is not given; a given option and a line's own value win."""
    lines = [{"prompt": "Count: one, two, three, four,"},
             {"prompt": "Count: one, two, three, four,", "max_tokens": 4}]
    override = ["--override-generation-config", '{"max_new_tokens": 2}']
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    result = run_cli("generate", "--input", "/dev/stdin", *override, *SMALL_ENGINE,
                     stdin=stdin)
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["completion_tokens"] for line in result.stdout.splitlines()] == [
        2, 4]
    given = run_cli("generate", "--input", "/dev/stdin", "--max-tokens", "3", *override,
                    *SMALL_ENGINE, stdin=stdin)
    assert [json.loads(line)["completion_tokens"] for line in given.stdout.splitlines()] == [
        3, 4]


def test_generate_reads_jsonl_from_a_pipe() -> None:
    result = run_cli("generate", "--input", "/dev/stdin", "--max-tokens", "2", *SMALL_ENGINE,
                     stdin='"Hello"\n{"prompt": "Bonjour"}\n')
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "Bonjour"]
    assert all(r["text"] for r in records)


def test_chat_keeps_the_conversation_and_reports_cache_hits() -> None:
    result = run_cli("chat", "--system", SYSTEM, "--max-tokens", "8", "--temperature", "0",
                     *SMALL_ENGINE, stdin="Hello there.\nAnd what is your name?\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("assistant> ") == 2
    assert "you> Hello there.\n" in result.stdout  # piped input is echoed in the transcript
    reports = [line for line in result.stderr.splitlines() if "from the prefix cache" in line]
    assert len(reports) == 2, result.stderr
    second_cached = int(reports[1].split(",")[1].split()[0])
    assert second_cached >= 32, reports  # the first turn (system prompt included) was cached


def test_chat_template_option(tmp_path: Path) -> None:
    """`--chat-template` renders conversations instead of the model's template: the
    prompt is then exactly the user's text. A file that cannot be read fails before the
    model loads, a template that cannot render fails at start."""
    target = tmp_path / "out.jsonl"
    prompt = "The capital of France is"
    result = run_cli("generate", "--chat", "--chat-template", "{{ messages[0].content }}",
                     "--output", str(target), "--max-tokens", "2", prompt, *SMALL_ENGINE)
    assert result.returncode == 0, result.stderr
    plain = run_cli("generate", "--output", str(tmp_path / "plain.jsonl"), "--max-tokens",
                    "2", prompt, *SMALL_ENGINE)
    assert plain.returncode == 0, plain.stderr
    templated = json.loads(target.read_text())
    assert templated["prompt_tokens"] == json.loads(
        (tmp_path / "plain.jsonl").read_text())["prompt_tokens"]
    missing = run_cli("chat", "--chat-template", str(tmp_path / "none.jinja"))
    assert missing.returncode == 2 and "none.jinja" in missing.stderr
    broken = run_cli("generate", "--chat", "--chat-template", "{% if %}", "x", *SMALL_ENGINE)
    assert broken.returncode == 1 and "--chat-template" in broken.stderr, broken.stderr


def test_options_from_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    """vLLM's --config FILE.yaml: its options, under the command line's; a list after a
    model given first does not take the model; false is the --no- form where there is
    one."""
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nmax_model_len: 4K\nenable-prefix-caching: false\n"
                      "api-key: [k1, k2]\ndisable-log-stats: false\n"
                      "override-generation-config: {temperature: 0.5}\n")
    parser = build_parser()
    argv = with_config_file(["serve", "model.gguf", "--config", str(config), "--port", "9002"],
                            _option_actions(parser))
    args = parser.parse_args(argv)
    assert (args.model_tag, args.port, args.api_key) == ("model.gguf", 9002, ["k1", "k2"])
    engine = EngineArgs.from_cli_args(args)
    assert (engine.max_model_len, engine.enable_prefix_caching) == (4096, False)
    assert engine.override_generation_config == {"temperature": 0.5}
    # The file's options go right after other commands (their positionals are prompts),
    # and a model named on the command line wins over the file's.
    (tmp_path / "gen.yaml").write_text("max-tokens: 5\n")
    generate_args = parser.parse_args(with_config_file(
        ["generate", "p1", "p2", "--config", str(tmp_path / "gen.yaml")],
        _option_actions(parser)))
    assert (generate_args.prompt, generate_args.max_tokens) == (["p1", "p2"], 5)
    # A list as the command line gives it: an option given once per value is repeated
    # (a prompt written after it stays a prompt), one that takes a JSON list gets JSON.
    (tmp_path / "stops.yaml").write_text('stop: ["party", "zzz"]\n')
    listed = parser.parse_args(with_config_file(
        ["generate", "Hi", "--config", str(tmp_path / "stops.yaml")], _option_actions(parser)))
    assert (listed.prompt, listed.stop) == (["Hi"], ["party", "zzz"])
    (tmp_path / "cors.yaml").write_text('allowed-origins: ["https://a.example"]\n'
                                        "disable-access-log-for-endpoints: [/health, /ping]\n")
    served = parser.parse_args(with_config_file(
        ["serve", "--config", str(tmp_path / "cors.yaml")], _option_actions(parser)))
    assert served.allowed_origins == ["https://a.example"]
    assert served.disable_access_log_for_endpoints == ["/health", "/ping"]
    (tmp_path / "model.yaml").write_text("model: file.gguf\nport: 9003\n")
    chosen = parser.parse_args(with_config_file(
        ["serve", "cli.gguf", "--config", str(tmp_path / "model.yaml")],
        _option_actions(parser)))
    assert (chosen.model_tag, chosen.model, chosen.port) == ("cli.gguf", None, 9003)
    (tmp_path / "dated.yaml").write_text("override-generation-config: {d: 2024-01-01}\n")
    (tmp_path / "empty.yaml").write_text("max-model-len:\n")
    for bad, message in ((tmp_path / "missing.yaml", "cannot read"),
                         (tmp_path / "dated.yaml", "override-generation-config"),
                         (tmp_path / "empty.yaml", "max-model-len has no value"),
                         (tmp_path / "list.yaml", "must hold a mapping"),
                         (tmp_path / "serve.json", "must be a .yaml or .yml file")):
        if bad.name == "list.yaml":
            bad.write_text("- port\n")
        with pytest.raises(SystemExit):
            main(["serve", f"--config={bad}"])
        assert message in capsys.readouterr().err


def test_server_options_reach_the_server_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGELLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")  # a vLLM deployment's variable
    assert server_settings(build_parser().parse_args(["serve"]), 0.0, "x").api_key == [
        "from-vllm"]
    monkeypatch.delenv("VLLM_API_KEY")
    monkeypatch.setenv("PAGELLM_ADMIN_API_KEY", "from-env")  # kept out of `ps`
    assert server_settings(build_parser().parse_args(["serve"]), 0.0,
                           "x").admin_api_key == ["from-env"]
    monkeypatch.delenv("PAGELLM_ADMIN_API_KEY")
    parser = build_parser()
    assert server_settings(parser.parse_args(["serve", "--api-key", "k1", "k2"]), 0.0,
                           "x").api_key == ["k1", "k2"]
    settings = server_settings(parser.parse_args(["serve"]), 0.0, "127.0.0.1:8000")
    assert (settings.log_stats_interval, settings.shutdown_timeout) == (5.0, 10)
    settings = server_settings(parser.parse_args(
        ["serve", "--disable-log-stats", "--shutdown-timeout", "0.5"]), 0.0, "x")
    assert (settings.log_stats_interval, settings.shutdown_timeout) == (None, 0.5)
    assert server_settings(parser.parse_args(["serve", "--log-stats-interval", "0.25"]),
                           0.0, "x").log_stats_interval == 0.25
    assert settings.tool_call_parser is None
    assert server_settings(parser.parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]), 0.0, "x"
    ).tool_call_parser == "hermes"
    assert server_settings(parser.parse_args(["serve", "--tool-call-parser", "hermes"]),
                           0.0, "x").tool_call_parser is None  # vLLM's rule: not enabled
    assert server_settings(parser.parse_args(["serve", "--reasoning-parser", "deepseek_r1"]),
                           0.0, "x").reasoning_parser == "deepseek_r1"
    assert not settings.enable_log_requests
    assert server_settings(parser.parse_args(["serve", "--enable-log-requests"]),
                           0.0, "x").enable_log_requests
    # vLLM's deployment flags: the ones that shape answers and HTTP, and those taken for
    # what PageLLM does anyway (--enable-prompt-tokens-details, --disable-log-requests).
    vllm_style = server_settings(parser.parse_args([
        "serve", "--return-tokens-as-token-ids", "--enable-force-include-usage",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--enable-prompt-tokens-details", "--disable-log-requests",
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
        "--disable-fastapi-docs", "--root-path", "/llm"]), 0.0, "x")
    assert vllm_style.return_tokens_as_token_ids and vllm_style.enable_force_include_usage
    assert vllm_style.default_chat_template_kwargs == {"enable_thinking": False}
    assert (vllm_style.uvicorn_log_level, vllm_style.root_path) == ("warning", "/llm")
    assert vllm_style.disable_uvicorn_access_log and vllm_style.disable_fastapi_docs
    logged = server_settings(parser.parse_args([
        "serve", "--enable-log-outputs", "--max-log-len", "100", "--response-role", "bot",
        "--disable-access-log-for-endpoints", "/health, /metrics",
        "--enable-server-load-tracking", "--exclude-tools-when-tool-choice-none",
        "--sse-keep-alive-interval", "15", "--chat-template-content-format", "openai",
        "--admin-api-key", "op1", "op2"]), 0.0, "x")
    assert (logged.enable_log_outputs, logged.max_log_len) == (True, 100)
    assert logged.disable_access_log_for_endpoints == ["/health", "/metrics"]
    assert logged.response_role == "bot" and settings.response_role == "assistant"
    assert logged.enable_server_load_tracking and logged.exclude_tools_when_tool_choice_none
    assert (logged.sse_keep_alive_interval, settings.sse_keep_alive_interval) == (15, None)
    assert (logged.admin_api_key, settings.admin_api_key) == (["op1", "op2"], None)
    assert (logged.chat_template_content_format,
            settings.chat_template_content_format) == ("openai", "auto")
    assert not settings.return_tokens_as_token_ids and settings.root_path == ""
    from pagellm.entrypoints.openai.api_server import ServerSettings

    with pytest.raises(ValueError, match="log_stats_interval"):
        ServerSettings(model_names=["m"], log_stats_interval=0)
    with pytest.raises(ValueError, match="HTTPS needs a certificate"):
        ServerSettings(model_names=["m"], ssl_keyfile="key.pem")
    not_pem = Path(__file__)  # a readable file that is no certificate: refused at once
    with pytest.raises(ValueError, match=f"cannot serve HTTPS with --ssl-certfile {not_pem}"):
        ServerSettings(model_names=["m"], ssl_certfile=str(not_pem))
    for reserved in ("tools", "messages"):  # what the renderer passes the template itself
        with pytest.raises(ValueError, match=f"default_chat_template_kwargs .* cannot set "
                                             f"{reserved}"):
            ServerSettings(model_names=["m"], default_chat_template_kwargs={reserved: []})
    with pytest.raises(ValueError, match="HTTPS needs a certificate"):
        ServerSettings(model_names=["m"], ssl_cert_reqs=2)  # else plain HTTP, no checks
    with pytest.raises(ValueError, match="need ssl_ca_certs"):
        ServerSettings(model_names=["m"], ssl_certfile="c.pem", ssl_cert_reqs=1)
    model_as_key = parser.parse_args(["serve", "--api-key", "secret", "my-model.gguf"])
    with pytest.raises(ValueError, match="give the model first"):
        server_settings(model_as_key, 0.0, "x")
    with pytest.raises(ValueError, match="--api-key is given, but empty"):
        server_settings(parser.parse_args(["serve", "--api-key", ""]), 0.0, "x")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--default-chat-template-kwargs",
                           '{"a":' + "[" * 30000 + "]" * 30000 + "}"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--ssl-certfile", "/nonexistent/cert.pem"])


def test_version_and_public_names(capsys: pytest.CaptureFixture[str]) -> None:
    import pagellm

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagellm {pagellm.__version__}"
    from pagellm import AsyncLLMEngine
    from pagellm.engine.async_engine import AsyncLLMEngine as defined

    assert AsyncLLMEngine is defined


@pytest.mark.parametrize(("module", "argv", "expected"), [
    ("pagellm.entrypoints.openai.api_server", ["--model", "/nonexistent/model", "--port", "1"],
     "cannot start the engine: model path does not exist: /nonexistent/model"),
    ("pagellm.entrypoints.openai.run_batch", ["-i", "/nonexistent/b.jsonl", "-o", "o.jsonl"],
     "pagellm run-batch: error: --input-file /nonexistent/b.jsonl: no such file"),
    ("pagellm.entrypoints.run_batch", ["-i", "/nonexistent/b.jsonl", "-o", "o.jsonl"],
     "pagellm run-batch: error: --input-file /nonexistent/b.jsonl: no such file"),
])
def test_vllms_module_entry_points_run_the_commands(module: str, argv: list[str],
                                                    expected: str) -> None:
    """`python -m vllm.entrypoints.openai.api_server` (Dockerfiles, manifests) ported to
    PageLLM's module paths runs the command; it exited 0 serving nothing."""
    done = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert done.returncode != 0 and expected in done.stderr


@pytest.mark.parametrize(("argv", "names"), [
    (["serve"], ["SmolLM2-135M-Instruct"]),
    (["serve", "--model", "/models/Qwen3-0.6B/"], ["Qwen3-0.6B"]),
    (["serve", "--model", "/m/x.gguf", "--served-model-name", "a", "b"], ["a", "b"]),
    (["serve", "/models/Qwen3-0.6B/"], ["Qwen3-0.6B"]),  # vLLM's `vllm serve MODEL`
    (["serve", "/m/x.gguf", "--model", "/m/x.gguf"], ["x.gguf"]),
    (["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"], ["HuggingFaceTB/SmolLM2-135M-Instruct"]),
])
def test_served_model_names(argv: list[str], names: list[str]) -> None:
    args = build_parser().parse_args(argv)
    take_model_tag(args)
    assert served_model_names(args) == names
    # A path is also answered to as given, vLLM's served name, without being listed.
    given = None if args.served_model_name else args.model
    assert model_aliases(args) == ([given] if given and given not in names else [])


def test_vllm_spellings_and_wrong_arguments_of_the_python_api() -> None:
    """Caught before anything loads, with messages naming the argument."""
    from pagellm import LLM

    assert EngineConfig(dtype="half").dtype == "float16"
    assert EngineConfig(dtype=torch.bfloat16).dtype == "bfloat16"  # vLLM takes torch dtypes
    # help(LLM) lists EngineConfig's fields as its arguments, with their defaults.
    signature = inspect.signature(LLM)
    assert list(signature.parameters) == [f.name for f in dataclasses.fields(EngineConfig)]
    assert signature.parameters["block_size"].default == 16
    assert EngineConfig(dtype="float").dtype == "float32"
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["generate", "x", "--dtype", "half"])).dtype == "float16"
    with pytest.raises(ValueError, match="seed must be an integer, got 'x'"):
        EngineConfig(seed="x")  # type: ignore[arg-type]
    for wrong, message in ((dict(kv_cache_memory_bytes="1G"), "kv_cache_memory_bytes must"),
                           (dict(kv_cache_memory_fraction="half"), "kv_cache_memory_fraction"),
                           (dict(num_gpu_blocks_override=0), "num_gpu_blocks_override must"),
                           (dict(attention_backend="flash"), "attention_backend must be one "
                                                             "of torch_batched, torch_ref"),
                           (dict(num_gpu_blocks_override=True), "num_gpu_blocks_override must"),
                           (dict(enable_prefix_caching="no"), "enable_prefix_caching must"),
                           (dict(model=123), "model must be a path")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LLM.. got unexpected keyword arguments "
                                        "swap_space, tensor_parallel_size; "
                                        "swap_space is vLLM's: a preempted request is "
                                        "recomputed.*block_size"):
        LLM(swap_space=4, tensor_parallel_size=2, enforce_eager=True)
    for wrong, message in ((dict(gpu_memory_utilization=1.5), r"must be in \(0, 1\], got 1.5"),
                           (dict(gpu_memory_utilization="0.9"), "must be in"),
                           (dict(gpu_memory_utilization=0.9, kv_cache_memory_fraction=0.5),
                            "gpu_memory_utilization .* or kv_cache_memory_fraction .* not both")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**wrong)  # type: ignore[arg-type]
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["serve", "--gpu-memory-utilization", "0.9"])).gpu_memory_utilization == 0.9


def test_vllm_deployment_flags_and_scripts_carry_over(capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    """What vLLM users paste: short and underscore spellings, flags asking for what
    PageLLM does anyway, and the parser vLLM's example scripts build; what cannot carry
    over says why."""
    from pagellm.utils import FlexibleArgumentParser

    args = build_parser().parse_args(dashed_flags([
        "serve", "-tp", "1", "-pp", "1", "-dp", "1", "--distributed_executor_backend=mp",
        "--cpu-offload-gb", "0", "--no-enable-lora", "--no-async-scheduling",
        "--disable-custom-all-reduce", "--structured-outputs-config",
        '{"backend": "guidance"}']))
    assert EngineArgs.from_cli_args(args) == EngineArgs()
    assert EngineArgs.from_cli_args(build_parser().parse_args(dashed_flags(
        ["serve", "--max_model_len", "4K", "--", "--max_model_len"]))).max_model_len == 4096
    for argv, message in (
            (["serve", "--structured-outputs-config", '{"backend": "xgrammar"}'],
             'only {"backend": "guidance"} is taken (vLLM\'s option; structured output is '
             "always llguidance's"),
            (["serve", "--distributed-executor-backend", "ray"], "only uni or mp is taken"),
            (["serve", "--async-scheduling"], "--async-scheduling is vLLM's: a step is "
                                              "scheduled when the one before it ends"),
            (["serve", "--enable-lora"], "--enable-lora is vLLM's: no LoRA adapters"),
            (["serve", "--compilation-config", "{}"], "--compilation-config is vLLM's"),
            (["chat", "--url", "http://h/v1"], "vLLM's `vllm chat` is a client of a "
                                               "running server"),
            (["bench", "serve"], "`pagellm bench` runs its own workloads")):
        with pytest.raises(SystemExit):
            main(argv)
        assert message in capsys.readouterr().err
    # lm-eval's harness passes these unset; set, each is refused with its hint.
    unset = dict(revision=None, tokenizer=None, tokenizer_revision=None, quantization=None,
                 enable_lora=False, download_dir=None, cpu_offload_gb=0,
                 speculative_config=None, distributed_executor_backend=None,
                 async_scheduling=False, structured_outputs_config=None)
    assert EngineArgs(**unset) == EngineArgs()
    with pytest.raises(TypeError, match="tokenizer is vLLM's: the tokenizer is the model's"):
        EngineArgs(tokenizer="other/tokenizer")
    # vLLM's example scripts: FlexibleArgumentParser + EngineArgs.add_cli_args.
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = parser.parse_args(["--max_model_len", "1024", "--block_size=32"])
    assert (parsed.max_model_len, parsed.block_size) == (1024, 32)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tokenizer", "x", "--swap-space", "4"])
    err = capsys.readouterr().err
    assert ("unrecognized arguments: --tokenizer x --swap-space 4; "
            "--tokenizer is vLLM's") in err
    plain = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):  # not taken for --tokenizer-mode
        plain.parse_args(["--tokenizer", "x"])
    assert "unrecognized arguments: --tokenizer x" in capsys.readouterr().err


def test_the_step_budget_defaults_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unset budget is the device's default, at least max_num_seqs, worked out from
    the fields when the engine starts: a copy of a config for another device or another
    max_num_seqs gets that one's default, not the first one's. A given budget is kept."""
    import pagellm.engine.config as engine_config

    on_cpu = EngineConfig(device="cpu")
    assert on_cpu.max_num_batched_tokens is None and on_cpu.step_budget() == 256
    assert dataclasses.replace(on_cpu, max_num_seqs=300).step_budget() == 300
    assert EngineConfig(device="cpu", max_num_batched_tokens=2048).step_budget() == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=8, max_num_seqs=64
                        ).step_budget() == 8  # taken, with a warning when the engine starts
    assert build_parser().parse_args(["serve"]).max_num_batched_tokens is None
    assert EngineArgs.from_cli_args(build_parser().parse_args(
        ["generate", "x", "--device", "cpu"])).step_budget() == 256
    monkeypatch.setattr(engine_config, "resolve_device", lambda name: torch.device("cuda", 0))
    assert on_cpu.step_budget() == 512  # what a GPU gets
    assert dataclasses.replace(on_cpu, max_num_seqs=600).step_budget() == 600
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer"):
        EngineConfig(max_num_batched_tokens=0)


def test_a_cache_dir_given_with_a_tilde_is_in_the_home(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`--cache-dir '~/pc'` (quoted, so no shell expands it) converted into the home but
    built the kernels into a directory named `~` in the working directory."""
    from pagellm.cache_dir import resolve_cache_dir
    from pagellm.engine.config import EngineConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    assert EngineConfig(cache_dir="~/pc").cache_dir == tmp_path / "pc"  # type: ignore[arg-type]
    monkeypatch.setenv("PAGELLM_CACHE_DIR", "~/env-cache")
    assert resolve_cache_dir() == tmp_path / "env-cache"


def test_the_cache_follows_xdg_cache_home(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A container whose home cannot be written sets XDG_CACHE_HOME, which vLLM follows;
    PageLLM insisted on ~/.cache. PAGELLM_CACHE_DIR still comes first."""
    from pagellm.cache_dir import resolve_cache_dir

    monkeypatch.delenv("PAGELLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir() == tmp_path / "xdg" / "pagellm"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not a base directory (the spec)
    assert resolve_cache_dir() == tmp_path / "home" / ".cache" / "pagellm"
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "own"))
    assert resolve_cache_dir() == tmp_path / "own"


def test_api_keys_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty Kubernetes secret (`PAGELLM_API_KEY=`) served without a key, and a secret
    made from a file kept its newline, so no request matched it."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = build_parser().parse_args(["serve"])
    monkeypatch.setenv("PAGELLM_API_KEY", "")
    with pytest.raises(ValueError, match=r"\$PAGELLM_API_KEY is set, but empty"):
        server_settings(args, 0.0, "x")
    monkeypatch.setenv("PAGELLM_API_KEY", "topsecret\n")
    assert server_settings(args, 0.0, "x").api_key == ["topsecret"]
    monkeypatch.setenv("PAGELLM_ADMIN_API_KEY", " ")
    with pytest.raises(ValueError, match="PAGELLM_ADMIN_API_KEY is set, but empty"):
        server_settings(args, 0.0, "x")


def test_unknown_pagellm_variables_are_named(monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """`PAGELLM_APIKEY=secret` was ignored without a word, and the server was open."""
    import re

    from pagellm.entrypoints import cli

    monkeypatch.setenv("PAGELLM_APIKEY", "secret")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", "/tmp/somewhere")
    cli._warn_unknown_variables()
    assert ("unknown environment variable PAGELLM_APIKEY, ignored (did you mean "
            "PAGELLM_API_KEY?)") in caplog.text
    assert "PAGELLM_CACHE_DIR" not in caplog.text
    # The list is every variable the source names.
    source = "\n".join(path.read_text() for path in
                       Path(cli.__file__).parents[1].rglob("*.py"))
    assert set(re.findall(r'"(PAGELLM_[A-Z_]+)"', source)) == set(cli.ENVIRONMENT_VARIABLES)


def test_the_server_logs_the_options_it_was_given() -> None:
    """As vLLM's does: what a ConfigMap set shows in the log (keys hidden)."""
    from pagellm.entrypoints.cli import _non_default_args

    args = build_parser().parse_args(["serve", "--max-model-len", "4K", "--api-key", "s3",
                                      "--max-request-bytes", "8MiB"])
    assert _non_default_args(args) == {"max_model_len": 4096, "api_key": "***"}
