"""A second server, with an API key from the environment, stopped by signals mid-stream."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagellm.cache_dir import resolve_cache_dir
from pagellm.model import cpu_kernels
from pagellm.model.resolve import resolve_model_path
from tests.server.conftest import MODEL_NAME, Server, start_server
from tests.server.test_kv_events import Follower

API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("keyed"), "--shutdown-timeout", "1",
                          env={"PAGELLM_API_KEY": API_KEY})
    yield server
    server.stop()


def test_api_key_from_environment(keyed_server: Server) -> None:
    anonymous = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key="wrong",
                              max_retries=0)
    with pytest.raises(openai.AuthenticationError) as excinfo:
        anonymous.models.list()
    assert excinfo.value.status_code == 401
    no_header = httpx.post(f"{keyed_server.url}/v1/completions",
                           json={"prompt": "Hi", "max_tokens": 1})
    assert no_header.status_code == 401
    assert no_header.json()["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY, max_retries=0)
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).choices
    assert httpx.get(f"{keyed_server.url}/health").status_code == 200
    assert httpx.get(f"{keyed_server.url}/metrics").status_code == 200
    # Cached prompts' tokens are not for anonymous eyes.
    assert httpx.get(f"{keyed_server.url}/kv_cache_events").status_code == 401


def _streaming(server: Server, api_key: str | None) -> tuple[threading.Thread, list[str]]:
    """A long stream read on a thread, started and producing by the time this returns."""
    received: list[str] = []

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60,
                              headers=headers) as response:
                for line in response.iter_lines():
                    received.append(line)
        except httpx.HTTPError:
            received.append("<connection closed>")

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + 60
    while not any(line.startswith("data: ") for line in received):
        assert time.monotonic() < deadline, "no streamed output"
        time.sleep(0.05)
    return reader, received


def _assert_ended_cleanly(server: Server, code: int, reader: threading.Thread,
                          received: list[str]) -> None:
    reader.join(timeout=10)
    log = server.log_text
    assert code == 0, log
    assert "Traceback" not in log, log
    assert "shutting down" in log
    assert not reader.is_alive()
    events = [line for line in received if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert "shutting down" in events[-2], "the stream was cut instead of ended with an error"


def test_sigterm_mid_stream_stops_cleanly(keyed_server: Server) -> None:
    """Runs last in this module's use of keyed_server: it stops that server."""
    server = keyed_server
    reader, received = _streaming(server, API_KEY)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(timeout=30)
    assert time.monotonic() - started < 15  # the graceful timeout, then abort
    _assert_ended_cleanly(server, code, reader, received)


def test_second_ctrl_c_aborts_at_once_and_still_ends_streams(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """uvicorn's force exit used to cancel the handlers mid-response: a traceback per
    request and streams cut without [DONE]. Now they are aborted and end properly."""
    server = start_server(tmp_path_factory.mktemp("forced"), "--shutdown-timeout", "60")
    try:
        reader, received = _streaming(server, None)
        started = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        server.process.send_signal(signal.SIGINT)
        code = server.process.wait(timeout=30)
        assert time.monotonic() - started < 10  # not the 60 s grace period
        _assert_ended_cleanly(server, code, reader, received)
    finally:
        server.stop()


def test_kv_cache_event_followers_do_not_hold_up_a_shutdown(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A follower's stream has no end of its own: it ends when shutting down starts,
    instead of keeping the server up for the whole grace period."""
    server = start_server(tmp_path_factory.mktemp("followed"), "--shutdown-timeout", "60")
    follower = Follower(server)
    try:
        follower.until(lambda f: f.seq >= 0)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        code = server.process.wait(timeout=30)
        assert time.monotonic() - started < 10  # not the 60 s grace period
        assert code == 0 and "Traceback" not in server.log_text, server.log_text
    finally:
        follower.close()
        server.stop()


def test_sigterm_while_the_model_loads_stops_the_start_and_its_compiler(
        tmp_path: Path) -> None:
    """A pod deleted during a cold start: SIGTERM went unanswered by a container's PID 1
    (no handler yet), and elsewhere killed the server but left its compiler running.
    It now ends the start as Ctrl-C does, with the compiler's whole process group."""
    if not cpu_kernels._instruction_set()[0]:
        pytest.skip("no kernels are built on this CPU")
    model = resolve_model_path(None, resolve_cache_dir())
    pids = tmp_path / "pids"
    compiler = tmp_path / "slow-g++"
    # A compiler driver that starts a child of its own, as g++ starts cc1plus.
    compiler.write_text(f'#!/bin/bash\n[ "$1" = --version ] && echo "slow-g++ 1" && exit 0\n'
                        f'sleep 120 & echo $! >> {pids}\necho $$ >> {pids}\nwait\n')
    compiler.chmod(0o755)
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model),
               "--port", "0", "--cache-dir", str(tmp_path / "cache")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "CXX": str(compiler)})
    try:
        deadline = time.monotonic() + 120
        while not (pids.exists() and len(pids.read_text().split()) == 2):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 130
        assert process.stdout is not None
        assert b"pagellm: interrupted while starting" in process.stdout.read()
    finally:
        process.kill()
    for pid in map(int, pids.read_text().split()):
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(
            f"/proc/{pid}/stat").read_text().split()[2], f"compiler process {pid} still runs"
