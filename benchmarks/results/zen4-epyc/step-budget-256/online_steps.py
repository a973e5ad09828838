"""One online shared-prefix run of PageLLM's server in int8 mode, all requests at once:
wall time and the engine's step count from /metrics (`python online_steps.py BUDGET
MODEL_DIR [SERVER OPTIONS...]`; with `STEPLOG=PATH PYTHONPATH=server-step-log` the
server also writes each step's start and duration, see server-step-log/)."""

import asyncio
import os
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

from transformers import AutoTokenizer  # noqa: E402

from pagellm.bench.online import (  # noqa: E402
    OnlineClient,
    ServerProcess,
    drive,
    free_port,
    pagellm_server_command,
)
from pagellm.bench.workloads import build_workload  # noqa: E402


def main() -> None:
    budget, model_dir = sys.argv[1], Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    workload = build_workload("shared-prefix", tokenizer)
    port = free_port()
    server = ServerProcess(pagellm_server_command(
        model_dir, port, True, ["--max-num-batched-tokens", budget, "--quantize-activations",
                                  *sys.argv[3:]]),
        port)
    server.start()
    try:
        before = server.metrics()

        async def run() -> float:
            client = OnlineClient(server.base_url, server.model_name())
            origin = time.perf_counter()
            await drive(client, workload, tokenizer, float("inf"), 0, origin)
            wall = time.perf_counter() - origin
            await client.close()
            return wall

        wall = asyncio.run(run())
        steps = server.metrics()["pagellm_iteration_tokens_count"] - before.get(
            "pagellm_iteration_tokens_count", 0.0)
        print(f"{budget} wall {wall:.3f} steps {steps:.0f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
