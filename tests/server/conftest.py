"""A real `pagellm serve` process on 127.0.0.1, shared by the server tests.

One server for the session (the model loads once), with a small KV pool, a short
context and a small body limit so that the limits are cheap to hit. Tests that need the
engine idle wait for it through /metrics, exactly as an operator would.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_NAME = "SmolLM2-135M-Instruct"
# Numbers the load tests measured, printed at the end of the run.
REPORT: list[str] = []
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 1 << 20
SERVER_ARGS = ["--kv-cache-memory-bytes", "128MiB", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-request-bytes", str(MAX_REQUEST_BYTES), "--shutdown-timeout", "2",
               "--log-stats-interval", "2", "--enable-kv-cache-events"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    # How the server's certificate is checked (its CA, for an HTTPS test server).
    verify: ssl.SSLContext | bool = True
    uds: Path | None = None  # the Unix socket it listens on instead of a port (--uds)

    def http(self, timeout: float = 10) -> httpx.Client:
        """An HTTP client that reaches the server, however it listens."""
        transport = None if self.uds is None else httpx.HTTPTransport(uds=str(self.uds))
        return httpx.Client(verify=self.verify, transport=transport, timeout=timeout)

    @property
    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name, without the model_name label every sample has;
        other labels stay in the key: 'pagellm_request_finished_total{finished_reason="stop"}'."""
        with self.http() as http:
            text = http.get(f"{self.url}/metrics").text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or "_bucket" in line or not line.strip():
                continue
            sample, value = line.rsplit(" ", 1)
            name, _, labels = sample.partition("{")
            kept = [label for label in labels.rstrip("}").split(",")
                    if label and not label.startswith("model_name=")]
            values[name + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
        return values

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Metrics once nothing runs, waits, or holds a KV block; fails on a leak."""
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            idle = (metrics["pagellm_num_requests_running"] == 0
                    and metrics["pagellm_num_requests_waiting"] == 0
                    and metrics["pagellm_kv_cache_usage"] == 0)
            if idle:
                return metrics
            assert time.monotonic() < deadline, f"engine not idle after {timeout} s: {metrics}"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Stops the server with `sig`, as an orchestrator or Ctrl-C would; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout)


def start_server(tmp: Path, *extra: str, env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0, https_ca: Path | None = None,
                 uds: Path | None = None) -> Server:
    """A server with SERVER_ARGS and `extra`; `https_ca`: it serves HTTPS (give it
    --ssl-keyfile and --ssl-certfile) with a certificate this CA file vouches for;
    `uds`: it listens on that Unix socket instead of a port."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    address = ["--port", str(port)] if uds is None else ["--uds", str(uds)]
    command = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", *address,
               *SERVER_ARGS, *extra]
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    server = Server(process, f"{'https' if https_ca else 'http'}://127.0.0.1:{port}", log,
                    ssl.create_default_context(cafile=str(https_ca)) if https_ca else True,
                    uds)
    deadline = time.monotonic() + startup_timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log_text}")
        try:
            with server.http(timeout=2) as http:
                if http.get(f"{server.url}/health").status_code == 200:
                    return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"server not healthy after {startup_timeout} s:\n{server.log_text}")
        time.sleep(0.25)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in REPORT:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp("server"))
    yield server
    code = server.stop(signal.SIGINT)  # SIGTERM mid-stream is tested in test_shutdown
    log = server.log_text
    assert code == 0, f"server exited with {code}:\n{log}"
    assert "Traceback" not in log, log


@pytest.fixture(scope="session")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture()
def async_client(server: Server) -> openai.AsyncOpenAI:
    """Per test: an async client is bound to the event loop it first runs on."""
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                              timeout=120)
